"""What a training run measures and writes: throughput and MFU between log rows, the device's peak
FLOP/s that MFU divides by, the metrics JSONL, scalar means over ranks, and the unigram baseline.

Book: 工程细节/基准测试 (time with a monotonic clock, synchronise CUDA before reading it), 模型规模定律
(training FLOPs per step; MFU = achieved FLOP/s ÷ the device's peak, Chowdhery et al. 2022, PaLM §B).
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lmstack.accounting import measure_cpu
from lmstack.utils import FLOAT_DTYPES, torch_dtype


@functools.lru_cache(maxsize=8)
def device_peak_flops(device_type: str, precision: str) -> float:
    """Measured dense matmul FLOP/s of this device in the run's compute dtype (for MFU)."""
    key = "bf16" if precision == "bf16" else ("fp16" if precision == "fp16" else "fp32")
    if device_type == "cpu":
        return measure_cpu(quick=False, dtypes=(key,)).flops(key)
    if device_type == "cuda":
        dt = torch_dtype(key, allowed=FLOAT_DTYPES)
        n = 8192
        a, b = (
            torch.randn(n, n, device="cuda", dtype=dt),
            torch.randn(n, n, device="cuda", dtype=dt),
        )
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        return 10 * 2 * n**3 / (time.perf_counter() - t0)
    return float("nan")


def unigram_baseline(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of ``val`` under the add-one unigram distribution of ``train``:
    the loss a model reaches by learning token frequencies and nothing else."""
    counts = np.bincount(np.asarray(train), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(val)].mean())


def mean_over_ranks(value: float, device: torch.device) -> float:
    """Average a scalar over all ranks (identity for one process); float64 so the mean is exact
    enough for a divergence check every rank must agree on."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    return float(t[0]) / dist.get_world_size()


def append_jsonl(path: str | os.PathLike, row: dict[str, Any]) -> None:
    """One JSON line appended (a crash cuts at most the last line; ``plot.read_metrics`` skips it)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


class Throughput:
    """Tokens/s and MFU over the interval since the last row (``row``), and the run's elapsed time.

    MFU = flops_per_step · steps in the interval / interval seconds / peak FLOP/s, with the steps
    counted from the tokens seen (tokens / tokens_per_step) so a resumed or shortened interval is
    measured as it was trained. ``sync`` runs before each clock read (CUDA's queue drained)."""

    def __init__(
        self,
        tokens_seen: int,
        tokens_per_step: int,
        flops_per_step: float,
        peak_flops: float | None,
        sync=None,
    ):
        self.tokens_per_step, self.flops_per_step, self.peak = (
            tokens_per_step,
            flops_per_step,
            peak_flops,
        )
        self.sync = sync or (lambda: None)
        self.t_start = self.t_last = time.perf_counter()
        self.tokens_last = tokens_seen

    def row(self, tokens_seen: int) -> dict[str, float]:
        """{"tokens", "tokens_per_s", "elapsed_s"} (+ "mfu" when the peak is known); starts the next interval."""
        self.sync()
        now = time.perf_counter()
        dt = max(now - self.t_last, 1e-9)
        tokens = tokens_seen - self.tokens_last
        out = {"tokens": tokens_seen, "tokens_per_s": tokens / dt, "elapsed_s": now - self.t_start}
        if self.peak:
            out["mfu"] = self.flops_per_step * (tokens / self.tokens_per_step) / dt / self.peak
        self.t_last, self.tokens_last = now, tokens_seen
        return out

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start


def progress_postfix(row: dict[str, Any], last_eval: dict[str, float]) -> dict[str, str]:
    """The progress bar's loss, tokens/s, MFU and last validation loss."""
    post = {"loss": f"{row['loss']:.3f}", "tok/s": f"{row['tokens_per_s']:,.0f}"}
    if "mfu" in row:
        post["MFU"] = f"{row['mfu']:.1%}"
    if last_eval:
        post["val"] = f"{last_eval['val_loss']:.3f}"
    return post
