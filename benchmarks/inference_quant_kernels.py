"""Weight-only quantised matmul kernels at batch 1 (M = 1, one decode token) on the CPU.

    python benchmarks/inference_quant_kernels.py [--threads 1] [--shape 1536x576] [--layers 60]

Times y = x Wᵀ for one activation row against ``--layers`` different weight matrices in turn (so
the weights stream from DRAM as in a decode step, instead of sitting in cache) with:
fp32 and bf16 ``F.linear``; lmstack's ``Int8Linear`` / ``Int4Linear`` (torch's
``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu`` kernels, bf16 and fp32 activations);
and the dequantise-then-``F.linear`` fallback. Prints µs per matrix, weight bytes read per
second and the ratio to fp32 ``F.linear`` (medians of 5 after a warm-up).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from lmstack.quant import Int4Linear, Int8Linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shape", default="1536x576", help="OxI of each weight matrix")
    ap.add_argument("--layers", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    O, I = map(int, args.shape.split("x"))
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(O, I, generator=g) / I**0.5 for _ in range(args.layers)]
    x = torch.randn(1, I, generator=g)
    w16 = [w.bfloat16() for w in ws]
    q8 = [Int8Linear.from_weight(w) for w in ws]
    q8f = [Int8Linear.from_weight(w, compute_dtype=torch.float32) for w in ws]
    q4 = [Int4Linear.from_weight(w) for w in ws]
    q4f = [Int4Linear.from_weight(w, compute_dtype=torch.float32) for w in ws]
    xb = x.bfloat16()
    cases = {
        "fp32 F.linear": (lambda: [F.linear(x, w) for w in ws], 4),
        "bf16 F.linear": (lambda: [F.linear(xb, w) for w in w16], 2),
        "int8 kernel, bf16 act": (lambda: [m(x) for m in q8], 1),
        "int8 kernel, fp32 act": (lambda: [m(x) for m in q8f], 1),
        "int8 dequant + F.linear": (lambda: [F.linear(x, m.dequantized_weight()) for m in q8], 1),
        "int4 kernel, bf16 act": (lambda: [m(x) for m in q4], 0.5),
        "int4 kernel, fp32 act": (lambda: [m(x) for m in q4f], 0.5),
    }
    print(
        f"{args.layers} weights of {O}x{I}, M=1, torch threads {args.threads}, load avg {os.getloadavg()[0]:.1f}, "
        f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})"
    )
    res = {}
    with torch.inference_mode():
        for name, (fn, bytes_per_w) in cases.items():
            fn()
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            res[name] = statistics.median(ts) / args.layers
            print(
                f"{name:<26}{res[name] * 1e6:>9.1f} µs{O * I * bytes_per_w / res[name] / 1e9:>7.1f} GB/s"
                f"{res['fp32 F.linear'] / res[name]:>7.2f}x fp32",
                flush=True,
            )


if __name__ == "__main__":
    main()
