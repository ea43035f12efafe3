"""Quantise an lmstack Transformer's linear layers in place (weight-only; CS336 notes "量化").

Which matrices are quantised is explicit: every ``Linear`` inside the blocks (W_Q, W_K, W_V,
W_O, W_gate, W_up, W_down), plus the unembedding when ``lm_head=True``. The token embedding is
a row lookup (one row of D values per token), so it stays in floating point; with tied
embeddings a quantised *copy* of W_e becomes the unembedding and W_e itself is kept for lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmstack.kernels.runtime import WEIGHT_FORMATS
from lmstack.model.layers import Linear
from lmstack.quant.int4 import Int4Linear
from lmstack.quant.int8 import Int8Linear
from lmstack.quant.linear import WeightOnlyLinear


@dataclass(frozen=True)
class WeightFormat:
    """One weight-only format (one handler per format, as gpt-fast's): ``linear`` is its class, built by
    ``linear.from_linear(linear, **options)`` for a ``Linear`` and ``linear.from_weight(weight, **options)`` for a
    bare matrix (a tied unembedding's copy of W_e); ``options`` are the ``quantize_model`` arguments it takes."""

    name: str
    linear: Any  # a class with the classmethods from_linear and from_weight
    options: tuple[str, ...] = ("compute_dtype",)

    def build(self, weight_or_linear, **kw) -> nn.Module:
        opts = {k: kw[k] for k in self.options}
        if isinstance(weight_or_linear, torch.Tensor):
            return self.linear.from_weight(weight_or_linear, **opts)
        return self.linear.from_linear(weight_or_linear, **opts)


#: name -> format: ``quantize_model(model, name)``, ``load_for_inference(dtype=name)``, ``--dtype name``
FORMATS: dict[str, WeightFormat] = {
    "int8": WeightFormat("int8", Int8Linear),
    "int4": WeightFormat("int4", Int4Linear, ("group_size", "compute_dtype")),
}
#: the weight-only method names (the ``FORMATS`` dict itself, so a registered format is one of them)
QUANT_METHODS = FORMATS


def register_format(fmt: WeightFormat) -> WeightFormat:
    """Add a weight-only format (from outside the package too); a name already taken is refused.
    ``tests/quant/test_quant_weight_formats.py`` does it with a toy format."""
    if fmt.name in FORMATS:
        raise ValueError(f"weight format {fmt.name!r} is already registered; choose another name")
    for m in ("from_linear", "from_weight"):
        if not callable(getattr(fmt.linear, m, None)):
            raise TypeError(f"WeightFormat({fmt.name!r}).linear={fmt.linear.__name__} has no {m}")
    FORMATS[fmt.name] = fmt
    if fmt.name not in WEIGHT_FORMATS:  # RuntimeConfig(dtype=...) / LLM(dtype=...) accept it too
        WEIGHT_FORMATS.append(fmt.name)
    return fmt


def replace_block_linears(model: nn.Module, make) -> None:
    """Replace every ``Linear`` inside ``model.blocks`` (an lmstack Transformer's W_Q … W_down) by
    ``make(name, linear)``, in place; a float model only (one quantisation per model). A module that reads one
    of its linears as a matrix (MLA's absorbed form multiplies the queries by ``kv_b_proj.weight``) names it in
    its ``float_linears`` attribute, and that linear stays in floating point."""
    if not hasattr(model, "blocks"):
        raise TypeError(
            f"expected an lmstack Transformer (with .blocks), got {type(model).__name__}"
        )
    if getattr(model, "quantization", None):
        raise ValueError(
            f"the model is already quantised ({model.quantization}); quantise a float model"
        )
    for block in model.blocks:
        for parent in block.modules():
            keep = getattr(parent, "float_linears", ())
            for name, child in list(parent.named_children()):
                if isinstance(child, Linear) and name not in keep:
                    setattr(parent, name, make(name, child))


def _quantized(
    weight_or_linear, method: str, group_size: int, compute_dtype: torch.dtype
) -> nn.Module:
    return FORMATS[method].build(
        weight_or_linear, group_size=group_size, compute_dtype=compute_dtype
    )


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    method: str = "int8",
    lm_head: bool | str = True,
    group_size: int = 32,
    compute_dtype: torch.dtype = torch.bfloat16,
) -> nn.Module:
    """Replace the linears of ``model`` (a ``Transformer``) by ``method``'s linear (``FORMATS``: ``Int8Linear``,
    ``Int4Linear``, or a registered format's).

    ``lm_head``: True quantises the unembedding (V·D weights, a fifth of SmolLM2-135M) with
    ``method`` too, a method name ("int8") uses that one for it, False keeps it in floating point.
    The model is meant for inference afterwards (buffers, no trainable weights in the linears).
    Returns the model.
    """
    head_method = method if lm_head is True else lm_head
    for m in (method, head_method):
        if m is not False and m not in QUANT_METHODS:
            raise ValueError(f"quantisation method={m!r}; expected one of {list(FORMATS)}")
    replace_block_linears(
        model, lambda name, child: _quantized(child, method, group_size, compute_dtype)
    )
    if head_method:
        if model.lm_head is not None:
            model.lm_head = _quantized(model.lm_head, head_method, group_size, compute_dtype)
        else:  # tied: quantise a copy of W_e for the unembedding, keep W_e for the lookup
            model.lm_head = _quantized(model.embed.weight, head_method, group_size, compute_dtype)
    model.quantization = method
    return model


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one batch-1 decode step reads: each quantised linear's codes and the scales
    its kernel uses, every other parameter once, and the embedding table only when it is also the
    unembedding (a lookup reads one row of D values)."""
    total = 0
    seen: set[int] = set()
    for m in model.modules():
        if isinstance(m, WeightOnlyLinear):
            total += m.kernel_bytes()
            for p in m.parameters(recurse=False):
                seen.add(id(p))
                total += p.numel() * p.element_size()
    tied = getattr(model, "lm_head", None) is None
    for name, p in model.named_parameters():
        if id(p) in seen or (name.startswith("embed.") and not tied):
            continue
        total += p.numel() * p.element_size()
    return total
