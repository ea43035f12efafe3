"""Learning-rate schedules: linear warmup + cosine decay, and warmup-stable-decay (WSD).

CS336 notes "训练稳定性": weight decay pays off together with a learning rate that decays at the
end; CS336 notes "模型规模定律": the learning rate must change with scale (μP). Steps t count
optimizer updates from 0; T_w = ``warmup_steps``, T = ``total_steps``.

cosine:  t < T_w:        lr = lr_max · (t + 1) / T_w
         T_w <= t <= T:  lr = lr_min + ½ (lr_max - lr_min) (1 + cos(π (t - T_w) / (T - T_w)))
         t > T:          lr = lr_min
wsd:     warmup as above; lr_max until T_d = T - decay_steps; then linear to lr_min at T
         (``decay_shape="sqrt"``: lr_min + (lr_max - lr_min)(1 - sqrt((t - T_d) / decay_steps))).
constant: warmup, then lr_max.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

SCHEDULES = ("cosine", "wsd", "constant")


def cosine_lr(t: int, lr_max: float, lr_min: float, warmup_steps: int, total_steps: int) -> float:
    if t < warmup_steps:
        return lr_max * (t + 1) / warmup_steps
    if t > total_steps:
        return lr_min
    span = max(total_steps - warmup_steps, 1)
    return lr_min + 0.5 * (lr_max - lr_min) * (1 + math.cos(math.pi * (t - warmup_steps) / span))


def wsd_lr(
    t: int,
    lr_max: float,
    lr_min: float,
    warmup_steps: int,
    total_steps: int,
    decay_steps: int,
    decay_shape: str = "linear",
) -> float:
    if t < warmup_steps:
        return lr_max * (t + 1) / warmup_steps
    start = total_steps - decay_steps
    if t < start:
        return lr_max
    if t >= total_steps:
        return lr_min
    frac = (t - start) / decay_steps
    if decay_shape == "sqrt":
        frac = math.sqrt(frac)
    return lr_max - (lr_max - lr_min) * frac


@dataclass
class LRSchedule:
    """lr(t) for optimizer step t; stateless, so a checkpoint needs only the step and this config."""

    kind: str = "cosine"
    lr_max: float = 1e-3
    lr_min: float = 1e-4
    warmup_steps: int = 0
    total_steps: int = 1000
    decay_steps: int = 0  # wsd only
    decay_shape: str = "linear"  # wsd only: linear | sqrt

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule={self.kind!r}; expected one of {SCHEDULES}")
        if not (self.lr_max > 0) or not math.isfinite(self.lr_max):
            raise ValueError(f"lr={self.lr_max!r} must be a finite number > 0")
        if not (0 <= self.lr_min <= self.lr_max):
            raise ValueError(f"min_lr={self.lr_min!r} must be in [0, lr={self.lr_max}]")
        if self.total_steps < 1:
            raise ValueError(f"max_steps={self.total_steps} must be >= 1")
        if not (0 <= self.warmup_steps <= self.total_steps):
            raise ValueError(
                f"warmup_steps={self.warmup_steps} must be in [0, max_steps={self.total_steps}]"
            )
        if self.kind == "wsd":
            if not (1 <= self.decay_steps <= self.total_steps - self.warmup_steps):
                raise ValueError(
                    f"decay_steps={self.decay_steps} must be in [1, max_steps - warmup_steps = "
                    f"{self.total_steps - self.warmup_steps}] for the wsd schedule"
                )
            if self.decay_shape not in ("linear", "sqrt"):
                raise ValueError(f"decay_shape={self.decay_shape!r}; expected 'linear' or 'sqrt'")

    def __call__(self, t: int) -> float:
        if self.kind == "cosine":
            return cosine_lr(t, self.lr_max, self.lr_min, self.warmup_steps, self.total_steps)
        if self.kind == "wsd":
            return wsd_lr(
                t,
                self.lr_max,
                self.lr_min,
                self.warmup_steps,
                self.total_steps,
                self.decay_steps,
                self.decay_shape,
            )
        return self.lr_max * (t + 1) / self.warmup_steps if t < self.warmup_steps else self.lr_max

    def apply(self, optimizer, t: int) -> float:
        """Set every param group's lr to lr(t) (times the group's optional ``lr_scale``); returns lr(t)."""
        lr = self(t)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        return lr

    def state_dict(self) -> dict:
        """The schedule's fields (``LRSchedule(**state_dict())`` rebuilds it), recorded in each checkpoint."""
        return asdict(self)
