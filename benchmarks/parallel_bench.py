"""Distributed-training benchmarks on gloo CPU ranks (not a test; prints a report).

1. DDP step time: lmstack naive per-parameter all-reduce vs lmstack bucketed all-reduce overlapped
   with backward, and torch DDP as the peer (ratio lmstack/peer).
2. Bytes sent per rank per step, measured on the ring (``count_bytes``) vs
   ``lmstack.accounting.comm`` for DDP, ZeRO-1/2/3 and TP.
3. Pipeline bubble measured from per-action timings vs (p-1)/(m+p-1) and the unit-cost simulation.
4. ZeRO-3 step time: lmstack FullyShard vs torch FSDP2 ``fully_shard`` as the peer.

    python benchmarks/parallel_bench.py [--world 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _ce(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def _median_step_times(runs: dict, x, y, repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per training step of each (model, optimizer) in ``runs``; the runs are
    interleaved within each repeat so that load from other processes hits them alike."""
    times = {name: [] for name in runs}
    for i in range(repeats + warmup):
        for name, (runner, opt) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            _ce(runner(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _worker(rank, world, port, repeats, q):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    from lmstack.accounting.comm import (
        all_gather_bytes,
        all_reduce_bytes,
        data_parallel_step_bytes,
        tp_layer_bytes,
    )
    from lmstack.model.config import ModelConfig
    from lmstack.model.transformer import Transformer
    from lmstack.parallel import collectives as C
    from lmstack.parallel.ddp import DataParallel, broadcast_module
    from lmstack.parallel.mesh import DeviceMesh
    from lmstack.parallel.pipeline import PipelineParallel, bubble_formula, schedule, simulate
    from lmstack.parallel.tensor import TensorParallel
    from lmstack.parallel.zero import FullyShard, ZeroOptimizer

    out = {}
    cfg = ModelConfig(
        vocab_size=2048, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=768, max_seq_len=256
    )
    g = torch.Generator().manual_seed(rank)
    B, S = 4, 128
    x = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, S), generator=g)

    # 1. DDP step time; the strategies are interleaved within each repeat so that load from other
    # processes on a shared machine hits them alike
    from torch.nn.parallel import DistributedDataParallel

    makers = {
        "step_local": lambda m: m,
        "step_naive": lambda m: DataParallel(m, mode="naive", impl="torch"),
        "step_bucketed": lambda m: DataParallel(m, mode="bucketed", bucket_mb=4, impl="torch"),
        "step_torch_ddp": lambda m: DistributedDataParallel(m, bucket_cap_mb=4),
    }
    runs = {}
    for name, make in makers.items():
        model = Transformer(cfg, seed=0)
        runs[name] = (make(model), torch.optim.SGD(model.parameters(), lr=1e-3))
    out.update(_median_step_times(runs, x, y, repeats))
    del runs

    # 2. bytes per step (fp32 gradients), measured on the ring vs the accounting model
    small = ModelConfig(
        vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
    )
    xs, ys = x[:, :32] % 256, y[:, :32] % 256
    P = Transformer(small, seed=0).num_params()
    bytes_rows = []
    for strat in ("ddp", "zero1", "zero2", "zero3"):
        model = Transformer(small, seed=0)
        if strat == "ddp":
            runner, opt = DataParallel(model), torch.optim.AdamW(model.parameters())
        elif strat == "zero3":
            runner = FullyShard(model)
            opt = torch.optim.AdamW(runner.parameters())
        else:
            broadcast_module(model)
            runner, opt = (
                model,
                ZeroOptimizer(list(model.parameters()), torch.optim.AdamW, stage=int(strat[-1])),
            )
        with C.count_bytes() as c:
            _ce(runner(xs), ys).backward()
            opt.step()
        t = torch.tensor([float(c.total)], dtype=torch.float64)
        dist.all_reduce(t)
        bytes_rows.append(
            (strat, t.item() / world, data_parallel_step_bytes(P, world, strat, "fp32"))
        )
    model = Transformer(small, seed=0)
    tpm = TensorParallel(model, None)
    with C.count_bytes() as c:
        _ce(tpm(xs), ys).backward()
    Bt, St = xs.shape
    act = Bt * St * small.d_model * 4
    pred = (
        small.n_layers * tp_layer_bytes(small, Bt, St, world, "fp32")
        + 2 * all_reduce_bytes(act, world)
        + all_gather_bytes(Bt * St * small.vocab_size * 4, world)
    )
    bytes_rows.append(("tp", float(c.total), pred))
    out["bytes"] = bytes_rows

    # 3. pipeline bubble (pp = world), real model, m micro-batches of 2 sequences
    mesh = DeviceMesh.build(pp=world)
    pcfg = ModelConfig(
        vocab_size=2048,
        d_model=256,
        n_layers=4 * world,
        n_heads=8,
        n_kv_heads=4,
        d_ff=768,
        max_seq_len=256,
    )
    rows = []
    for m in (2, 4, 8):
        for kind in ("gpipe", "1f1b", "zb"):
            model = Transformer(pcfg, seed=0)
            pipe = PipelineParallel(model, mesh.group("pp"), micro_batches=m, schedule_kind=kind)
            xb = torch.randint(
                0, pcfg.vocab_size, (2 * m, 64), generator=torch.Generator().manual_seed(0)
            )
            bubbles = []
            for i in range(max(2, repeats // 2) + 1):
                pipe.train_step(xb, xb, _ce)
                for p in pipe.parameters():
                    p.grad = None
                b = pipe.measured_bubble()
                if i >= 1:
                    bubbles.append(b)
            rows.append(
                (
                    kind,
                    m,
                    statistics.median(bubbles),
                    bubble_formula(world, m),
                    simulate(schedule(kind, world, m))["bubble"],
                )
            )
    out["bubble"] = rows

    # 4. ZeRO-3 step time (model of 1): lmstack FullyShard (flat shards per block and parameter
    # class, prefetch) vs torch FSDP2 fully_shard per block (peer); interleaved like 1
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    z_runs = {}
    r1 = FullyShard(Transformer(cfg, seed=0))
    z_runs["zero3_lmstack"] = (r1, torch.optim.SGD(r1.parameters(), lr=1e-3))
    m2 = Transformer(cfg, seed=0)
    dmesh = init_device_mesh("cpu", (world,))
    for blk in m2.blocks:
        fully_shard(blk, mesh=dmesh)
    fully_shard(m2, mesh=dmesh)
    z_runs["zero3_fsdp2"] = (m2, torch.optim.SGD(m2.parameters(), lr=1e-3))
    out.update(_median_step_times(z_runs, x, y, repeats))
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, a.world, _port_holder[0], a.repeats, q))
        for r in range(a.world)
    ]
    for p in procs:
        p.start()
    out = q.get()
    for p in procs:
        p.join()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"gloo, {a.world} ranks × 1 thread"
    )
    print("\n1. DDP step (D=256, L=4, V=2048, B=4/rank, S=128), median seconds")
    print(f"   no communication     {out['step_local']:.4f}")
    print(f"   lmstack naive        {out['step_naive']:.4f}")
    print(
        f"   lmstack bucketed     {out['step_bucketed']:.4f}   bucketed/naive = {out['step_bucketed'] / out['step_naive']:.2f}"
    )
    print(
        f"   torch DDP (peer)     {out['step_torch_ddp']:.4f}   lmstack bucketed/peer = "
        f"{out['step_bucketed'] / out['step_torch_ddp']:.2f}"
    )
    print(
        "\n2. bytes sent per rank per step (fp32): measured on the ring vs lmstack.accounting.comm"
    )
    for name, got, want in out["bytes"]:
        print(
            f"   {name:6s} measured {got:14,.0f}  predicted {want:14,.0f}  ratio {got / want:.4f}"
        )
    print(
        f"\n3. pipeline bubble, p={a.world} stages: measured vs (p-1)/(m+p-1) vs unit-cost simulation"
    )
    for kind, m, meas, formula, sim in out["bubble"]:
        print(
            f"   {kind:5s} m={m}  measured {meas:.3f}  formula {formula:.3f}  simulated {sim:.3f}"
        )
    print("\n4. ZeRO-3 step (model of 1), median seconds")
    print(f"   lmstack FullyShard   {out['zero3_lmstack']:.4f}")
    print(
        f"   torch FSDP2 (peer)   {out['zero3_fsdp2']:.4f}   lmstack/peer = "
        f"{out['zero3_lmstack'] / out['zero3_fsdp2']:.2f}"
    )


_port_holder = [_port()]

if __name__ == "__main__":
    main()
