"""GPTQ: post-training quantisation with second-order error feedback (CS336 notes "有损提速"; Frantar et al. 2022).

For one linear y = x Wᵀ with calibration inputs X (n, I), the layer's squared output error
‖X Ŵᵀ − X Wᵀ‖² has Hessian H = 2 XᵀX / n (I, I) with respect to each row of W. GPTQ quantises the
columns of W one at a time (all O rows together) and, after rounding column i, moves the rounding
error onto the not-yet-quantised columns j > i as the optimal-brain-surgeon update prescribes:

    e = (w_i − q(w_i)) / [H⁻¹]_ii,      w_j ← w_j − e · [H⁻¹]_ij   (j > i)

with H⁻¹ the inverse of H restricted to the remaining columns. The upper Cholesky factor U of
(H + λI)⁻¹ (λ = ``damp`` · mean diag H) holds exactly those rows, scaled by 1/sqrt([H⁻¹]_ii), so one
factorisation serves every step. Updates are applied lazily: inside a block of ``block_size``
columns immediately, to the columns after the block once per block (one matmul).

Output formats are the existing kernels': int4 asymmetric groups of G inputs (``Int4Linear``) and
int8 symmetric per output row (``Int8Linear``). A group's (scale, min) come from the group's
columns as they stand (after earlier error feedback) when its first column is reached; with
``act_order`` (columns visited by decreasing diag H) the groups stay the contiguous groups of the
stored layout and their parameters are taken from the original weights ("static groups"), so the
result still runs on the int4 kernel.

``gptq_quantize_model`` runs it over a ``Transformer`` block by block: the block's input on the
calibration tokens (produced by the blocks already quantised), hooks accumulating H for every
linear of the block, quantise, recompute the block's output with the quantised weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from lmstack.model.layers import Linear
from lmstack.quant.int4 import QMAX4, Int4Linear
from lmstack.quant.int8 import QMAX8, Int8Linear


class CalibrationError(ValueError):
    """Missing, mis-shaped or too little calibration data for GPTQ / AWQ."""


# ---- Hessian -----------------------------------------------------------------------------------------------


class HessianAccumulator:
    """Running H = 2/n Σ x xᵀ over calibration rows (float64 accumulation)."""

    def __init__(self, in_features: int):
        self.H = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.n = 0

    def add(self, x: Tensor) -> None:  # x (..., I)
        x2 = x.detach().reshape(-1, x.shape[-1]).double()  # (M, I)
        self.H += 2.0 * x2.t() @ x2
        self.n += x2.shape[0]

    def hessian(self) -> Tensor:
        if self.n == 0:
            raise CalibrationError(
                "no calibration rows reached this layer: the Hessian is undefined"
            )
        return self.H / self.n


# ---- per-group quantisers (the stored formats) -------------------------------------------------------------


def _int4_params(w: Tensor, shrink_grid: int = 0) -> tuple[Tensor, Tensor]:
    """(scale, min) per row of w (O, G) — the ``quantize_int4`` rule: s = (max − min)/15.

    ``shrink_grid`` > 0: also try the range [p·min, p·max] for p = 1 − k/100, k < ``shrink_grid``, and keep
    per row the p with the least Σ |w − ŵ|^2.4 (the MSE grid of the GPTQ authors' quantiser: clipping a
    few extreme weights buys a finer step for all the others). p = 1 is among them, so never worse."""
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    s = (hi - lo) / QMAX4
    s = torch.where(s > 0, s, torch.ones_like(s))
    if shrink_grid <= 0:
        return s, lo
    best = torch.full_like(s, float("inf"))
    s_best, lo_best = s.clone(), lo.clone()
    for k in range(shrink_grid):
        p = 1.0 - k / 100
        lo_p, s_p = p * lo, p * (hi - lo) / QMAX4
        s_p = torch.where(s_p > 0, s_p, torch.ones_like(s_p))
        err = (
            (_int4_round(w, s_p[:, None], lo_p[:, None]) * s_p[:, None] + lo_p[:, None] - w).abs()
            ** 2.4
        ).sum(1)
        better = err < best
        best = torch.where(better, err, best)
        s_best, lo_best = torch.where(better, s_p, s_best), torch.where(better, lo_p, lo_best)
    return s_best, lo_best


def _int4_round(w: Tensor, s: Tensor, lo: Tensor) -> Tensor:
    return torch.round((w - lo) / s).clamp(0, QMAX4)


def _int8_round(w: Tensor, s: Tensor) -> Tensor:
    return torch.round(w / s).clamp(-QMAX8, QMAX8)


def _check(weight: Tensor, H: Tensor, bits: int, group_size: int | None) -> tuple[int, int]:
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    O, I = weight.shape
    if H.shape != (I, I):
        raise CalibrationError(
            f"Hessian has shape {tuple(H.shape)}; expected ({I}, {I}) for in_features={I}"
        )
    if bits not in (4, 8):
        raise ValueError(
            f"bits={bits}; GPTQ writes the int4 (grouped) or int8 (per row) format, expected 4 or 8"
        )
    if bits == 4 and (group_size is None or group_size <= 0 or I % group_size):
        raise ValueError(f"in_features={I} is not a multiple of group_size={group_size}")
    if bits == 8 and group_size is not None:
        raise ValueError(
            f"group_size={group_size}: the int8 format has one scale per output row (use None)"
        )
    if not torch.isfinite(H).all():
        raise CalibrationError("the Hessian has NaN/inf entries: check the calibration activations")
    return O, I


@torch.no_grad()
def gptq_quantize(
    weight: Tensor,
    H: Tensor,
    bits: int = 4,
    group_size: int | None = 32,
    act_order: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
    shrink_grid: int = 0,
) -> tuple[Tensor, ...]:
    """Quantise W (O, I) with Hessian H (I, I). ``shrink_grid``: the int4 groups' range search (``_int4_params``).

    bits=4: returns (Q (O, I) uint8 in [0, 15], scales (O, I/G), mins (O, I/G)) for ``Int4Linear``;
    bits=8: returns (Q (O, I) int8, scales (O,)) for ``Int8Linear``. Computation in float64.
    """
    O, I = _check(weight, H, bits, group_size)
    W = weight.detach().double().clone()  # (O, I)
    H = H.detach().double().clone()
    dead = torch.diag(H) == 0  # inputs that never fire: their weights do not matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    G = group_size if bits == 4 else None
    if bits == 8:
        s8 = W.abs().amax(dim=1) / QMAX8  # (O,) from the original weights, as RTN
        s8 = torch.where(s8 > 0, s8, torch.ones_like(s8))
    n_groups = I // G if G else 0
    scales = torch.ones(O, n_groups, dtype=torch.float64)
    mins = torch.zeros(O, n_groups, dtype=torch.float64)
    perm = torch.arange(I)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        if G:  # static groups: the stored (contiguous) groups' parameters from the original weights
            for g in range(n_groups):
                scales[:, g], mins[:, g] = _int4_params(W[:, g * G : (g + 1) * G], shrink_grid)
        W, H = W[:, perm], H[perm][:, perm]
    lam = damp * torch.mean(torch.diag(H))
    H += lam * torch.eye(I, dtype=torch.float64)
    try:
        L = torch.linalg.cholesky(H)
        U = torch.linalg.cholesky(
            torch.cholesky_inverse(L), upper=True
        )  # rows of H⁻¹ / sqrt(diag), (I, I)
    except torch.linalg.LinAlgError as e:
        raise CalibrationError(
            f"the damped Hessian is not positive definite (damp={damp}); use more calibration "
            f"rows or a larger damp"
        ) from e
    if G and not act_order and block_size % G:
        block_size = G * max(1, block_size // G)  # a group never straddles two blocks
    Q = torch.zeros(O, I, dtype=torch.float64)  # codes, in visiting order
    for b0 in range(0, I, block_size):
        b1 = min(b0 + block_size, I)
        W1 = W[:, b0:b1].clone()
        E1 = torch.zeros_like(W1)
        U1 = U[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            j = int(perm[col])  # the stored column this is
            w = W1[:, i]
            if bits == 8:
                q = _int8_round(w, s8)
                wq = q * s8
            else:
                g = j // G
                if (
                    not act_order and j % G == 0
                ):  # first column of a group: parameters from the updated weights
                    scales[:, g], mins[:, g] = _int4_params(W1[:, i : i + G], shrink_grid)
                q = _int4_round(w, scales[:, g], mins[:, g])
                wq = q * scales[:, g] + mins[:, g]
            Q[:, col] = q
            e = (w - wq) / U1[i, i]
            W1[:, i:] -= e[:, None] * U1[i, i:][None, :]
            E1[:, i] = e
        W[:, b1:] -= E1 @ U[b0:b1, b1:]  # the block's error onto the later columns, at once
    inv = torch.argsort(perm)
    Q = Q[:, inv]
    if bits == 8:
        return Q.to(torch.int8), s8.float()
    return Q.to(torch.uint8), scales.float(), mins.float()


def layer_error(weight: Tensor, w_hat: Tensor, H: Tensor) -> float:
    """The GPTQ objective per row: tr((W − Ŵ) H (W − Ŵ)ᵀ) = 2/n ‖X Wᵀ − X Ŵᵀ‖²."""
    d = weight.double() - w_hat.double()
    return float(torch.einsum("oi,ij,oj->", d, H.double(), d))


# ---- over a model ------------------------------------------------------------------------------------------


class _Stop(Exception):
    pass


def check_int_arg(name: str, value, minimum: int) -> int:
    """A quantiser argument that must be an integer >= ``minimum`` (group_size, grid, bits, ...)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return value


