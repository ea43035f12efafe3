"""Attention backends across sequence lengths: time (forward + backward) and peak memory.

Book of LLMs §2.7 “FlashAttention tiling” / CS336 notes "FlashAttention": tiled attention keeps memory O(S) and, fused into
one GPU kernel, should run about as fast as the vendor kernel.

On a GPU: lmstack's Triton FlashAttention-2 vs ``F.scaled_dot_product_attention`` forced onto
its FlashAttention backend, bf16, causal, forward + backward; prints the speed ratio
t(SDPA flash) / t(lmstack Triton) per S (the aim is ≥ 0.9) after checking that both agree.
Both Triton backward schedules are timed (``atomic``: one pass, dQ added atomically, the
default; ``split``: dK/dV then dQ, deterministic), and the forward alone for each kernel.
On CPU: the PyTorch paths (materialised reference, SDPA, lmstack's tiled flash_pytorch),
fp32, with the peak tensor bytes of each step from the allocator.

    python benchmarks/attention.py                      # CPU sweep or GPU comparison, by device
    python benchmarks/attention.py --seq 512,1024 --heads 8 --head-dim 64 --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from lmstack.kernels.bench import bench_attention, format_table, machine_info, write_json


def check_agreement(B: int, N: int, K: int, S: int, H: int, dtype: torch.dtype) -> float:
    """Largest |O_triton − O_sdpa| and gradient difference on one input (GPU only)."""
    from lmstack.kernels.bench import attention_fn

    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (
        torch.randn(B, n, S, H, generator=gen).to("cuda", dtype).requires_grad_() for n in (N, K, K)
    )
    outs = []
    for backend in ("sdpa_flash", "flash_triton"):
        o = attention_fn(backend, causal=True)(q, k, v)
        grads = torch.autograd.grad(o.float().square().sum(), (q, k, v))
        outs.append((o, *grads))
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(*outs))


def main() -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq", default="1024,2048,4096,8192" if gpu else "256,512,1024,2048")
    p.add_argument("--batch", type=int, default=4 if gpu else 1)
    p.add_argument("--heads", type=int, default=16 if gpu else 8)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10 if gpu else 3)
    p.add_argument("--warmup", type=int, default=3 if gpu else 1)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    seqs = [int(s) for s in args.seq.split(",")]
    K = args.kv_heads or args.heads
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    backends = ["sdpa_flash", "flash_triton"] if gpu else ["reference", "sdpa", "flash_pytorch"]
    info = machine_info(device)
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    if gpu:
        err = check_agreement(1, args.heads, K, 512, args.head_dim, dtype)
        print(f"agreement check (S=512, bf16): max |Δ| over O, dQ, dK, dV = {err:.3g}")
    rows, fwd_rows = [], []

    def bench(b: str, S: int, backward: bool = True, label: str | None = None) -> dict:
        row = bench_attention(
            b,
            args.batch,
            args.heads,
            K,
            S,
            args.head_dim,
            dtype,
            device,
            causal=True,
            backward=backward,
            warmup=args.warmup,
            repeats=args.repeats,
        )
        row["backend"] = label or b
        return row

    for S in seqs:
        for b in backends:
            rows.append(bench(b, S))
        if gpu:  # the other backward schedule, and the forward pass alone
            os.environ["LMSTACK_FLASH_BWD"] = "split"
            rows.append(bench("flash_triton", S, label="flash_triton_split"))
            os.environ.pop("LMSTACK_FLASH_BWD")
            fwd_rows += [bench(b, S, backward=False) for b in backends]
    for r in (
        rows + fwd_rows
    ):  # attention FLOPs: 4·B·N·T·S·H, halved by the causal mask; backward 2.5x forward
        flops = 4 * r["B"] * r["N"] * r["S"] * r["S"] * r["H"] * (0.5 if r["causal"] else 1.0)
        r["TFLOP/s"] = (
            flops * (3.5 if r["pass"] == "fwd+bwd" else 1.0) / (r["median_ms"] * 1e-3) / 1e12
        )
    print(
        f"causal attention fwd+bwd, B={args.batch} N={args.heads} K={K} H={args.head_dim} "
        f"{str(dtype)[6:]} on {device}; median / min of {args.repeats} after {args.warmup} warm-up"
    )
    print(format_table(rows, ["backend", "S", "median_ms", "min_ms", "TFLOP/s", "peak_mib"]))
    if fwd_rows:
        print("forward only:")
        print(format_table(fwd_rows, ["backend", "S", "median_ms", "min_ms", "TFLOP/s"]))
        for S in seqs:
            t = {r["backend"]: r["median_ms"] for r in rows if r["S"] == S}
            f = {r["backend"]: r["median_ms"] for r in fwd_rows if r["S"] == S}
            print(
                f"S={S}: forward {f['sdpa_flash'] / f['flash_triton']:.3f}x, fwd+bwd split schedule "
                f"{t['sdpa_flash'] / t['flash_triton_split']:.3f}x of sdpa_flash"
            )
    ratios = []
    peer, ours = ("sdpa_flash", "flash_triton") if gpu else ("sdpa", "flash_pytorch")
    for S in seqs:
        t = {r["backend"]: r["median_ms"] for r in rows if r["S"] == S}
        ratios.append(t[peer] / t[ours])
        line = f"S={S}: speed {ours} vs {peer} = {ratios[-1]:.3f}x"
        if not gpu:
            m = {r["backend"]: r["peak_mib"] for r in rows if r["S"] == S}
            line += f"; peak memory reference / flash_pytorch = {m['reference'] / m['flash_pytorch']:.1f}x"
        print(line)
    print(
        f"median speed ratio {ours}/{peer} (t_{peer} / t_{ours}): {statistics.median(ratios):.3f}x"
    )
    if args.json:
        write_json(
            args.json,
            {
                "rows": rows,
                "forward_rows": fwd_rows,
                "ratios": dict(zip(seqs, ratios)),
                "machine": info,
            },
        )


if __name__ == "__main__":
    main()
