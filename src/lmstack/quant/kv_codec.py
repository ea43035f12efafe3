"""The one codec of 1-byte K/V: int8 and fp8 e4m3 codes with one float32 scale per block (and KV head).

CS336 notes "低精度计算" (int8/fp8 formats), "性能指标分析" (Memory_KV = 2·P·B·S·L·K·H: P = 1 byte halves a bf16
cache). Both KV caches that quantise use it: the engine's paged pool (``inference.paged``, blocks filled a
token at a time) and the contiguous ``inference.kv_cache.QuantizedKVCache`` (a block quantised once, when full).

The scale of a block whose largest magnitude is m:

- int8: s = m / 127, codes = round(x / s) in [−127, 127];
- fp8 e4m3: s = 2^⌈log2(m / 448)⌉ (a power of two, so m / s ∈ (224, 448]), codes = x / s rounded to e4m3 by
  torch's float8 cast.

Why these two (docs/quant.md, "fp8 KV blocks"; ``benchmarks/quant_kv_error.py`` on SmolLM2-135M's real K/V,
blocks of 16 positions × H): e4m3 has the same relative step (2⁻⁴) at every normal magnitude, so where its
scale puts the values barely matters — quantised once, s = m/448 and the power of two measured 2.55% vs 2.60%
relative error (K) — but a block filled token by token is re-quantised whenever its max grows: with
s = m/448 each growth re-rounds every code on a new grid (3.45% K, 3.51% V), with a power of two a growth only
shifts exponents (2.60%, 2.66%: the quantised-once error). The paged pool used the power of two and the
contiguous cache m/448; one codec keeps the rule that is right for both. int8's steps are even, so a power of
two would waste up to one of its 8 bits (1.35% K error with m/127): int8 keeps s = m/127.

s = 0 marks a block holding nothing (or only zeros): it encodes and decodes to 0. A NaN/inf input makes its
scale non-finite, which ``PagedKVCache.block_is_finite`` reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: format -> (code dtype, largest code magnitude)
KV_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8": (torch.float8_e4m3fn, 448.0),
}
SCALE_BYTES = 4  # one float32 scale per block (and KV head)


def check_format(fmt: str) -> tuple[torch.dtype, float]:
    """(code dtype, largest code) of ``fmt``; a clear error for anything else."""
    if fmt not in KV_FORMATS:
        raise ValueError(f"KV cache format={fmt!r}; expected one of {tuple(KV_FORMATS)}")
    return KV_FORMATS[fmt]


def scale_for(amax: Tensor, fmt: str) -> Tensor:
    """The scale of blocks whose largest |x| is ``amax`` (any shape, float32): int8 amax/127, fp8 e4m3 the power
    of two 2^⌈log2(amax/448)⌉. 0 stays 0; inf/NaN stay non-finite."""
    _, qmax = check_format(fmt)
    s = amax.float() / qmax
    if fmt == "fp8":
        s = torch.exp2(torch.ceil(torch.log2(s)))  # log2(0) = −inf -> 0
    return s


def encode(x: Tensor, s: Tensor, fmt: str) -> Tensor:
    """Codes of x on scale s (broadcast against x; s = 0 encodes 0): round and clamp to ±qmax (int8), or
    clamp and cast to e4m3 (fp8). -> x's shape in the format's code dtype."""
    dt, qmax = check_format(fmt)
    y = x.float() / torch.where(s > 0, s, torch.ones_like(s))
    if dt == torch.int8:
        y = torch.round(y)
    return y.clamp(-qmax, qmax).to(dt)


def decode(codes: Tensor, s: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes · s (s broadcast against codes) in ``dtype``."""
    return (codes.to(torch.float32) * s).to(dtype)


def quantize_blocks(x: Tensor, fmt: str = "int8") -> tuple[Tensor, Tensor]:
    """x (..., bs, H) -> (codes (..., bs, H), scale (...,)): one scale per leading index, over its bs × H values."""
    s = scale_for(x.detach().float().abs().amax(dim=(-2, -1)), fmt)
    return encode(x, s[..., None, None], fmt), s