def model_linears(model: nn.Module) -> list[tuple[nn.Module, str, Linear]]:
    """The block linears a quantiser replaces; none (a model without blocks) is a clear error."""
    found = _linears(getattr(model, "blocks", nn.ModuleList()))
    if not found:
        raise ValueError(
            f"the model ({type(model).__name__}) has no block linears to quantise (no .blocks, or "
            "blocks without lmstack Linear layers)"
        )
    return found


def calibration_batches(
    tokens: Tensor, min_tokens: int = 1, vocab_size: int | None = None
) -> Tensor:
    """Check calibration tokens (B, S) int, at least ``min_tokens`` in all, ids in [0, ``vocab_size``);
    returns them."""
    if tokens is None:
        raise CalibrationError(
            "calibration tokens are required (a (B, S) integer tensor), got None"
        )
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.dtype.is_floating_point:
        raise CalibrationError(
            f"calibration tokens must be a (B, S) integer tensor, got "
            f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}"
        )
    if tokens.numel() < min_tokens:
        raise CalibrationError(
            f"{tokens.numel()} calibration tokens; need at least {min_tokens} "
            f"(more rows than the widest layer's inputs, so H is well conditioned)"
        )
    if vocab_size is not None and tokens.numel():
        bad = (tokens < 0) | (tokens >= vocab_size)
        if bad.any():
            b, t = (int(v) for v in bad.nonzero()[0])
            raise CalibrationError(
                f"calibration token id {int(tokens[b, t])} at (row {b}, position {t}) is outside the "
                f"model's vocabulary 0..{vocab_size - 1}"
            )
    return tokens


