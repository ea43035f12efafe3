"""fp16 training needs loss scaling; bf16 does not (Book of LLMs §5 "混合精度与下溢", loss scaling).

fp16 has 5 exponent bits: the smallest subnormal is 2⁻²⁴ ≈ 6·10⁻⁸ and the smallest normal 2⁻¹⁴, so
small gradients flush to zero ("underflow"); bf16 keeps fp32's 8 exponent bits (smallest normal
2⁻¹²⁶) with fewer mantissa bits. Multiplying the loss by S before backward shifts every gradient
up by log2 S binades, into fp16's range; the gradients are divided by S again before the
optimiser step.

``DynamicLossScaler`` is the usual schedule: after a step whose scaled gradients hold an inf/NaN
the step is skipped and S is multiplied by ``backoff`` (0.5); after ``growth_interval`` good steps
in a row S is multiplied by ``growth`` (2). ``underflow_fraction`` measures what a dtype loses.
"""

from __future__ import annotations

import torch
from torch import Tensor


def underflow_fraction(grads: Tensor, dtype: torch.dtype) -> float:
    """Fraction of the non-zero values of ``grads`` that become 0 when stored in ``dtype``."""
    nz = grads[grads != 0]
    if nz.numel() == 0:
        return 0.0
    return float((nz.to(dtype) == 0).float().mean())


class DynamicLossScaler:
    """S starts at ``init_scale``; ``scale(loss)`` → S·loss; ``unscale_(params)`` divides the gradients by S
    and says whether they are finite; ``update(found_inf)`` adjusts S. ``step(optimizer, params)`` does the
    three after backward: unscale, step only when finite, update."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth: float = 2.0,
        backoff: float = 0.5,
        growth_interval: int = 2000,
    ):
        if init_scale <= 0 or growth <= 1 or not 0 < backoff < 1 or growth_interval < 1:
            raise ValueError(
                f"need init_scale > 0, growth > 1, 0 < backoff < 1, growth_interval >= 1; got "
                f"{init_scale}, {growth}, {backoff}, {growth_interval}"
            )
        self.scale_value, self.growth, self.backoff, self.growth_interval = (
            float(init_scale),
            growth,
            backoff,
            growth_interval,
        )
        self.good_steps = 0
        self.skipped = 0

    def scale(self, loss: Tensor) -> Tensor:
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_(self, params) -> bool:
        """Divide every gradient by S (in fp32); True when all are finite."""
        finite = True
        inv = 1.0 / self.scale_value
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)
                finite = finite and bool(torch.isfinite(p.grad).all())
        return finite

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale_value *= self.backoff
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale_value *= self.growth
                self.good_steps = 0

    def step(self, optimizer: torch.optim.Optimizer, params) -> bool:
        """Unscale, step when finite, update S; returns whether the step was taken."""
        params = list(params)
        finite = self.unscale_(params)
        if finite:
            optimizer.step()
        self.update(not finite)
        return finite
