"""Numerically stable softmax, log-softmax and log-sum-exp (CS336 notes "训练稳定性").

Softmax is shift invariant: softmax(u) = softmax(u - m) for any m. Subtracting m = max(u)
makes every exponent <= 0, so exp never overflows and the largest term is exactly 1, so the
sum never underflows to 0. The seed's identity  log Z = m + log Σ exp(u_r - m)  gives the
absolute log-partition log Z that the z-loss needs, stable for logits in the thousands.
"""

from __future__ import annotations

import torch
from torch import Tensor


def logsumexp(x: Tensor, dim: int = -1, keepdim: bool = False) -> Tensor:
    """log Σ_r exp(x_r) along ``dim`` = m + log Σ exp(x_r - m), m = max_r x_r (computed in fp32+).

    ``m`` is detached: log Z does not depend on the choice of m, so no gradient flows through it
    (the gradient is softmax(x) either way). Rows that are all -inf give -inf, as torch does.
    """
    x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    m = x.amax(dim=dim, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf rows: avoid inf - inf
    out = m + torch.log(torch.exp(x - m).sum(dim=dim, keepdim=True))
    return out if keepdim else out.squeeze(dim)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """exp(x - m) / Σ exp(x - m) with m = max(x): never overflows (CS336 notes "训练稳定性")."""
    m = x.amax(dim=dim, keepdim=True).detach()
    e = torch.exp(x - m)
    return e / e.sum(dim=dim, keepdim=True)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """x - log Z: the log-probabilities, exact even where softmax itself underflows to 0."""
    return x - logsumexp(x, dim=dim, keepdim=True).to(x.dtype)
