"""Training losses: cross-entropy with z-loss (seed 001 "训练稳定性") and the MoE balance loss (seed 001 "MoE").

Cross-entropy of the target r given logits U (one row of V scores):

    CE = log Z - U_r,    Z = Σ_{r'} exp(U_{r'}),   log Z = m + log Σ exp(U_{r'} - m)

and the z-loss keeps the *absolute* log-partition near 0 (softmax is shift invariant, so
nothing else stops the logits from drifting):  z = α · log² Z.

``cross_entropy`` is an autograd Function with the analytic gradient

    ∂CE/∂U = softmax(U) - onehot(r),     ∂z/∂U = 2α · log Z · softmax(U),

so backward reuses the saved probabilities instead of differentiating through exp/log/sum;
it is also checked against ``F.cross_entropy`` and torch autograd in the tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmstack.train.ops import logsumexp

IGNORE_INDEX = -100


class _CrossEntropyZLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, z_alpha: float, ignore_index: int, fused: bool):
        # logits: (M, V) in any float dtype; targets: (M,) int64. Math in fp32 (fp64 stays fp64).
        compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
        x = logits.to(compute)  # (M, V)
        if fused:
            lse = torch.logsumexp(x, dim=-1)  # (M,) log Z: torch's one-pass kernel, the same max trick
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


def cross_entropy(logits: Tensor, targets: Tensor, z_loss: float = 0.0,
                  ignore_index: int = IGNORE_INDEX, fused: bool = True) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy and mean z-loss over the targets that are not ``ignore_index``.

    logits: (B, S, V) or (M, V); targets: (B, S) or (M,). Returns ``(ce, z)``, two scalars;
    train on ``ce + z``. ``z`` is α·mean(log² Z) (0 when ``z_loss`` = α = 0).
    ``fused=True`` takes log Z and softmax from torch's single-pass kernels (faster on large V);
    ``fused=False`` uses lmstack's own ``ops.logsumexp`` and exp(U - log Z); both are tested
    against ``F.cross_entropy``.
    """
    V = logits.shape[-1]
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)} "
                         "without the last (V) dimension")
    if z_loss < 0:
        raise ValueError(f"z_loss={z_loss} must be >= 0")
    ce, z, _ = _CrossEntropyZLoss.apply(logits.reshape(-1, V), targets.reshape(-1).long(), float(z_loss),
                                        int(ignore_index), bool(fused))
    return ce, z


def z_loss_term(logits: Tensor, alpha: float) -> Tensor:
    """α · mean(log² Z) over all rows, from ``ops.logsumexp`` (differentiable by autograd)."""
    return alpha * logsumexp(logits, dim=-1).square().mean()


def load_balance_loss(router_probs: Tensor, expert_index: Tensor, n_experts: int) -> Tensor:
    """Switch-Transformer balance term  E · Σ_i f_i · P_i  (seed 001 "MoE": 路由平衡正则项).

    router_probs: (M, E) softmax router outputs; expert_index: (M,) or (M, k) chosen experts.
    f_i = fraction of routed (token, slot) pairs sent to expert i (not differentiable),
    P_i = mean router probability of expert i. Equals 1 when routing is perfectly uniform.
    """
    if router_probs.shape[-1] != n_experts:
        raise ValueError(f"router_probs has {router_probs.shape[-1]} experts, expected n_experts={n_experts}")
    counts = torch.bincount(expert_index.reshape(-1), minlength=n_experts).to(router_probs.dtype)
    f = counts / counts.sum()  # (E,)
    P = router_probs.mean(dim=0)  # (E,)
    return n_experts * (f * P).sum()
