"""The compute-optimal planner: given a budget C (FLOPs, or GPUs × hours × MFU × peak), the model size
N_opt, the tokens D_opt = C/(6·N_opt), tokens per parameter and the predicted loss.

CS336 notes "规模定律" (the compute-optimal allocation), Book of LLMs §1.6 (C ≈ 6ND). For the parametric law
L(N, D) = E + A/N^α + B/D^β, minimising L on the curve 6ND = C gives (Hoffmann et al. 2022, eq. 4)

    N_opt = G·(C/6)^a,  D_opt = G⁻¹·(C/6)^b,  G = (αA / (βB))^(1/(α+β)),  a = β/(α+β),  b = α/(α+β),

so a + b = 1. Presets:

- ``chinchilla``: Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", approach 3
  (§3.3, eq. 10): E = 1.69, A = 406.4, B = 410.7, α = 0.34, β = 0.28.
- ``epoch``: Besiroglu, Erdil, Barnett & You 2024, "Chinchilla Scaling: A replication attempt" (Epoch AI),
  refit of approach 3 on the data read off the paper's figure: E = 1.82, A = 482.01, B = 2085.43,
  α = 0.3478, β = 0.3658 (≈ 20 tokens per parameter, consistent with approaches 1 and 2).
- ``chinchilla-approach1``: no loss law; the allocation of Hoffmann et al.'s approach 1 (a = b = 0.50,
  their Table 2) at 20 tokens per parameter, which is what their Table 3 rows follow (D ≈ 20·N, C = 6ND).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Law:
    """L(N, D) = E + A/N^α + B/D^β, or (``tokens_per_param`` set) a fixed-ratio allocation with no loss."""

    name: str
    E: float = float("nan")
    A: float = float("nan")
    B: float = float("nan")
    alpha: float = float("nan")
    beta: float = float("nan")
    tokens_per_param: float | None = None  # allocation rule D = k·N (approach 1's a = b = 0.5)
    source: str = ""

    def loss(self, N: float, D: float) -> float:
        if self.tokens_per_param is not None:
            return float("nan")
        return self.E + self.A / N**self.alpha + self.B / D**self.beta

    @property
    def a(self) -> float:
        """Exponent of N_opt ∝ C^a."""
        return 0.5 if self.tokens_per_param is not None else self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of D_opt ∝ C^b (a + b = 1)."""
        return 0.5 if self.tokens_per_param is not None else self.alpha / (self.alpha + self.beta)

    @property
    def G(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))

    @classmethod
    def from_params(cls, params: dict[str, float], name: str = "fitted") -> Law:
        return cls(
            name,
            params["E"],
            params["A"],
            params["B"],
            params["alpha"],
            params["beta"],
            source="fit",
        )


PRESETS = {
    "chinchilla": Law(
        "chinchilla",
        1.69,
        406.4,
        410.7,
        0.34,
        0.28,
        source="Hoffmann et al. 2022, approach 3 (eq. 10)",
    ),
    "epoch": Law(
        "epoch",
        1.82,
        482.01,
        2085.43,
        0.3478,
        0.3658,
        source="Besiroglu et al. 2024 (Epoch AI replication of approach 3)",
    ),
    "chinchilla-approach1": Law(
        "chinchilla-approach1",
        tokens_per_param=20.0,
        source="Hoffmann et al. 2022, approach 1 (a = b = 0.50; Table 3 at ~20 tokens/param)",
    ),
}


def get_law(name: str) -> Law:
    if name not in PRESETS:
        raise ValueError(f"unknown scaling-law preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


@dataclass(frozen=True)
class Plan:
    C: float  # training FLOPs
    N: float  # parameters
    D: float  # training tokens
    tokens_per_param: float
    loss: float  # predicted final loss (nan for an allocation-only law)
    law: str

    def to_dict(self) -> dict:
        return asdict(self)


def compute_optimal(C: float, law: Law | str = "chinchilla") -> Plan:
    """N_opt, D_opt (6·N·D = C) and the predicted loss for a budget of C FLOPs."""
    law = get_law(law) if isinstance(law, str) else law
    if not (isinstance(C, (int, float)) and math.isfinite(C) and C > 0):
        raise ValueError(f"compute budget C={C!r} must be a positive number of FLOPs")
    if law.tokens_per_param is not None:
        N = math.sqrt(C / (6.0 * law.tokens_per_param))
    else:
        N = law.G * (C / 6.0) ** law.a
    D = C / (6.0 * N)
    return Plan(float(C), N, D, D / N, law.loss(N, D), law.name)


def optimal_for_params(N: float, law: Law | str = "epoch") -> Plan:
    """The inverse question: the budget C (and tokens D) for which a model of N parameters is compute-optimal
    (N = G·(C/6)^a  ⇒  C = 6·(N/G)^(1/a); for the fixed-ratio rule D = k·N)."""
    law = get_law(law) if isinstance(law, str) else law
    if not (isinstance(N, (int, float)) and math.isfinite(N) and N > 0):
        raise ValueError(f"N={N!r} must be a positive number of parameters")
    if law.tokens_per_param is not None:
        C = 6.0 * N * law.tokens_per_param * N
    else:
        C = 6.0 * (N / law.G) ** (1.0 / law.a)
    D = C / (6.0 * N)
    return Plan(C, float(N), D, D / N, law.loss(N, D), law.name)


def compute_from_hardware(n_devices: int, hours: float, peak_flops: float, mfu: float) -> float:
    """C = devices × seconds × peak FLOP/s × MFU (model FLOPs utilisation, Book of LLMs §1.6 “forward and backward FLOPs”)."""
    for name, v in (("devices", n_devices), ("hours", hours), ("peak_flops", peak_flops)):
        if not (v > 0):
            raise ValueError(f"{name}={v!r} must be > 0")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu!r} must be in (0, 1]")
    return n_devices * hours * 3600.0 * peak_flops * mfu
