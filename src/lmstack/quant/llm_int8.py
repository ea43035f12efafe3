"""LLM.int8(): vector-wise int8 matmul with the mixed-precision outlier decomposition (Book of LLMs §5 “numeric precision”;
Dettmers et al. 2022).

For y = x Wᵀ with x (M, I) and W (O, I):

- outlier columns C = { i : max_m |x_mi| > threshold } (6.0 by default) — the few feature dimensions
  where trained transformers carry large activations — are multiplied in 16-bit:
  y_C = x[:, C] Ŵ[:, C]ᵀ;
- the rest in int8, vector-wise: one scale per activation row c_m = max_i∉C |x_mi| / 127 and one
  per weight output row s_o = max_i |W_oi| / 127 (the ``quantize_int8`` format), codes
  X_q = round(x/c), W_q, an int32 product and the outer product of the scales:
  y_R = (X_q W_qᵀ) ⊙ (c sᵀ).

y = y_R + y_C. The weights are stored once, as int8 (as bitsandbytes' inference layout does): the
16-bit part multiplies the outlier columns of Ŵ = s ⊙ W_q, so it keeps the activations' precision.
The int32 product is ``torch._int_mm`` where it runs, else an exact float64 matmul.

Each layer counts, per input column, how many forward calls found it an outlier (``outlier_stats``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lmstack.quant.int8 import QMAX8, quantize_int8
from lmstack.quant.model import replace_block_linears


def _int_mm(a: Tensor, b_t: Tensor) -> Tensor:
    """(M, I) int8 @ (I, O) int8 -> (M, O) int32."""
    try:
        return torch._int_mm(a, b_t)
    except (RuntimeError, AttributeError):
        return (a.double() @ b_t.double()).to(torch.int32)  # exact: |sum| < 2^53


class LLMInt8Linear(nn.Module):
    """y = x Ŵᵀ (+ b) by the LLM.int8() decomposition; ``outlier_dtype`` is the 16-bit type of the outlier part."""

    def __init__(
        self,
        q: Tensor,
        scale: Tensor,
        bias: Tensor | None = None,
        threshold: float = 6.0,
        outlier_dtype: torch.dtype = torch.float16,
    ):
        super().__init__()
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(
                f"expected int8 Q (O, I) and scales (O,), got {q.dtype} {tuple(q.shape)} "
                f"and {tuple(scale.shape)}"
            )
        self.out_features, self.in_features = q.shape
        self.threshold, self.outlier_dtype = float(threshold), outlier_dtype
        self.register_buffer(
            "qweight", q.contiguous()
        )  # (O, I), the kernel format ``Int8Linear`` stores
        self.register_buffer(
            "qweight_t", q.t().contiguous(), persistent=False
        )  # (I, O) for _int_mm
        self.register_buffer("scale", scale.float().contiguous())  # (O,)
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )
        self.register_buffer(
            "outlier_hits", torch.zeros(self.in_features, dtype=torch.int64), persistent=False
        )
        self.calls = 0
        self.rows = 0

    @classmethod
    def from_linear(
        cls, linear: nn.Module, threshold: float = 6.0, outlier_dtype: torch.dtype = torch.float16
    ) -> LLMInt8Linear:
        return cls(
            *quantize_int8(linear.weight), getattr(linear, "bias", None), threshold, outlier_dtype
        )

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def kernel_bytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()

    def forward(self, x: Tensor) -> Tensor:  # (..., I) -> (..., O)
        x2 = x.reshape(-1, self.in_features).float()  # (M, I)
        outlier = x2.abs().amax(dim=0) > self.threshold  # (I,)
        self.outlier_hits += outlier
        self.calls += 1
        self.rows += x2.shape[0]
        xr = x2.masked_fill(outlier, 0.0)  # the regular columns
        c = xr.abs().amax(dim=1) / QMAX8  # (M,) row-wise activation scales
        c = torch.where(c > 0, c, torch.ones_like(c))
        xq = torch.round(xr / c[:, None]).clamp(-QMAX8, QMAX8).to(torch.int8)
        y = _int_mm(xq, self.qweight_t).float() * c[:, None] * self.scale[None, :]  # (M, O)
        if outlier.any():
            idx = torch.nonzero(outlier).flatten()
            w_c = (self.qweight[:, idx].float() * self.scale[:, None]).to(
                self.outlier_dtype
            )  # (O, |C|)
            y = y + (x2[:, idx].to(self.outlier_dtype) @ w_c.t()).float()
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, threshold={self.threshold}"


@torch.no_grad()
def llm_int8_model(
    model: nn.Module,
    threshold: float = 6.0,
    lm_head: bool = True,
    outlier_dtype: torch.dtype = torch.float16,
) -> nn.Module:
    """Swap every block ``Linear`` (and the unembedding when ``lm_head``) for ``LLMInt8Linear``, in place."""
    replace_block_linears(
        model, lambda name, child: LLMInt8Linear.from_linear(child, threshold, outlier_dtype)
    )
    if lm_head:
        W = model.embed.weight if model.lm_head is None else model.lm_head.weight
        model.lm_head = LLMInt8Linear(*quantize_int8(W), None, threshold, outlier_dtype)
    model.quantization = "llm-int8"
    return model


def outlier_stats(model: nn.Module) -> list[dict]:
    """Per ``LLMInt8Linear``: calls, rows, how many distinct input columns were ever outliers, the mean
    number per call, and the columns most often flagged (up to 5, with their counts)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, LLMInt8Linear):
            hits = m.outlier_hits
            top = torch.argsort(hits, descending=True)[:5]
            out.append(
                dict(
                    layer=name,
                    calls=m.calls,
                    rows=m.rows,
                    in_features=m.in_features,
                    outlier_columns=int((hits > 0).sum()),
                    mean_per_call=float(hits.sum()) / max(m.calls, 1),
                    top=[(int(i), int(hits[i])) for i in top if hits[i] > 0],
                )
            )
    return out
