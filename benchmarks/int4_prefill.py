"""The int4 prefill GEMM: the old path (the whole weight dequantised to bf16/fp32, then ``F.linear`` and a cast,
``int4.gemm_forward_dequant``) against the tiled op (``int4_vnni.gemm``: blocks of output rows dequantised into
an L2-resident buffer and multiplied right after, fp32 output) on SmolLM2-135M's shapes, side by side in one run.

    python benchmarks/int4_prefill.py [--threads 1] [--rows 16,64,88,128,256,512] [--kernel vnni|avx2]
        [--dtype auto|bf16|fp32] [--block 0] [--repeats 5] [--layers 30]

Shapes (O x I): fused QKV 960x576, O 576x576, fused gate/up 3072x576, down 576x1536; ``--layers`` random
weights of each (SmolLM2's 30 layers: with one weight, its codes and the old path's dequantised copy would stay
in cache from call to call, which a model's forward never sees), quantised to int4 with groups of 32, random
activations. Per shape and row count: ms per call, from the fastest of ``--repeats`` rounds of one call per
weight, the two ways alternated (wall clock: with two threads the CPU time would also count a thread spinning
while it waits for the other; the minimum drops rounds where another job held a core), and old / new. ``--dtype auto``: the GEMM dtype ``Int4Linear`` takes on this CPU (``int4.gemm_dtype``: bf16 with
native bf16, else fp32). ``--block``: output rows per block (0: the op's default). To imitate an AVX2-only
CPU on an AVX-512 one: ``LMSTACK_CPU=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``.
"""

from __future__ import annotations

import argparse
import time

import torch

from lmstack.cpu import cpu_features
from lmstack.quant import int4_vnni
from lmstack.quant.int4 import gemm_dtype, gemm_forward_dequant, quantize_int4

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
G = 32


def old_and_new(x, weights, kernel: str, dtype, block: int, repeats: int) -> tuple[float, float]:
    """Seconds per call of the old path and of the tiled op: each round calls one way once per weight in
    ``weights`` (a model's layers: the codes and the old path's dequantised weight do not stay in cache from
    one call to the next), the two ways alternated; the fastest of ``repeats`` rounds (wall clock), after a
    warm-up round each."""
    fns = (
        lambda w: gemm_forward_dequant(x, *w, G, kernel, dtype),
        lambda w: int4_vnni.gemm(x, *w, G, kernel, dtype, block),
    )
    best = [float("inf")] * 2
    for r in range(repeats + 1):
        for j, fn in enumerate(fns):
            t = time.perf_counter()
            for w in weights:
                fn(w)
            if r:
                best[j] = min(best[j], (time.perf_counter() - t) / len(weights))
    return best[0], best[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="16,64,88,128,256,512")
    ap.add_argument(
        "--kernel", default=None, help="vnni | avx2 (default: the one chosen for this CPU)"
    )
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--block", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = args.kernel or int4_vnni.kernel()
    if kernel not in int4_vnni.KERNELS or (why := int4_vnni.build(kernel)) is not None:
        raise SystemExit(f"kernel={kernel!r} cannot run here: {int4_vnni.status() or why}")
    dtype = {"auto": gemm_dtype(), "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"kernel {kernel}, GEMM dtype {str(dtype).removeprefix('torch.')}, block {args.block or 'default'}, "
        f"threads {args.threads}, cpu {cpu_features().source}, amx {cpu_features().has('amx_bf16')}, "
        f"torch {torch.backends.cpu.get_cpu_capability()}"
    )
    print(f"{'shape':>14} {'M':>4} {'old ms':>8} {'new ms':>8} {'old/new':>8}")
    g = torch.Generator().manual_seed(0)
    total = [0.0, 0.0]
    with torch.inference_mode():
        for name, (O, I) in SHAPES.items():
            weights = [
                int4_vnni.pack(*quantize_int4(torch.randn(O, I, generator=g), G))
                for _ in range(args.layers)
            ]
            for M in rows:
                x = torch.randn(M, I, generator=g)
                old, new = old_and_new(x, weights, kernel, dtype, args.block, args.repeats)
                total[0], total[1] = total[0] + old, total[1] + new
                print(
                    f"{name + f' {O}x{I}':>14} {M:>4} {old * 1e3:8.3f} {new * 1e3:8.3f} {old / new:8.2f}"
                )
    print(
        f"{'all':>14} {'':>4} {total[0] * 1e3:8.3f} {total[1] * 1e3:8.3f} {total[0] / total[1]:8.2f}"
    )


if __name__ == "__main__":
    main()
