"""int8 weight-only quantisation, symmetric, one scale per output channel (seed 001 "量化").

For W of shape (O, I):  s_o = max_i |W_oi| / 127,  Q_oi = round(W_oi / s_o) ∈ [-127, 127],
Ŵ_oi = s_o · Q_oi, so |W_oi − Ŵ_oi| ≤ s_o / 2. The matmul y = x Ŵᵀ = (x Qᵀ) ⊙ s is what
``torch.ops.aten._weight_int8pack_mm`` computes on CPU without materialising Ŵ.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lmstack.quant.linear import WeightOnlyLinear

QMAX8 = 127


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """W (O, I) float -> (Q (O, I) int8, s (O,) fp32) with W ≈ s[:, None] · Q."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / QMAX8  # (O,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale works
    q = torch.round(w / scale[:, None]).clamp(-QMAX8, QMAX8).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Ŵ = s[:, None] · Q, shape (O, I)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def _has_int8_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8Linear(WeightOnlyLinear):
    """y = x Ŵᵀ (+ b) with Ŵ stored as int8 Q (O, I) and fp scales s (O,).

    ``compute_dtype`` is the dtype the activation is cast to for the matmul: bf16 (default) is
    what the CPU int8 kernel is fast for (an fp32 activation takes a ~10x slower path there);
    the output is cast back to the input's dtype. With ``DEQUANT_ROWS`` or more rows (prefill),
    off CPU, or without the kernel, the weight is dequantised and F.linear runs.
    """

    DEQUANT_ROWS = 32  # from this many rows on, dequantise and use F.linear

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None = None,
                 compute_dtype: torch.dtype = torch.bfloat16):
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"expected int8 Q (O, I) and scales (O,), got {q.dtype} {tuple(q.shape)} "
                             f"and {tuple(scale.shape)}")
        super().__init__(*q.shape, bias, compute_dtype)
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("scale_c", scale.to(compute_dtype).contiguous())  # s in the kernel's dtype

    @classmethod
    def from_linear(cls, linear: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> "Int8Linear":
        q, s = quantize_int8(linear.weight)
        return cls(q, s, getattr(linear, "bias", None), compute_dtype)

    @classmethod
    def from_weight(cls, weight: Tensor, compute_dtype: torch.dtype = torch.bfloat16) -> "Int8Linear":
        q, s = quantize_int8(weight)
        return cls(q, s, None, compute_dtype)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_int8(self.qweight, self.scale, dtype)

    def kernel_bytes(self) -> int:
        """Bytes the matmul reads: Q (1 byte per weight) and the scales."""
        return self.qweight.numel() + self.scale_c.numel() * self.scale_c.element_size()

    def _kernel_ok(self) -> bool:
        return _has_int8_kernel()

    def _kernel_mm(self, x2: Tensor) -> Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale_c)  # (M, O)
