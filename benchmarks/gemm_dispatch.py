"""CPU fp32 GEMM: torch's BLAS (``F.linear``, MKL in the wheels) vs oneDNN (``ops.gemm.onednn_linear``) vs oneDNN on
the prepacked weight (``ops.gemm.packed_weight``, what inference products run), per row count, on SmolLM2-135M's
weight shapes — the measurement behind a row of ``ops.gemm.MEASURED`` (docs/kernels.md).

    nice -n 10 python benchmarks/gemm_dispatch.py [--threads 1] [--rounds 7]

For each weight (out × in: 1536×576 gate/up, 576×1536 down, 576×576 q/o, 49152×576 the unembedding; the engine
fuses q/k/v into 960×576 and gate/up into 3072×576) and each row count M, the three are timed in alternation (``--rounds`` rounds of a few calls each, after a warm-up; this
thread's CPU time, so a loaded machine stretches neither side; ``--threads 1`` for that to hold); printed:
the median time of each and the ratios BLAS / oneDNN and BLAS / packed (> 1: oneDNN faster), then per weight the
row counts where each is ≥ 1.1x faster, beside ``choose_gemm("auto")`` for this CPU (what a ``MEASURED`` row is read from).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lmstack.cpu import cpu_features
from lmstack.ops.gemm import _onednn_mm_t, choose_gemm, onednn_ok, packed_weight
from lmstack.ops.gemm import onednn_linear as onednn

SHAPES = {
    "gate/up": (1536, 576),
    "gate+up": (3072, 576),
    "down": (576, 1536),
    "q/o": (576, 576),
    "q+k+v": (960, 576),
    "unembed": (49152, 576),
}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048)


def timed(fn, calls: int) -> float:
    """Seconds of this thread's CPU time per call (one torch thread: the time it computed, not the time a
    shared machine's other processes held the core)."""
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t0) / calls


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not onednn_ok(torch.zeros(1)):
        raise SystemExit(
            "this torch build has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)"
        )
    f = cpu_features()
    print(f"{f.vendor or 'unknown vendor'}; {f.summary()}; {args.threads} thread(s)")
    print(
        "| weight (out x in) | M | BLAS ms | oneDNN ms | packed ms | BLAS / oneDNN | BLAS / packed |"
    )
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    ratios: dict[str, dict[int, float]] = {}
    packed_ratios: dict[str, dict[int, float]] = {}
    for name, (o, i) in SHAPES.items():
        w = torch.randn(o, i, generator=g)
        wp = packed_weight(w)
        ratios[name], packed_ratios[name] = {}, {}
        for M in args.rows:
            if name == "unembed" and M > 512:
                continue  # (2048, 49152) logits: the perplexity path chunks them
            x = torch.randn(M, i, generator=g)
            calls = max(1, int(2e8 / (2 * M * o * i)))  # ~0.1 s of work per round at 100 GFLOP/s
            blas, dnn = lambda: F.linear(x, w), lambda: onednn(x, w)  # noqa: B023
            packed = lambda: _onednn_mm_t(x, wp)  # noqa: B023, E731
            blas(), dnn(), packed()
            tb, td, tp = [], [], []
            for _ in range(args.rounds):
                tb.append(timed(blas, calls))
                td.append(timed(dnn, calls))
                tp.append(timed(packed, calls))
            b, d, pk = statistics.median(tb), statistics.median(td), statistics.median(tp)
            ratios[name][M], packed_ratios[name][M] = b / d, b / pk
            print(
                f"| {name} {o}x{i} | {M} | {b * 1e3:.3f} | {d * 1e3:.3f} | {pk * 1e3:.3f} "
                f"| {b / d:.2f} | {b / pk:.2f} |"
            )
    for label, table in (("oneDNN", ratios), ("packed oneDNN", packed_ratios)):
        for name, r in table.items():
            faster = [M for M, x in r.items() if x >= 1.1]
            print(f"{name}: {label} >= 1.1x at M = {faster or 'none'}")
    print(f"choose_gemm('auto') here: {choose_gemm('auto')}")


if __name__ == "__main__":
    main()