@torch.no_grad()
def block_inputs(model: nn.Module, tokens: Tensor) -> tuple[list[Tensor], tuple, dict]:
    """The first block's input per calibration row (each (1, S, D)) and the rest of its call (meta)."""
    captured: dict = {}

    def grab(module, args, kwargs):
        captured["args"], captured["kwargs"] = args, kwargs
        raise _Stop

    hook = model.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    xs = []
    try:
        for b in range(tokens.shape[0]):
            try:
                model(tokens[b : b + 1])
            except _Stop:
                pass
            xs.append(captured["args"][0])
    finally:
        hook.remove()
    return xs, captured["args"][1:], captured["kwargs"]


def _linears(module: nn.Module) -> list[tuple[nn.Module, str, Linear]]:
    return [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, Linear)
    ]


@torch.no_grad()
def sequential_quantize(
    model: nn.Module,
    tokens: Tensor,
    quantize_block: Callable[[nn.Module, list[Tensor], tuple, dict], None],
    quantize_head: Callable[[Tensor, list[Tensor]], nn.Module] | None,
    desc: str,
) -> nn.Module:
    """Walk the blocks in order: ``quantize_block(block, xs, args, kwargs)`` changes the block in place given
    its inputs xs, then the block's quantised outputs become the next inputs. Last, ``quantize_head(W, hs)``
    builds the unembedding from the final-normed states hs. Shared by GPTQ and AWQ."""
    from tqdm import tqdm

    if not hasattr(model, "blocks"):
        raise TypeError(
            f"expected an lmstack Transformer (with .blocks), got {type(model).__name__}"
        )
    if getattr(model, "quantization", None):
        raise ValueError(
            f"the model is already quantised ({model.quantization}); quantise a float model"
        )
    xs, args, kwargs = block_inputs(model, tokens)
    for block in tqdm(model.blocks, desc=desc, unit="block"):
        quantize_block(block, xs, args, kwargs)
        xs = [block(x, *args, **kwargs) for x in xs]
    if quantize_head is not None:
        hs = [model.norm(x) if model.norm is not None else x for x in xs]
        W = model.embed.weight if model.lm_head is None else model.lm_head.weight
        model.lm_head = quantize_head(W, hs)
    return model


