"""Optimizers and gradient clipping: AdamW, SGD (with momentum), global-L2-norm clipping.

Book of LLMs §1.8 “training memory”: AdamW keeps two fp32 states per parameter (m and v: 8P bytes). CS336 notes
"训练稳定性": weight decay is kept even though data never repeats, because with a decaying
learning rate it ends lower; AdamW *decouples* it from the gradient (Loshchilov & Hutter):

    θ ← θ - lr·λ·θ                                   (decay, not part of the gradient)
    m ← β1·m + (1-β1)·g ;   v ← β2·v + (1-β2)·g²
    m̂ = m / (1-β1^t) ;      v̂ = v / (1-β2^t)          (bias correction, t = 1, 2, ...)
    θ ← θ - lr · m̂ / (√v̂ + ε)

Both are ``torch.optim.Optimizer`` subclasses, so param groups, ``state_dict`` and LR
schedules work as usual; the tests compare them with torch.optim step for step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor


def _check(
    name: str, value: float, lo: float, hi: float | None = None, lo_open: bool = False
) -> None:
    bad = (value <= lo if lo_open else value < lo) or (hi is not None and value >= hi)
    if bad or not math.isfinite(value):
        rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'})"
        raise ValueError(f"{name}={value!r} must be in {rng}")


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay and bias correction (state: ``step``, ``exp_avg`` m, ``exp_avg_sq`` v)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        _check("lr", lr, 0.0)
        _check("beta1", betas[0], 0.0, 1.0)
        _check("beta2", betas[1], 0.0, 1.0)
        _check("eps", eps, 0.0)
        _check("weight_decay", weight_decay, 0.0)
        super().__init__(
            params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = (
                group["lr"],
                group["betas"],
                group["eps"],
                group["weight_decay"],
            )
            # parameters with the same step count t (all of them, unless some were frozen for a while)
            # are updated together by multi-tensor (_foreach) ops: one call per formula line, not per
            # tensor; grouped by tensor type, device and dtype too, since one _foreach call cannot mix
            # plain tensors with DTensors (native tensor parallelism shards some parameters only)
            by_t: dict[tuple, tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)  # m
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )  # v
                state["step"] += 1
                lists = by_t.setdefault(
                    (state["step"].item(), type(p), p.device, p.dtype), ([], [], [], [])
                )
                for lst, t in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"])):
                    lst.append(t)
            for (t, *_), (ps, gs, ms, vs) in by_t.items():
                if wd != 0:
                    torch._foreach_mul_(ps, 1.0 - lr * wd)  # decoupled decay
                torch._foreach_mul_(ms, beta1)
                torch._foreach_add_(ms, gs, alpha=1.0 - beta1)  # m ← β1·m + (1-β1)·g
                torch._foreach_mul_(vs, beta2)
                torch._foreach_addcmul_(vs, gs, gs, value=1.0 - beta2)  # v ← β2·v + (1-β2)·g²
                bias1 = 1.0 - beta1**t
                bias2 = 1.0 - beta2**t
                denom = torch._foreach_sqrt(vs)
                torch._foreach_div_(denom, math.sqrt(bias2))
                torch._foreach_add_(denom, eps)  # √v̂ + ε
                torch._foreach_addcdiv_(ps, ms, denom, value=-lr / bias1)  # θ -= lr · m̂ / (√v̂ + ε)
        return loss


class SGD(torch.optim.Optimizer):
    """SGD with optional (heavy-ball) momentum and L2 weight decay added to the gradient:

    g ← g + λθ ;  b ← μ·b + g (b = g at the first step) ;  θ ← θ - lr·b   (torch.optim.SGD's convention).
    """

    def __init__(self, params, lr: float = 1e-2, momentum: float = 0.0, weight_decay: float = 0.0):
        _check("lr", lr, 0.0)
        _check("momentum", momentum, 0.0, 1.0)
        _check("weight_decay", weight_decay, 0.0)
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if wd != 0:
                    g = g.add(p, alpha=wd)
                if mu != 0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = g.clone()
                    else:
                        state["momentum_buffer"].mul_(mu).add_(g)
                    g = state["momentum_buffer"]
                p.add_(g, alpha=-lr)
        return loss


def global_grad_norm(params: Iterable[Tensor]) -> Tensor:
    """‖g‖₂ over all gradients together (fp32), skipping parameters without a gradient (frozen)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    return torch.sqrt(sum(g.detach().float().pow(2).sum() for g in grads))


def clip_grad_norm(params: Iterable[Tensor], max_norm: float, eps: float = 1e-6) -> Tensor:
    """Scale all gradients by min(1, max_norm / (‖g‖₂ + eps)); returns ‖g‖₂ before clipping.

    Same contract as ``torch.nn.utils.clip_grad_norm_`` (L2 norm, frozen parameters ignored).
    A non-finite norm is returned as is and the gradients are left alone: the caller decides.
    """
    if not (max_norm > 0):
        raise ValueError(f"max_norm={max_norm!r} must be > 0")
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(params)
    if not torch.isfinite(total):
        return total
    coef = max_norm / (total + eps)
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total
