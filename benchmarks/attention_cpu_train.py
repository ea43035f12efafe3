"""CPU training attention: lmstack's ``matmul`` backend vs F.scaled_dot_product_attention, bf16, causal.

Book of LLMs §2.7 (attention forward and backward). Times forward and forward + backward of one
attention call under bf16 autocast on inputs laid out as the model makes them ((B, T, N, H)
projections viewed as (B, N, T, H), the output reshaped back to (B, T, N·H)), timed in
alternation (matmul, matmul_blockfwd, sdpa, [other], matmul, ...) so a change in machine load hits
all; prints medians and the ratio t_sdpa / t_matmul (> 1: matmul faster). ``matmul`` is the
backend as it runs (SDPA's forward + the block-triangular backward); ``matmul_blockfwd`` the same
with its own block-triangular forward (``SDPA_FORWARD = False``). ``--other FILE`` also times the
``matmul_attention`` function of another copy of the module (e.g. ``git show
main:src/lmstack/kernels/matmul_attention.py > /tmp/old.py``) for before/after figures.

    python benchmarks/attention_cpu_train.py --threads 1 --seq 256,1024 --head-dim 32,64
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
import timeit

import torch
import torch.nn.functional as F


def load_other(path: str):
    spec = importlib.util.spec_from_file_location("other_matmul_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.matmul_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", default="64", help="comma-separated H values")
    ap.add_argument("--seq", default="256,1024", help="comma-separated T = S values")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--other", default=None, help="path of another matmul_attention module to time as 'other'"
    )
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="cpu",
        help="cpu: process CPU time (robust when other jobs share the machine; use with --threads 1)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from lmstack.kernels import matmul_attention as ma

    def matmul(sdpa_forward):
        def fn(q, k, v):
            ma.SDPA_FORWARD = sdpa_forward
            return ma.matmul_attention(q, k, v, causal=True)

        return fn

    fns = {
        "matmul": matmul(True),
        "matmul_blockfwd": matmul(False),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ),
    }
    if args.other:
        other = load_other(args.other)
        fns["other"] = lambda q, k, v: other(q, k, v, causal=True)
    B, N, K = args.batch, args.heads, args.kv_heads
    clock = time.process_time if args.clock == "cpu" else timeit.default_timer
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock; causal, bf16 autocast, B={B} N={N} K={K}; "
        f"median of {args.repeats} after {args.warmup} warm-up, interleaved"
    )
    for H in [int(h) for h in args.head_dim.split(",")]:
        for S in [int(s) for s in args.seq.split(",")]:
            g = torch.Generator().manual_seed(0)
            q, k, v = (
                torch.randn(B, S, n, H, generator=g, dtype=torch.bfloat16)
                .transpose(1, 2)
                .requires_grad_()
                for n in (N, K, K)
            )
            d_out = torch.randn(B, S, N * H, generator=g, dtype=torch.bfloat16)
            fwd = {name: [] for name in fns}
            both = {name: [] for name in fns}
            for i in range(args.warmup + args.repeats):
                for name, fn in fns.items():
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        t0 = clock()
                        o = (
                            fn(q, k, v).transpose(1, 2).reshape(B, S, N * H)
                        )  # as the model reads it
                        t1 = clock()
                    o.backward(d_out)
                    t2 = clock()
                    q.grad = k.grad = v.grad = None
                    if i >= args.warmup:
                        fwd[name].append(t1 - t0)
                        both[name].append(t2 - t0)
            mf = {n: statistics.median(t) * 1e3 for n, t in fwd.items()}
            mb = {n: statistics.median(t) * 1e3 for n, t in both.items()}
            line = " | ".join(f"{n} fwd {mf[n]:.1f} fwd+bwd {mb[n]:.1f} ms" for n in fns)
            ratio = (
                f"sdpa/matmul fwd+bwd {mb['sdpa'] / mb['matmul']:.2f}x, "
                f"matmul_blockfwd/matmul {mb['matmul_blockfwd'] / mb['matmul']:.2f}x"
            )
            if "other" in fns:
                ratio += f", other/matmul {mb['other'] / mb['matmul']:.2f}x"
            print(f"H={H} S={S}: {line} | {ratio}")


if __name__ == "__main__":
    main()
