"""AWQ: activation-aware per-input-channel scaling before int4 rounding (CS336 notes "有损提速"; Lin et al. 2023).

Input channels that carry large activations matter more to the output, so they deserve finer
weight resolution. For a linear (or several sharing one input: W_Q/W_K/W_V, W_gate/W_up) with
calibration inputs X (n, I), AWQ scales each input channel by s_i > 0 — Wᵢ ← Wᵢ·s_i, xᵢ ← xᵢ/s_i,
an identity in real arithmetic — and then rounds W·s with plain int4 RTN. The error that remains,

    L(s) = Σ_linears ‖X (Q(W·diag s)·diag(1/s) − W)ᵀ‖²   = Σ tr(Δ XᵀX Δᵀ),

is minimised over a grid s = mean_n|x|^α, α ∈ {0, 1/N, …, 1}, normalised so √(max s · min s) = 1.
α = 0 is s = 1, plain RTN, so the search is never worse than RTN on L.

The 1/s goes where it costs nothing: into the RMSNorm γ that produced the input (q/k/v, gate/up, the
unembedding), else the quantised linear keeps it as an input scale (``ScaledInputLinear``: W_O,
W_down). Runs block by block on calibration tokens like GPTQ (``gptq.sequential_quantize``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lmstack.model.layers import Linear, RMSNorm
from lmstack.quant.gptq import (
    CalibrationError,
    calibration_batches,
    check_int_arg,
    model_linears,
    sequential_quantize,
)
from lmstack.quant.int4 import Int4Linear, dequantize_int4, quantize_int4


class ScaledInputLinear(nn.Module):
    """y = inner(x ⊙ inv_scale): an AWQ-scaled linear whose 1/s could not be folded into a previous op."""

    def __init__(self, inner: nn.Module, inv_scale: Tensor):
        super().__init__()
        self.inner = inner
        self.register_buffer("inv_scale", inv_scale.float().contiguous())  # (I,)
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: Tensor) -> Tensor:  # (..., I) -> (..., O)
        return self.inner(x * self.inv_scale.to(x.dtype))


def awq_loss(weights: list[Tensor], gram: Tensor, scale: Tensor, group_size: int) -> float:
    """L(s) = Σ tr(Δ G Δᵀ), Δ = Q(W·s)/s − W, G = XᵀX (I, I), in G's dtype."""
    total = 0.0
    for W in weights:
        w_hat = (
            dequantize_int4(*quantize_int4((W * scale).float(), group_size)).to(gram.dtype) / scale
        )
        d = w_hat - W
        total += float(((d @ gram) * d).sum(dtype=torch.float64))
    return total


