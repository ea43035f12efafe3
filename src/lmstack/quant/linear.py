"""What the weight-only quantised linears share: the forward around a CPU kernel (CS336 notes "量化").

A subclass stores its codes in a ``qweight`` buffer (how ``model.hf.check_float_weights`` spots it)
and its scales, says whether its kernel can run (``_kernel_ok``), calls it
on (M, I) rows in ``compute_dtype`` (``_kernel_mm``) and can rebuild the float weight
(``dequantized_weight``). The forward takes the kernel on CPU, dequantises otherwise, and from
``DEQUANT_ROWS`` rows on (a prefill: compute-bound, where a float GEMM beats a weight-only kernel)
dequantises once and runs ``F.linear`` in the input's dtype. lmstack's own kernels choose that row count per
CPU and kernel by a short measurement (``gemm_rows``; ``LMSTACK_QUANT_GEMM_ROWS`` forces it).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GEMM_ROWS_ENV = "LMSTACK_QUANT_GEMM_ROWS"
# the row counts a measurement tries: from the first one where dequantise-then-GEMM wins (and keeps winning)
GEMM_ROWS_CANDIDATES = (8, 16, 24, 32, 48, 64, 96, 128, 256)
_log = logging.getLogger(__name__)
_measured: dict[str, int | None] = {}


def choose_gemm_rows(times: dict[int, tuple[float, float]]) -> int | None:
    """{rows M: (seconds of the quantised kernel, seconds of dequantise + float GEMM)} -> the smallest measured M
    from which the GEMM is faster at M and at every larger measured M (None: the kernel always wins)."""
    rows = None
    for M in sorted(times, reverse=True):
        kernel, gemm = times[M]
        if gemm >= kernel:
            break
        rows = M
    return rows


def gemm_rows(
    key: str,
    measure: Callable[[int], tuple[float, float]],
    candidates: Sequence[int] = GEMM_ROWS_CANDIDATES,
) -> int | None:
    """From how many activation rows a quantised linear dequantises its weight and runs a float GEMM instead of
    its kernel (a prefill: compute-bound, where the int8 dot products of a decode kernel lose to MKL/oneDNN).

    ``LMSTACK_QUANT_GEMM_ROWS=N`` forces N (1: always the GEMM), ``never`` the kernel at every M; else the
    first call per ``key`` (a kernel name, with the weight's shape where that decides) measures
    ``measure(M) -> (kernel s, GEMM s)`` at ``candidates`` (~0.1 s on a quiet core) and the answer is kept
    for the process
    (``choose_gemm_rows``; logged once at INFO)."""
    env = os.environ.get(GEMM_ROWS_ENV, "").strip().lower()
    if env in ("never", "off", "none"):
        return None
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"{GEMM_ROWS_ENV}={env!r}; expected a row count >= 1 or 'never'")
        return int(env)
    if key not in _measured:
        times = {M: measure(M) for M in candidates}
        _measured[key] = choose_gemm_rows(times)
        _log.info(
            "%s: the GEMM from %s rows (kernel / GEMM ms: %s)",
            key,
            _measured[key],
            ", ".join(f"{M}: {k * 1e3:.2f}/{g * 1e3:.2f}" for M, (k, g) in times.items()),
        )
    return _measured[key]


def env_terms(env: str, default: int) -> int:
    """Int8 terms per activation from the environment variable ``env`` ("1" or "2"), else ``default``: the
    int4 and int8 kernels' one switch (``LMSTACK_INT4_TERMS``, ``LMSTACK_INT8_TERMS``); another value is refused."""
    value = os.environ.get(env, "").strip()
    if not value:
        return default
    if value not in ("1", "2"):
        raise ValueError(f"{env}={value!r}; expected 1 or 2 int8 terms per activation")
    return int(value)


def best_seconds_pair(
    fa: Callable[[], object], fb: Callable[[], object], repeats: int = 5
) -> tuple[float, float]:
    """The fastest of ``repeats`` calls of each of ``fa`` and ``fb``, alternated, after one warm-up call of
    each, in the process's CPU time: on a shared machine wall time also counts the moments another job
    holds the core, which flipped the oneDNN head decision in 1 of 4 measurements at a load of 5 on 2 cores."""
    fa(), fb()
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for j, fn in enumerate((fa, fb)):
            t = time.process_time()
            fn()
            best[j] = min(best[j], time.process_time() - t)
    return best[0], best[1]


class WeightOnlyLinear(nn.Module):
    """y = x Ŵᵀ (+ b) for a quantised Ŵ; subclasses: ``Int8Linear``, ``Int4Linear``."""

    DEQUANT_ROWS: int | None = (
        None  # from this many rows on, dequantise and use F.linear (None: never)
    )

    def __init__(
        self, out_features: int, in_features: int, bias: Tensor | None, compute_dtype: torch.dtype
    ):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.compute_dtype = compute_dtype
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    def _rows_first(self) -> bool:
        """Whether every buffer holds the output rows along dim 0 in order (so ``concat_rows`` may join them)."""
        return False

    @classmethod
    def concat_rows(cls, modules: Sequence[nn.Module]) -> WeightOnlyLinear | None:
        """One quantised linear whose outputs are these linears' outputs one after another (fused QKV, gate/up:
        one activation quantisation and one kernel call for all of them), or None where they cannot be joined
        (another class, kernel, group size, int8 terms, compute dtype, input size, some with a bias and some
        without, a layout whose rows are not along dim 0). Quantisation groups run along the inputs, so joining
        along the outputs is a concatenation of the codes and scales (and minimums): the fused layer computes
        the same numbers as the parts. The parts' buffers become row views of the fused ones (no second copy;
        ``model.layers.still_fused`` checks ``qweight`` to see whether a part was replaced since)."""
        parts = list(modules)
        if not parts or any(type(m) is not cls or not m._rows_first() for m in parts):
            return None
        first = parts[0]
        same = ("in_features", "compute_dtype", "kernel", "group_size", "terms", "act_group")
        if any(getattr(m, a, None) != getattr(first, a, None) for m in parts for a in same):
            return None
        if len({m.bias is None for m in parts}) != 1 or any(
            m._buffers.keys() != first._buffers.keys() for m in parts
        ):
            return None
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        for k, v in vars(
            first
        ).items():  # plain attributes: kernel, terms, group_size, gemm_rows, ...
            if not k.startswith("_"):
                setattr(fused, k, v)
        fused.out_features = sum(m.out_features for m in parts)
        fused.bias = None
        if first.bias is not None:
            fused.bias = nn.Parameter(
                torch.cat([m.bias.detach() for m in parts]), requires_grad=False
            )
            o = 0
            for m in parts:
                m.bias.data, o = fused.bias.data[o : o + m.out_features], o + m.out_features
        for name in first._buffers:
            joined = torch.cat([m._buffers[name] for m in parts])
            fused.register_buffer(name, joined)
            o = 0
            for m in parts:  # each part's rows become a view of the joined buffer
                n = m._buffers[name].shape[0]
                m._buffers[name], o = joined[o : o + n], o + n
        fused._measure_for_shape()
        return fused

    def _measure_for_shape(self) -> None:
        """Choices measured on the weight's shape (``gemm_rows``), made again for a joined layer's shape (a
        fused gate/up has 2x the parts' outputs); nothing by default."""

    def _kernel_ok(self) -> bool:
        raise NotImplementedError

    def _kernel_mm(self, x2: Tensor) -> Tensor:  # (M, I) in compute_dtype -> (M, O)
        raise NotImplementedError

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:  # (O, I)
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:  # (..., I) -> (..., O)
        if self.DEQUANT_ROWS is not None and x.numel() // self.in_features >= self.DEQUANT_ROWS:
            y = F.linear(x, self.dequantized_weight(x.dtype))
        elif x.device.type == "cpu" and self._kernel_ok():
            y = self._kernel_mm(x.reshape(-1, self.in_features).to(self.compute_dtype))  # (M, O)
            y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        else:
            y = F.linear(x.to(self.compute_dtype), self.dequantized_weight(self.compute_dtype)).to(
                x.dtype
            )
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"compute_dtype={self.compute_dtype}"
        )
