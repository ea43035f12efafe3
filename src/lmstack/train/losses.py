"""Training losses: cross-entropy with z-loss (CS336 notes "训练稳定性") and the MoE balance loss (CS336 notes "MoE").

Cross-entropy of the target r given logits U (one row of V scores):

    CE = log Z - U_r,    Z = Σ_{r'} exp(U_{r'}),   log Z = m + log Σ exp(U_{r'} - m)

and the z-loss keeps the *absolute* log-partition near 0 (softmax is shift invariant, so
nothing else stops the logits from drifting):  z = α · log² Z.

``cross_entropy`` is an autograd Function with the analytic gradient

    ∂CE/∂U = softmax(U) - onehot(r),     ∂z/∂U = 2α · log Z · softmax(U),

so backward reuses the saved probabilities instead of differentiating through exp/log/sum;
it is also checked against ``F.cross_entropy`` and torch autograd in the tests.

``linear_cross_entropy`` fuses the unembedding with the loss: logits U = h Wᵤᵀ are made a block
of rows at a time, and each block's gradient (p - onehot(r) + 2α·log Z·p) is turned into
∂h = ∂U Wᵤ and ∂Wᵤ += ∂Uᵀ h at once, so the (B·S, V) logits never exist in full (only a
(rows, V) block that stays in cache) and backward has nothing left to do but scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmstack.train.ops import logsumexp

IGNORE_INDEX = -100


class _CrossEntropyZLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits: Tensor, targets: Tensor, z_alpha: float, ignore_index: int, fused: bool
    ):
        # logits: (M, V) in any float dtype; targets: (M,) int64. Math in fp32 (fp64 stays fp64).
        compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
        x = logits.to(compute)  # (M, V)
        if fused:
            lse = torch.logsumexp(
                x, dim=-1
            )  # (M,) log Z: torch's one-pass kernel, the same max trick
        else:
            lse = logsumexp(x, dim=-1)  # (M,) lmstack.train.ops: m + log Σ exp(U - m)
        valid = targets != ignore_index  # (M,)
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        target_logit = x.gather(-1, safe[:, None]).squeeze(-1)  # (M,) U_r
        n = valid.sum().clamp(min=1).to(compute)
        w = valid.to(compute)
        ce = ((lse - target_logit) * w).sum() / n
        z = (lse.square() * w).sum() / n * z_alpha
        # keep the logits in their own dtype (bf16: half the bytes of fp32 probabilities)
        ctx.save_for_backward(logits, safe, w, lse, n)
        ctx.z_alpha, ctx.fused = z_alpha, fused
        ctx.mark_non_differentiable(lse)
        return ce, z, lse

    @staticmethod
    def backward(ctx, g_ce: Tensor, g_z: Tensor, _g_lse: Tensor):
        logits, safe, w, lse, n = ctx.saved_tensors
        compute = lse.dtype
        if ctx.fused:
            probs = torch.softmax(logits, dim=-1, dtype=compute)  # (M, V), upcast inside the kernel
        else:
            probs = torch.exp(logits.to(compute) - lse[:, None])  # p = exp(U - log Z)
        # d(CE)/dU = p - onehot(r);  d(z)/dU = 2α log Z · p;  each row weighted by valid / n.
        row = (g_ce + g_z * 2.0 * ctx.z_alpha * lse) * w / n  # (M,)
        grad = probs.mul_(row[:, None])  # (M, V), in place on the fresh probabilities
        grad.scatter_add_(-1, safe[:, None], (-(g_ce * w / n))[:, None].to(grad.dtype))
        return grad.to(logits.dtype), None, None, None, None


def cross_entropy(
    logits: Tensor,
    targets: Tensor,
    z_loss: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    fused: bool = True,
) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy and mean z-loss over the targets that are not ``ignore_index``.

    logits: (B, S, V) or (M, V); targets: (B, S) or (M,). Returns ``(ce, z)``, two scalars;
    train on ``ce + z``. ``z`` is α·mean(log² Z) (0 when ``z_loss`` = α = 0).
    ``fused=True`` takes log Z and softmax from torch's single-pass kernels (faster on large V);
    ``fused=False`` uses lmstack's own ``ops.logsumexp`` and exp(U - log Z); both are tested
    against ``F.cross_entropy``.
    """
    V = logits.shape[-1]
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)} "
            "without the last (V) dimension"
        )
    if z_loss < 0:
        raise ValueError(f"z_loss={z_loss} must be >= 0")
    ce, z, _ = _CrossEntropyZLoss.apply(
        logits.reshape(-1, V),
        targets.reshape(-1).long(),
        float(z_loss),
        int(ignore_index),
        bool(fused),
    )
    return ce, z


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _lce_blocks(
    hc: Tensor,
    wc: Tensor,
    safe: Tensor,
    w: Tensor,
    n: Tensor,
    z_alpha: float,
    rows: int,
    g_ce: Tensor | None,
    g_z: Tensor | None,
    acc: torch.dtype,
):
    """One pass over blocks of ``rows`` rows: log Z and U_r per row and, when ``g_ce`` is given, the
    gradients of g_ce·CE + g_z·z w.r.t. h and Wᵤ.

    hc: (M, D), wc: (V, D) in the compute dtype (bf16 under autocast); safe: (M,) targets;
    w: (M,) 1.0 for counted rows; n: their number. Returns lse, target logit (M,) in ``acc`` and
    grad_h (M, D) in the compute dtype, grad_w (V, D) in ``acc`` (or None, None).
    """
    M, V = hc.shape[0], wc.shape[0]
    dev = hc.device
    lse = torch.empty(M, dtype=acc, device=dev)
    tgt = torch.empty(M, dtype=acc, device=dev)
    grad_h = grad_w = gu_buf = None
    if g_ce is not None:
        grad_h = torch.empty_like(hc)
        grad_w = torch.zeros(wc.shape, dtype=acc, device=dev)
        if hc.dtype != acc:
            # low-precision ∂U blocks are gathered (≤ 2²⁴ elements) so ∂Wᵤ is added into the fp32
            # accumulator a few times, not once per block; in fp32 ∂Wᵤ is added per block in place
            group = max(rows, min(M, (1 << 24) // V) // rows * rows)  # a multiple of rows
            gu_buf = torch.empty(min(group, M), V, dtype=hc.dtype, device=dev)
    # block buffers allocated once: a fresh multi-MB tensor per block costs page faults on CPU
    rows = min(rows, M)
    u_buf = torch.empty(rows, V, dtype=hc.dtype, device=dev)
    x_buf = u_buf if hc.dtype == acc else torch.empty(rows, V, dtype=acc, device=dev)
    g0 = 0  # first row of the gathered ∂U group
    for s in range(0, M, rows):
        e = min(M, s + rows)
        u = torch.mm(
            hc[s:e], wc.t(), out=u_buf[: e - s]
        )  # (rows, V) logits in the compute dtype, as autocast makes them
        x = x_buf[: e - s]
        if x is not u:
            x.copy_(u)  # to acc (fp32)
        r = safe[s:e, None]
        tgt[s:e] = x.gather(-1, r).squeeze(-1)  # U_r
        m = x.amax(dim=-1, keepdim=True)  # (rows, 1) max trick
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        x.sub_(m).exp_()  # exp(U - m)
        total = x.sum(dim=-1, keepdim=True)  # Σ exp(U - m)
        lse[s:e] = (m + total.log()).squeeze(-1)  # log Z = m + log Σ exp(U - m)
        if g_ce is None:
            continue
        # ∂/∂U of g_ce·CE + g_z·z = (g_ce + 2α·g_z·log Z)·p·w/n − g_ce·onehot(r)·w/n,  p = exp(U - m) / Σ
        wn = w[s:e, None] / n
        coef = (g_ce + g_z * (2.0 * z_alpha) * lse[s:e, None]) * wn / total  # (rows, 1)
        x.mul_(coef)
        x.scatter_add_(-1, r, (-g_ce * wn).to(acc))
        if gu_buf is None:  # fp32 / fp64: ∂U is x itself
            torch.mm(x, wc, out=grad_h[s:e])  # ∂h = ∂U Wᵤ  (rows, D)
            grad_w.addmm_(x.t(), hc[s:e])  # ∂Wᵤ += ∂Uᵀ h  (V, D)
            continue
        gu = gu_buf[s - g0 : e - g0]
        gu.copy_(x)  # ∂U rounded to the compute dtype, as autocast's backward of F.linear sees it
        torch.mm(gu, wc, out=grad_h[s:e])
        if e - g0 == gu_buf.shape[0] or e == M:
            grad_w += (
                gu_buf[: e - g0].t() @ hc[g0:e]
            )  # (V, D) from up to 2²⁴ ∂U entries, summed in acc
            g0 = e
    return lse, tgt, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        h: Tensor,
        weight: Tensor,
        targets: Tensor,
        z_alpha: float,
        ignore_index: int,
        rows: int,
        compute: torch.dtype,
        grad_mode: bool,
    ):
        # h: (M, D); weight: (V, D) (fp32 master under autocast); targets: (M,) int64
        acc = torch.float64 if compute == torch.float64 else torch.float32
        hc, wc = h.to(compute), weight.to(compute)
        valid = targets != ignore_index
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        w = valid.to(acc)
        n = valid.sum().clamp(min=1).to(acc)
        # (needs_input_grad is also True under no_grad; apply() is then not recorded, so ask grad mode too)
        need = grad_mode and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        one = torch.ones((), dtype=acc, device=h.device)
        # The gradient of CE + z (unit upstream gradients, the training loss) is made in this pass;
        # backward scales it, or recomputes the blocks if CE and z got different upstream gradients.
        lse, tgt, grad_h, grad_w = _lce_blocks(
            hc, wc, safe, w, n, z_alpha, rows, one if need else None, one if need else None, acc
        )
        ce = ((lse - tgt) * w).sum() / n
        z = (lse.square() * w).sum() / n * z_alpha
        if need:
            ctx.save_for_backward(hc, wc, safe, w, n, grad_h, grad_w)
        ctx.z_alpha, ctx.rows, ctx.acc = z_alpha, rows, acc
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.mark_non_differentiable(lse)
        return ce, z, lse

    @staticmethod
    def backward(ctx, g_ce: Tensor, g_z: Tensor, _g_lse: Tensor):
        hc, wc, safe, w, n, grad_h, grad_w = ctx.saved_tensors
        if ctx.z_alpha == 0.0 or torch.equal(g_ce, g_z):
            grad_h, grad_w = grad_h * g_ce, grad_w * g_ce  # the usual case: loss = CE + z
        else:
            _, _, grad_h, grad_w = _lce_blocks(
                hc,
                wc,
                safe,
                w,
                n,
                ctx.z_alpha,
                ctx.rows,
                g_ce.to(ctx.acc),
                g_z.to(ctx.acc),
                ctx.acc,
            )
        return (
            grad_h.to(ctx.dtypes[0]),
            grad_w.to(ctx.dtypes[1]),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    z_loss: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    rows: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``cross_entropy(F.linear(h, weight), targets, z_loss)`` without materialising the logits.

    h: (B, S, D) or (M, D) final hidden states; weight: (V, D) unembedding Wᵤ; targets: (B, S) or (M,).
    Returns ``(ce, z)`` like ``cross_entropy``. Under autocast the block matmuls run in the autocast
    dtype with the logits rounded to it, exactly as an autocast ``F.linear`` would make them; the
    softmax, log Z and the losses are fp32. ``rows``: logits rows per block (default: a block of
    about 2²⁰ logits, 4 MB in fp32, so it stays in cache).
    """
    D = h.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != D:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} does not match hidden size D={D}; expected (V, {D})"
        )
    if targets.shape != h.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} does not match h {tuple(h.shape)} "
            "without the last (D) dimension"
        )
    if z_loss < 0:
        raise ValueError(f"z_loss={z_loss} must be >= 0")
    if rows is None:
        rows = max(16, (1 << 20) // weight.shape[0])
    elif rows <= 0:
        raise ValueError(f"rows={rows} must be a positive integer")
    compute = _autocast_dtype(h.device.type) or torch.promote_types(h.dtype, weight.dtype)
    grad_mode = torch.is_grad_enabled()
    with torch.autocast(h.device.type, enabled=False):
        ce, z, _ = _LinearCrossEntropy.apply(
            h.reshape(-1, D),
            weight,
            targets.reshape(-1).long(),
            float(z_loss),
            int(ignore_index),
            int(rows),
            compute,
            grad_mode,
        )
    return ce, z


def z_loss_term(logits: Tensor, alpha: float) -> Tensor:
    """α · mean(log² Z) over all rows, from ``ops.logsumexp`` (differentiable by autograd)."""
    return alpha * logsumexp(logits, dim=-1).square().mean()


def load_balance_loss(router_probs: Tensor, expert_index: Tensor, n_experts: int) -> Tensor:
    """Switch-Transformer balance term  E · Σ_i f_i · P_i  (CS336 notes "MoE": 路由平衡正则项).

    router_probs: (M, E) softmax router outputs; expert_index: (M,) or (M, k) chosen experts.
    f_i = fraction of routed (token, slot) pairs sent to expert i (not differentiable),
    P_i = mean router probability of expert i. Equals 1 when routing is perfectly uniform.
    """
    if router_probs.shape[-1] != n_experts:
        raise ValueError(
            f"router_probs has {router_probs.shape[-1]} experts, expected n_experts={n_experts}"
        )
    counts = torch.bincount(expert_index.reshape(-1), minlength=n_experts).to(router_probs.dtype)
    f = counts / counts.sum()  # (E,)
    P = router_probs.mean(dim=0)  # (E,)
    return n_experts * (f * P).sum()