@torch.no_grad()
def awq_search(
    weights: list[Tensor],
    X: Tensor,
    group_size: int = 32,
    grid: int = 20,
    dtype: torch.dtype = torch.float64,
    max_out_rows: int | None = None,
) -> tuple[Tensor, float, dict]:
    """Best per-input-channel scale s (I,) for the linears ``weights`` (each (O_k, I)) sharing input X (n, I).

    The loss is evaluated in ``dtype``; ``max_out_rows`` evaluates it on every k-th output row only
    (the unembedding's V rows: the cost is O·I² per α). Returns (s, α*, {α: L}) — s = 1 when α* = 0."""
    check_int_arg("group_size", group_size, 1)
    check_int_arg("grid", grid, 1)
    if not weights:
        raise ValueError("weights: AWQ needs at least one (O, I) weight sharing the input X")
    if X is None or X.numel() == 0:
        raise CalibrationError("AWQ needs calibration inputs X (n, I); got none")
    X = X.reshape(-1, X.shape[-1]).double()
    I = X.shape[1]
    for W in weights:
        if W.shape[1] != I:
            raise CalibrationError(
                f"weight in_features={W.shape[1]} does not match the calibration inputs' {I}"
            )
        if I % group_size:
            raise ValueError(f"in_features={I} is not a multiple of group_size={group_size}")
    Ws = [W.detach().to(dtype) for W in weights]
    if max_out_rows is not None:
        Ws = [W[:: max(1, W.shape[0] // max_out_rows)] for W in Ws]
    gram = (X.t() @ X).to(dtype)  # (I, I)
    mean_abs = X.abs().mean(dim=0).clamp(min=1e-8).to(dtype)  # (I,)
    losses: dict[float, float] = {}
    best = (float("inf"), 0.0, torch.ones(I, dtype=dtype))
    for k in range(grid + 1):
        alpha = k / grid
        s = mean_abs**alpha
        s = (s / (s.max() * s.min()).sqrt()).clamp(min=1e-4)
        loss = losses[alpha] = awq_loss(Ws, gram, s, group_size)
        if loss < best[0]:
            best = (loss, alpha, s)
    return best[2], best[1], losses


def _groups(block: nn.Module, x: Tensor, args: tuple, kwargs: dict):
    """Linears of ``block`` grouped by the tensor they read, and the RMSNorm (if any) that produced it."""
    norm_out: dict[int, nn.Module] = {}
    seen: dict[int, tuple[Tensor, list]] = {}
    hooks = [
        m.register_forward_hook(lambda mod, a, out: norm_out.__setitem__(id(out), mod))
        for m in block.modules()
        if isinstance(m, RMSNorm)
    ]
    for parent in block.modules():
        for name, child in parent.named_children():
            if isinstance(child, Linear):

                def pre(mod, a, parent=parent, name=name):
                    seen.setdefault(id(a[0]), (a[0], []))[1].append((parent, name, mod))

                hooks.append(child.register_forward_pre_hook(pre))
    try:
        block(x, *args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return [(members, norm_out.get(key)) for key, (_, members) in seen.items()]


@torch.no_grad()
def awq_quantize_model(
    model: nn.Module,
    tokens: Tensor,
    group_size: int = 32,
    grid: int = 20,
    lm_head: bool = True,
    compute_dtype: torch.dtype = torch.bfloat16,
    max_rows: int = 8192,
) -> nn.Module:
    """AWQ-int4 every block linear of ``model`` (and the unembedding when ``lm_head``), calibrated on
    ``tokens`` (B, S) (at least 2·D tokens); ``model.awq_alphas`` records the α chosen per group."""
    check_int_arg("group_size", group_size, 1)
    check_int_arg("grid", grid, 1)
    check_int_arg("max_rows", max_rows, 1)
    model_linears(model)
    calibration_batches(tokens, 2 * model.config.d_model, model.config.vocab_size)
    alphas: list[tuple[str, float]] = []
    names = {id(m): n for n, m in model.named_modules()}

    def inputs_of(block, members, xs, args, kwargs) -> Tensor:
        rows: list[Tensor] = []
        h = members[0][2].register_forward_pre_hook(
            lambda m, a: rows.append(a[0].reshape(-1, a[0].shape[-1]))
        )
        try:
            for x in xs:
                block(x, *args, **kwargs)
        finally:
            h.remove()
        X = torch.cat(rows)
        return X[:: max(1, X.shape[0] // max_rows)]

    def block_fn(block, xs, args, kwargs):
        for members, norm in _groups(block, xs[0], args, kwargs):
            X = inputs_of(block, members, xs, args, kwargs)
            s, alpha, _ = awq_search(
                [lin.weight for _, _, lin in members], X, group_size, grid, torch.float32
            )
            alphas.append((",".join(names[id(lin)] for _, _, lin in members), alpha))
            s = s.float()
            fold = norm is not None
            if fold:
                norm.weight.div_(s.to(norm.weight.dtype))
            for parent, name, lin in members:
                q = Int4Linear(
                    *quantize_int4(lin.weight.float() * s, group_size), lin.bias, compute_dtype
                )
                setattr(parent, name, q if fold else ScaledInputLinear(q, 1.0 / s))

    def head_fn(W, hs):
        X = torch.cat([h.reshape(-1, h.shape[-1]) for h in hs])
        s, alpha, _ = awq_search(
            [W],
            X[:: max(1, X.shape[0] // max_rows)],
            group_size,
            grid,
            torch.float32,
            max_out_rows=4096,
        )
        alphas.append(("lm_head", alpha))
        s = s.float()
        if model.norm is not None:
            model.norm.weight.div_(s.to(model.norm.weight.dtype))
            return Int4Linear(*quantize_int4(W.float() * s, group_size), None, compute_dtype)
        return ScaledInputLinear(
            Int4Linear(*quantize_int4(W.float() * s, group_size), None, compute_dtype), 1.0 / s
        )

    sequential_quantize(model, tokens, block_fn, head_fn if lm_head else None, "AWQ")
    model.quantization = "awq-int4"
    model.awq_alphas = alphas
    return model
