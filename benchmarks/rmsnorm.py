"""RMSNorm forward + backward: lmstack's fused Triton kernel vs ``F.rms_norm`` (PyTorch's kernel).

CS336 notes "优化技巧" (fusion): RMSNorm is memory-bound, so one kernel that reads x once and writes
y once each way is the whole game. PyTorch's ``F.rms_norm`` is itself a fused kernel on CUDA, so
this decides whether ``norm_backend = auto`` should pick ``triton`` on a GPU (``backends.py``).
Prints t(F.rms_norm) / t(triton) per shape (> 1: the Triton kernel is faster) and the bandwidth
each reaches (bytes of x, y, dy, dx and γ moved once, over the time).

    python benchmarks/rmsnorm.py                 # CUDA only; on a CPU it says so and exits
    python benchmarks/rmsnorm.py --rows 16384 --dims 4096 --dtype bf16 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from lmstack.kernels.bench import format_table, machine_info, parse_dtype, time_fn, write_json


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=16384, help="B·S rows")
    p.add_argument("--dims", default="2048,4096,8192", help="comma-separated D")
    p.add_argument("--dtype", default="bf16,fp32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(
            "benchmarks/rmsnorm.py compares CUDA kernels; no CUDA device here (the CPU path is F.rms_norm itself)"
        )
        return
    from lmstack.kernels.triton_rmsnorm import rmsnorm_triton

    info = machine_info("cuda")
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    rows, ratios = [], []
    for name in args.dtype.split(","):
        dtype = parse_dtype(name)
        for D in (int(d) for d in args.dims.split(",")):
            x = torch.randn(args.rows, D, device="cuda", dtype=dtype, requires_grad=True)
            w = (1 + 0.1 * torch.randn(D, device="cuda")).to(dtype).requires_grad_()
            dy = torch.randn_like(x)
            impls = {
                "torch": lambda: F.rms_norm(x, (D,), w, 1e-5),  # noqa: B023
                "triton": lambda: rmsnorm_triton(x, w, 1e-5),  # noqa: B023
            }
            ref = torch.autograd.grad(impls["torch"](), (x, w), dy)
            got = torch.autograd.grad(impls["triton"](), (x, w), dy)
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, got))
            moved = (
                4 * args.rows * D + 3 * D
            ) * x.element_size()  # x, y, dy, dx (+ γ, dγ), each once
            t = {}
            for impl, fn in impls.items():

                def step(fn=fn):
                    torch.autograd.grad(fn(), (x, w), dy)  # noqa: B023

                timing = time_fn(step, "cuda", args.warmup, args.repeats)
                t[impl] = timing.median
                rows.append(
                    {
                        "impl": impl,
                        "dtype": name,
                        "rows": args.rows,
                        "D": D,
                        "median_ms": timing.median * 1e3,
                        "min_ms": timing.min * 1e3,
                        "GB/s": moved / timing.median / 1e9,
                        "max_grad_diff": err,
                    }
                )
            ratios.append(t["torch"] / t["triton"])
            print(
                f"{name} D={D}: triton vs F.rms_norm = {ratios[-1]:.3f}x (fwd+bwd; max grad diff {err:.2g})"
            )
    print(
        format_table(rows, ["impl", "dtype", "D", "median_ms", "min_ms", "GB/s", "max_grad_diff"])
    )
    print(
        f"median speed ratio triton / F.rms_norm (t_torch / t_triton): {statistics.median(ratios):.3f}x"
    )
    if args.json:
        write_json(args.json, {"rows": rows, "ratios": ratios, "machine": info})


if __name__ == "__main__":
    sys.exit(main())
