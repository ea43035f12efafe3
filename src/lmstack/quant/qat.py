"""Quantisation-aware training: fake-quantised linears with a straight-through estimator (CS336 notes
"有损提速": quantisation-aware training vs post-training quantisation).

In the forward a ``QATLinear`` uses Ŵ = Q(W), the int4 round trip of ``quantize_int4`` (asymmetric,
groups of G inputs), so the loss sees the quantised model; in the backward the rounding is treated
as the identity (straight-through: ∂Ŵ/∂W := I), written as Ŵ = W + (Q(W) − W).detach(). The master
weight W stays float and the optimiser updates it. After training, ``quantize_model(model, "int4")``
(or ``convert_qat``) rounds W with the same rule, giving exactly the Ŵ the last forward used.

``prepare_qat(model)`` swaps every block ``Linear`` for a ``QATLinear`` holding the *same* Parameter
objects (an optimiser built before keeps working; the state-dict names do not change). The
unembedding stays float during QAT (with tied embeddings it is the lookup table too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.model.layers import Linear
from lmstack.quant.int4 import Int4Linear, dequantize_int4, quantize_int4


def fake_quant_int4(weight: Tensor, group_size: int = 32) -> Tensor:
    """Ŵ = Q(W) in the forward, gradient passed straight through to W in the backward."""
    w_hat = dequantize_int4(*quantize_int4(weight.detach(), group_size), dtype=weight.dtype)
    return weight + (w_hat - weight).detach()


class QATLinear(Linear):
    """y = x Q(W)ᵀ (+ b) with the straight-through estimator; W is a float master weight."""

    group_size: int = 32

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        return F.linear(x, fake_quant_int4(self.weight, self.group_size), self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fake_quant=int4, group_size={self.group_size}"


def prepare_qat(model: nn.Module, method: str = "int4", group_size: int = 32) -> nn.Module:
    """Make every block ``Linear`` of ``model`` a ``QATLinear`` (in place, same Parameters). Returns the model."""
    if method != "int4":
        raise ValueError(
            f"QAT method={method!r}; expected 'int4' (train config: quant = \"int4-qat\")"
        )
    if not hasattr(model, "blocks"):
        raise TypeError(
            f"expected an lmstack Transformer (with .blocks), got {type(model).__name__}"
        )
    for block in model.blocks:
        for parent in block.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, Linear) and not isinstance(child, QATLinear):
                    if child.in_features % group_size:
                        raise ValueError(
                            f"in_features={child.in_features} of {name} is not a multiple of "
                            f"group_size={group_size}"
                        )
                    with torch.device("meta"):
                        q = QATLinear(
                            child.in_features, child.out_features, bias=child.bias is not None
                        )
                    q.weight, q.bias = child.weight, child.bias
                    q.group_size = group_size
                    setattr(parent, name, q)
    model.qat = f"{method}-qat"
    return model


def convert_qat(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """After QAT: the block linears to ``Int4Linear`` with the groups used in training (head left float)."""
    for block in model.blocks:
        for parent in block.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, QATLinear):
                    setattr(
                        parent, name, Int4Linear.from_linear(child, child.group_size, compute_dtype)
                    )
    model.quantization = "int4-qat"
    return model
