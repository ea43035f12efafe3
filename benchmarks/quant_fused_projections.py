"""Fused quantised projections (``WeightOnlyLinear.concat_rows``): SmolLM2-135M's q/k/v and gate/up of all
30 layers as separate ``Int4Linear`` / ``Int8Linear`` calls vs one fused call each, at M = 1 and 16 rows.

    python benchmarks/quant_fused_projections.py [--threads 1] [--method int4] [--rows 1,16] [--terms 1|2]
        [--rounds 7]

Random weights of SmolLM2-135M's shapes (D = 576: q 576, k and v 192 each, gate and up 1536 each), one set
per layer, so the codes stream from memory as in a decode step. Each round times the 30 layers' projections
both ways, interleaved; the medians over rounds of the process's CPU time (``time.process_time``: less of
other jobs' load than wall-clock) and of the wall-clock time are printed, per token step.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from lmstack.quant import Int4Linear, Int8Linear, int4_vnni

WIDTHS = {"qkv": (576, 192, 192), "gate_up": (1536, 1536)}
D, LAYERS = 576, 30


def build(method: str, terms: int | None, g: torch.Generator):
    """[(separate linears, fused linear)] for every layer's q/k/v and gate/up."""
    out = []
    for _ in range(LAYERS):
        for widths in WIDTHS.values():
            ws = [torch.randn(o, D, generator=g) / D**0.5 for o in widths]
            if method == "int4":
                parts = [Int4Linear.from_weight(w) for w in ws]
                for p in parts:
                    p.terms = p.terms if terms is None else terms
            else:
                parts = [Int8Linear.from_weight(w) for w in ws]
            fused = type(parts[0]).concat_rows(copy.deepcopy(parts))
            if fused is None:
                raise SystemExit(f"{method} linears ({parts[0].extra_repr()}) could not be fused")
            out.append((parts, fused))
    return out


@torch.inference_mode()
def step(layers, x: torch.Tensor, fused: bool) -> tuple[float, float]:
    c, t = time.process_time(), time.perf_counter()
    for parts, one in layers:
        if fused:
            one(x).split([p.out_features for p in parts], dim=-1)
        else:
            for p in parts:
                p(x)
    return time.process_time() - c, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--method", choices=("int4", "int8"), default="int4")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument(
        "--terms", type=int, default=None, help="int4: int8 terms (default: the kernel's)"
    )
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layers = build(args.method, args.terms, torch.Generator().manual_seed(0))
    first = layers[0][1]
    print(
        f"{args.method} [{first.extra_repr()}], torch threads {args.threads}, cpu "
        f"{torch.backends.cpu.get_cpu_capability()}, int4 kernel {int4_vnni.kernel()}, "
        f"load avg {os.getloadavg()[0]:.1f}"
    )
    for M in (int(r) for r in args.rows.split(",")):
        x = torch.randn(M, D, generator=torch.Generator().manual_seed(M))
        with torch.inference_mode():  # the same numbers both ways
            for parts, one in layers[:2]:
                assert torch.equal(one(x), torch.cat([p(x) for p in parts], dim=-1))
        runs = {False: [], True: []}
        for _ in range(args.rounds):
            for fused in (False, True):
                step(layers, x, fused)  # one untimed pass first, so both ways start alike
                runs[fused].append(step(layers, x, fused))
        (sc, sw), (fc, fw) = (
            tuple(statistics.median(r[i] for r in runs[f]) * 1e3 for i in (0, 1))
            for f in (False, True)
        )
        print(
            f"M={M:3d}: separate CPU {sc:6.2f} ms (wall {sw:6.2f}), fused CPU {fc:6.2f} ms (wall {fw:6.2f}) "
            f"per step of {LAYERS} layers: fused / separate {fc / sc:.3f} (CPU), {fw / sw:.3f} (wall); "
            f"load avg {os.getloadavg()[0]:.1f}"
        )


if __name__ == "__main__":
    main()
