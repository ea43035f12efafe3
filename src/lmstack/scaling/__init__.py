"""Scaling laws: least squares, power-law fits, Chinchilla's approaches 1-3, the compute-optimal planner,
the IsoFLOP sweep on this machine, µP and the critical batch size.

Book of LLMs §3 (µP; LR(C) and L(C) = L∞ + β·C^−α; least squares in closed form and by iteration),
CS336 notes "规模定律" (data/model scaling, repeated data, compute-optimal allocation, batch size / µP).
"""

from lmstack.scaling.chinchilla import (
    Approach,
    approach1,
    approach2,
    approach3,
    envelope,
    isoflop_parabola,
)
from lmstack.scaling.laws import (
    Fit,
    bootstrap,
    bootstrap_chinchilla,
    chinchilla_loss,
    data_constrained_loss,
    effective_data,
    fit_chinchilla,
    fit_data_constrained,
    fit_loss_law,
    fit_lr_law,
    fit_offset_power_law,
    fit_power_law,
    prediction_interval,
)
from lmstack.scaling.lstsq import linear_fit, normal_equations, qr_lstsq, robust_fit
from lmstack.scaling.planner import (
    PRESETS,
    Law,
    Plan,
    compute_from_hardware,
    compute_optimal,
    get_law,
)

__all__ = [
    "Approach",
    "Fit",
    "Law",
    "PRESETS",
    "Plan",
    "approach1",
    "approach2",
    "approach3",
    "bootstrap",
    "bootstrap_chinchilla",
    "chinchilla_loss",
    "compute_from_hardware",
    "compute_optimal",
    "data_constrained_loss",
    "effective_data",
    "envelope",
    "fit_chinchilla",
    "fit_data_constrained",
    "fit_loss_law",
    "fit_lr_law",
    "fit_offset_power_law",
    "fit_power_law",
    "get_law",
    "isoflop_parabola",
    "linear_fit",
    "normal_equations",
    "prediction_interval",
    "qr_lstsq",
    "robust_fit",
]
