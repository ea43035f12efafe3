"""What the weight-only quantised linears share: the forward around a CPU kernel (seed 001 "量化").

A subclass stores its codes in a ``qweight`` buffer (how ``model.hf.check_float_weights`` spots it)
and its scales, says whether its kernel can run (``_kernel_ok``), calls it
on (M, I) rows in ``compute_dtype`` (``_kernel_mm``) and can rebuild the float weight
(``dequantized_weight``). The forward takes the kernel on CPU, dequantises otherwise, and from
``DEQUANT_ROWS`` rows on (a prefill: compute-bound, where a float GEMM beats a weight-only kernel)
dequantises once and runs ``F.linear`` in the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
