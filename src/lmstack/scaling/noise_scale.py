"""The critical batch size from the gradient noise scale (McCandlish, Kaplan, Amodei et al. 2018,
"An Empirical Model of Large-Batch Training", §2.2 and appendix A).

A minibatch gradient G_B of B examples has E|G_B|² = |G|² + tr(Σ)/B (G the true gradient, Σ the
per-example covariance). Measuring |G_B|² at two batch sizes B_small < B_big gives unbiased estimates

    |G|²  ≈ 𝒢 = (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr Σ  ≈ 𝒮 = (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

and the simple noise scale B_simple = tr Σ / |G|², the batch size beyond which more examples per step
buy little (CS336 notes "规模定律": the critical batch size). Each estimate is noisy, so 𝒢 and 𝒮 are
averaged separately (exponential moving averages) before the ratio, as the paper does.

``NoiseScaleCallback`` measures it during ``Trainer.fit`` on request (``lmstack.train`` unchanged):
every ``every`` steps it takes gradients of fresh batches (without stepping) at B and k·B sequences and
logs a ``{"kind": "noise_scale", ...}`` row; B counts tokens (sequences × S), the unit of the paper's
language-model results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def noise_estimates(
    g2_small: float, b_small: float, g2_big: float, b_big: float
) -> tuple[float, float]:
    """(𝒢 ≈ |G|², 𝒮 ≈ tr Σ) from squared gradient norms at two batch sizes."""
    if not 0 < b_small < b_big:
        raise ValueError(f"batch sizes must satisfy 0 < b_small < b_big (got {b_small}, {b_big})")
    g2 = (b_big * g2_big - b_small * g2_small) / (b_big - b_small)
    s = (g2_small - g2_big) / (1.0 / b_small - 1.0 / b_big)
    return g2, s


@dataclass
class NoiseScale:
    """Exponential moving averages of 𝒢 and 𝒮; ``b_simple`` = 𝒮/𝒢 (bias-corrected like Adam's moments)."""

    beta: float = 0.9
    g2: float = 0.0
    s: float = 0.0
    n: int = 0
    history: list[dict] = field(default_factory=list)

    def update(self, g2_small: float, b_small: float, g2_big: float, b_big: float) -> float:
        g2, s = noise_estimates(g2_small, b_small, g2_big, b_big)
        self.n += 1
        self.g2 = self.beta * self.g2 + (1 - self.beta) * g2
        self.s = self.beta * self.s + (1 - self.beta) * s
        self.history.append({"g2": g2, "s": s})
        return self.b_simple

    @property
    def b_simple(self) -> float:
        if self.n == 0:
            return math.nan
        corr = 1 - self.beta**self.n
        g2, s = self.g2 / corr, self.s / corr
        return s / g2 if g2 > 0 else math.inf


def grad_sq_norm(model: torch.nn.Module) -> float:
    """|g|² over all parameters with a gradient."""
    return float(
        sum(p.grad.detach().float().pow(2).sum() for p in model.parameters() if p.grad is not None)
    )


class NoiseScaleCallback:
    """``trainer.fit(callback=NoiseScaleCallback(every=50, big=8))``: B_simple in tokens, logged."""

    def __init__(self, every: int = 50, big: int = 4, beta: float = 0.9):
        if every < 1 or big < 2:
            raise ValueError(f"every={every} must be >= 1 and big={big} >= 2 micro-batches")
        self.every, self.big = every, big
        self.estimate = NoiseScale(beta)

    def _grad_sq(self, trainer, n: int) -> float:
        model = trainer.model
        model.zero_grad(set_to_none=True)
        for _ in range(n):
            ce, _ = trainer.forward_loss(trainer.next_batch())
            (ce / n).backward()
        g2 = grad_sq_norm(model)
        model.zero_grad(set_to_none=True)
        return g2

    def __call__(self, trainer, metrics: dict) -> None:
        if trainer.step % self.every:
            return
        tokens = trainer.config.batch_size * trainer.config.seq_len
        g_small = self._grad_sq(trainer, 1)
        g_big = self._grad_sq(trainer, self.big)
        b = self.estimate.update(g_small, tokens, g_big, tokens * self.big)
        trainer.log(
            {
                "kind": "noise_scale",
                "step": trainer.step,
                "g2_small": g_small,
                "g2_big": g_big,
                "b_small_tokens": tokens,
                "b_big_tokens": tokens * self.big,
                "b_simple_tokens": b,
            }
        )