def _collect_hessians(
    block: nn.Module, xs: list[Tensor], args: tuple, kwargs: dict
) -> dict[int, HessianAccumulator]:
    accs: dict[int, HessianAccumulator] = {}
    hooks = []
    for _, _, lin in _linears(block):
        acc = accs[id(lin)] = HessianAccumulator(lin.in_features)
        hooks.append(lin.register_forward_pre_hook(lambda m, a, acc=acc: acc.add(a[0])))
    try:
        for x in xs:
            block(x, *args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return accs


def _build(
    weight: Tensor,
    H: Tensor,
    bias,
    bits,
    group_size,
    act_order,
    damp,
    compute_dtype,
    shrink_grid: int = 0,
) -> nn.Module:
    if bits == 8:
        q, s = gptq_quantize(weight, H, 8, None, act_order, damp)
        return Int8Linear(q, s, bias, compute_dtype)
    q, s, lo = gptq_quantize(weight, H, 4, group_size, act_order, damp, shrink_grid=shrink_grid)
    return Int4Linear(q, s, lo, bias, compute_dtype)


@torch.no_grad()
def gptq_quantize_model(
    model: nn.Module,
    tokens: Tensor,
    bits: int = 4,
    group_size: int = 32,
    act_order: bool = False,
    damp: float = 0.01,
    lm_head: bool = True,
    compute_dtype: torch.dtype = torch.bfloat16,
    shrink_grid: int = 0,
) -> nn.Module:
    """Quantise every block linear of ``model`` (and the unembedding when ``lm_head``) with GPTQ, calibrated
    on ``tokens`` (B, S). Needs at least as many calibration tokens as the widest linear has inputs.
    ``shrink_grid``: int4 groups' (scale, min) by the range search of ``_int4_params`` (e.g. 20)."""
    if bits not in (4, 8):
        raise ValueError(
            f"bits={bits!r}; GPTQ writes int4 (grouped) or int8 (per row): expected 4 or 8"
        )
    if bits == 4:
        check_int_arg("group_size", group_size, 1)
    check_int_arg("shrink_grid", shrink_grid, 0)
    if not (isinstance(damp, (int, float)) and damp >= 0):
        raise ValueError(f"damp={damp!r} must be a number >= 0 (a fraction of H's mean diagonal)")
    widest = max(lin.in_features for _, _, lin in model_linears(model))
    calibration_batches(tokens, widest, model.config.vocab_size)
    G = group_size if bits == 4 else None

    def block_fn(block, xs, args, kwargs):
        accs = _collect_hessians(block, xs, args, kwargs)
        for parent, name, lin in _linears(block):
            H = accs[id(lin)].hessian()
            setattr(
                parent,
                name,
                _build(
                    lin.weight, H, lin.bias, bits, G, act_order, damp, compute_dtype, shrink_grid
                ),
            )

    def head_fn(W, hs):
        acc = HessianAccumulator(W.shape[1])
        for h in hs:
            acc.add(h)
        return _build(W, acc.hessian(), None, bits, G, act_order, damp, compute_dtype, shrink_grid)

    sequential_quantize(model, tokens, block_fn, head_fn if lm_head else None, "GPTQ")
    model.quantization = f"gptq-int{bits}"
    return model


def min_calibration_tokens(model: nn.Module) -> int:
    """The fewest calibration tokens GPTQ accepts for ``model``: the widest block linear's in_features."""
    return max(lin.in_features for _, _, lin in model_linears(model))


__all__ = [
    "CalibrationError",
    "HessianAccumulator",
    "gptq_quantize",
    "gptq_quantize_model",
    "layer_error",
    "min_calibration_tokens",
    "sequential_quantize",
    "calibration_batches",
    "block_inputs",
]
