"""PNG figures of a scaling fit (matplotlib, Agg): IsoFLOP curves with their parabolas, the loss-vs-FLOPs
envelope, L(N, D) contours with the compute-optimal line, predicted vs actual loss.

CS336 notes "规模定律"; Hoffmann et al. 2022 figures 2-4 are the models for these plots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lmstack.scaling.chinchilla import Approach
from lmstack.scaling.laws import chinchilla_loss, data_constrained_loss
from lmstack.utils import pyplot, save_png


def _save(fig, path: Path) -> Path:
    return save_png(fig, path, dpi=120, bbox_inches="tight")


def plot_isoflop(
    rows: list[dict[str, Any]], a2: Approach, path: Path, diverged: list[dict[str, Any]] = ()
) -> Path:
    """Final loss vs N for each budget, the fitted parabola in log N and its minimum; runs that
    diverged (no loss) as red crosses along the top edge at their N."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    cmap = plt.get_cmap("viridis")
    budgets = sorted(a2.extra["parabolas"])
    for i, C in enumerate(budgets):
        color = cmap(i / max(1, len(budgets) - 1))
        pts = [(r["N"], r["loss"]) for r in rows if float(r.get("budget", r["C"])) == C]
        n, l = np.array(pts).T
        ax.scatter(n, l, color=color, s=18, label=f"C = {C:.2g}")
        used = a2.extra.get("used", {}).get(C)
        if used is not None:
            n = used
        p0, p1, p2 = a2.extra["parabolas"][C]
        x = np.linspace(np.log(n.min()) - 0.2, np.log(n.max()) + 0.2, 100)
        ax.plot(np.exp(x), p0 + p1 * x + p2 * x * x, color=color, lw=1)
        xm = -p1 / (2 * p2)
        ax.plot(np.exp(xm), p0 + p1 * xm + p2 * xm * xm, "x", color=color, ms=9, mew=2)
    if diverged:
        ax.plot(
            [r["N"] for r in diverged],
            [0.97] * len(diverged),
            "rx",
            ms=8,
            mew=2,
            transform=ax.get_xaxis_transform(),  # x in data, y in axes fractions
            label=f"diverged ({len(diverged)})",
        )
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("final validation loss")
    ax.set_title(f"IsoFLOP profiles (approach 2): N_opt ∝ C^{a2.a:.2f}")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_envelope(
    curves: list[tuple[float, np.ndarray, np.ndarray]], a1: Approach, path: Path
) -> Path:
    """Validation loss vs FLOPs for every run, and the lower envelope (approach 1)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    Ns = sorted({c[0] for c in curves})
    cmap = plt.get_cmap("plasma")
    for N, f, l in curves:
        ax.plot(f, l, "-o", ms=2, lw=0.8, alpha=0.7, color=cmap(Ns.index(N) / max(1, len(Ns) - 1)))
    ax.plot(a1.C, a1.extra["envelope_loss"], "k-", lw=2, label="envelope")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(np.log10(min(Ns)), np.log10(max(Ns))))
    fig.colorbar(sm, ax=ax, label="log10 N")
    ax.set_xscale("log")
    ax.set_xlabel("FLOPs (6ND)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"Loss vs compute (approach 1): N_opt ∝ C^{a1.a:.2f}")
    ax.legend()
    return _save(fig, path)


def plot_contours(
    rows: list[dict[str, Any]], a3: Approach, path: Path, unique: float | None = None
) -> Path:
    """Contours of the fitted L(N, D), the runs, iso-C lines and the compute-optimal N_opt(C); a law fitted
    with repeats (``r_star``) is drawn through D' for ``unique`` tokens, with the line D = U."""
    plt = pyplot()
    p = dict(a3.law.params)
    r_star = p.pop("r_star", None)
    N = np.array([r["N"] for r in rows])
    D = np.array([r["D"] for r in rows])
    n = np.geomspace(N.min() / 3, N.max() * 3, 200)
    d = np.geomspace(D.min() / 3, D.max() * 3, 200)
    nn, dd = np.meshgrid(n, d)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    repeated = r_star is not None and unique is not None
    z = (
        data_constrained_loss(nn, dd, unique, **p, r_star=r_star)
        if repeated
        else chinchilla_loss(nn, dd, **p)
    )
    cs = ax.contourf(nn, dd, z, levels=20, cmap="viridis")
    fig.colorbar(cs, ax=ax, label="predicted loss")
    if repeated:
        ax.axhline(
            unique, color="w", ls=":", lw=1, label=f"D = U (1 epoch); R* = {r_star:.3g} above"
        )
    ax.scatter(N, D, c="w", edgecolors="k", s=20, label="runs")
    C = np.geomspace((6 * N * D).min(), (6 * N * D).max() * 10, 50)
    n_opt = a3.n_opt(C)
    ax.plot(n_opt, C / (6 * n_opt), "r-", lw=2, label=f"compute-optimal (a={a3.a:.2f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(n.min(), n.max())
    ax.set_ylim(d.min(), d.max())
    ax.set_xlabel("parameters N")
    ax.set_ylabel("tokens D")
    ax.set_title(
        f"L(N,D) = {p['E']:.2f} + {p['A']:.3g}/N^{p['alpha']:.2f} + {p['B']:.3g}/D^{p['beta']:.2f}"
    )
    ax.legend(fontsize=8, loc="lower left")
    return _save(fig, path)


def plot_predicted_vs_actual(
    actual: np.ndarray, predicted: np.ndarray, held: np.ndarray, path: Path
) -> Path:
    """Each run's loss against the approach-3 prediction; held-out runs marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(actual[~held], predicted[~held], s=18, label="fitted runs")
    if held.any():
        ax.scatter(actual[held], predicted[held], s=60, marker="*", color="r", label="held out")
    lo, hi = min(actual.min(), predicted.min()), max(actual.max(), predicted.max())
    ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax.set_xlabel("actual validation loss")
    ax.set_ylabel("predicted by L(N, D)")
    ax.set_title("predicted vs actual")
    ax.legend()
    return _save(fig, path)
