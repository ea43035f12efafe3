"""Shared helpers for the parallel tests: spawn gloo ranks on 127.0.0.1, a tiny model, a
single-process reference training run to compare against.

The ranks of one ``spawn`` meet through a ``file://`` rendezvous (a FileStore in a fresh temporary
folder), not a TCP port: picking a "free" port and binding it later raced with every other gloo job
on the machine (two concurrent runs could pick the same port, or another process could take it in
between), which made the multi-process tests fail now and then. A barrier right after the rendezvous keeps a
rank from exiting (a test without collectives) while its peers still connect to it."""

from __future__ import annotations

import io
import os
import shutil
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer


def free_port() -> int:
    """A port free right now (torchrun launches only; it may be taken before torchrun binds it)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _entry(rank: int, world: int, store_file: str, fn, payload: bytes):
    args = torch.load(io.BytesIO(payload), weights_only=False)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    # every rank has finished connecting its gloo pairs before any can run a short test and exit: a rank
    # closing its sockets while a peer still connects fails that peer ("connectFullMesh ... closed by peer")
    dist.barrier()
    try:
        fn(rank, world, *args)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


# Modules the fork server imports once. Each rank is forked from that server (a fresh, single-
# threaded process that has run no torch op, so forking it is safe) instead of being a new
# interpreter that imports torch again; torch._dynamo is here because torch.optim imports it on the
# first optimizer. Together these cost seconds per rank, many times per test session.
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "lmstack.model.transformer",
    "lmstack.parallel",
    "lmstack.train.trainer",
    "parallel_helpers",
]


def spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; a failure in any re-raises."""
    import multiprocessing.forkserver as forkserver

    forkserver.set_forkserver_preload(PRELOAD)  # read when the server starts (the first spawn)
    # the arguments travel as bytes: pickled as they are, every tensor would go to shared memory
    # with a file descriptor sent to each rank, more than the fork server passes in one message
    buf = io.BytesIO()
    torch.save(args, buf)
    folder = tempfile.mkdtemp(
        prefix="lmstack_gloo_"
    )  # private to this spawn: no two runs share a store
    try:
        mp.start_processes(
            _entry,
            args=(world, os.path.join(folder, "store"), fn, buf.getvalue()),
            nprocs=world,
            join=True,
            start_method="forkserver",
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def tiny_config(**kw) -> ModelConfig:
    # built without a RuntimeConfig, a Transformer runs SDPA and the eager RMSNorm (the seam's defaults)
    base = dict(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64
    )
    base.update(kw)
    return ModelConfig(**base)


def batches(
    n: int, B: int, S: int, V: int = 64, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, V, (B, S + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


# eps well above fp32 gradient noise: Adam's first step is ≈ lr·sign(g), which would turn
# a 1e-9 difference in a near-zero gradient into a full lr-sized difference in the parameter
OPT_KW = dict(lr=1e-2, weight_decay=0.1, eps=1e-6)


def make_opt(params, lr: float = 1e-2):
    return torch.optim.AdamW(params, **{**OPT_KW, "lr": lr})


def reference(
    cfg: ModelConfig, data, accum: int = 1, freeze: tuple[str, ...] = (), lr: float = 1e-2
):
    """Single-process training on the whole batch: losses and final parameters (by name)."""
    torch.manual_seed(0)
    model = Transformer(cfg, seed=0)
    for n, p in model.named_parameters():
        if n in freeze:
            p.requires_grad_(False)
    opt = make_opt([p for p in model.parameters() if p.requires_grad], lr)
    losses = []
    i = 0
    while i < len(data):
        tot = 0.0
        for _ in range(accum):
            x, y = data[i]
            loss = ce(model(x), y) / accum
            loss.backward()
            tot += float(loss.detach())
            i += 1
        opt.step()
        opt.zero_grad()
        losses.append(tot)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_close_params(got: dict, want: dict, atol=1e-4, rtol=1e-3, prefix=""):
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for n in want:
        torch.testing.assert_close(
            got[n],
            want[n],
            atol=atol,
            rtol=rtol,
            msg=lambda m: f"{prefix}{n}: {m}",  # noqa: B023
        )
