"""lmstack's C++ paged decode attention alone, per pool dtype: the time of one decode step's 30 calls.

    python benchmarks/paged_kernel.py [--variant avx512|avx2|generic] [--batch 16,1] [--positions 140|200-400]
                                      [--source OTHER.cpp]

SmolLM2-135M's shapes (9 query heads on 3 KV heads, H = 64, 30 layers, blocks of 16 tokens): each row at
``--positions`` (one position, or ``LO-HI``: each row's drawn uniformly from that range) with this step's k,
v, its blocks drawn at random from a 2000-block pool per layer (each
layer its own pool, so the K/V come from DRAM as in the engine; int8/fp8 with per-block scales). The best
of 7 repeats is printed, in ms for 30 calls. ``--source`` also builds another version of
``csrc/paged_decode.cpp`` (say ``git show REV:src/lmstack/inference/csrc/paged_decode.cpp > old.cpp``) with
the same flags and times both, alternating, so a change is compared under the same load.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from lmstack.inference import paged_kernel
from lmstack.utils import build_extension

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn)
N, K, H, BS, LAYERS, BLOCKS = 9, 3, 64, 16, 30, 2000


def load(variant: str, source: Path | None):
    """{name: op}: this tree's kernel and, with ``source``, that file built as ``paged_decode_bench``."""
    why = paged_kernel.build(variant)
    if why is not None:
        raise SystemExit(f"paged kernel {variant} not built: {why}")
    ops = {"this": getattr(torch.ops.lmstack_attn, f"paged_decode_{variant}")}
    if source is not None:
        op = f"paged_decode_bench_{variant}"
        _, why = build_extension(
            f"lmstack_attn_bench_{variant}",
            source,
            [*paged_kernel.VARIANTS[variant][1], f"-DLMSTACK_OP={op}"],
        )
        if why is not None:
            raise SystemExit(f"{source}: {why}")
        ops[source.name] = getattr(torch.ops.lmstack_attn, op)
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default=paged_kernel.selected()[0])
    ap.add_argument("--batch", default="16,1")
    ap.add_argument("--positions", default="140")
    ap.add_argument("--source", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ops = load(args.variant, args.source)
    print(
        f"paged_decode_{args.variant}, cpu {torch.backends.cpu.get_cpu_capability()}, load avg "
        f"{os.getloadavg()[0]:.1f}; ms per 30 calls (N={N}, K={K}, H={H}, p={args.positions})"
    )
    g = torch.Generator().manual_seed(0)
    lo, _, hi = args.positions.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 0 <= lo <= hi:
        raise SystemExit(f"--positions {args.positions!r}: expected P or LO-HI with 0 <= LO <= HI")
    m = -(-(hi + 1) // BS)  # blocks per row
    for B in (int(b) for b in args.batch.split(",")):
        q = torch.randn(B, N, 1, H, generator=g)
        k_new, v_new = torch.randn(B, K, H, generator=g), torch.randn(B, K, H, generator=g)
        pos = torch.randint(lo, hi + 1, (B,), generator=g)
        for dtype in DTYPES:
            x = torch.randn(LAYERS, BLOCKS, BS, K, H, generator=g)
            codes = dtype in (torch.int8, torch.float8_e4m3fn)
            k_pool = (x * 20).clamp(-127, 127).to(dtype) if codes else x.to(dtype)
            v_pool = k_pool.flip(1)
            scale = torch.rand(LAYERS, BLOCKS, K, generator=g) * 0.05 if codes else None
            table = (torch.randperm(BLOCKS - 1, generator=g)[: B * m] + 1).view(B, m)
            best = dict.fromkeys(ops, float("inf"))
            for _ in range(7):
                for name, op in ops.items():
                    t = time.perf_counter()
                    for layer in range(LAYERS):
                        s = None if scale is None else scale[layer]
                        op(q, k_pool[layer], v_pool[layer], table, pos, k_new, v_new, s, s, 0, 0.0)
                    best[name] = min(best[name], time.perf_counter() - t)
            cells = "  ".join(f"{n} {v * 1e3:6.2f}" for n, v in best.items())
            print(f"  {B:3d} rows  {str(dtype).removeprefix('torch.'):14s} {cells}")


if __name__ == "__main__":
    main()
