"""``fit_runs``: everything ``lmstack scaling fit`` reports, from a runs table — Chinchilla's three
approaches with bootstrap intervals, the held-out prediction and the figures.

Seed 001 "规模定律" (use small runs to predict a larger one), seed 000 §3.2-3.3 (the fits).
Rows with ``holdout: true`` are kept out of every fit and predicted by approach 3's L(N, D).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmstack.scaling import chinchilla as ch
from lmstack.scaling.laws import Fit, chinchilla_loss, fit_loss_law, prediction_interval
from lmstack.scaling.runs import columns
from lmstack.utils import atomic_write_text
from lmstack.scaling import plots


@dataclass
class RunsFit:
    approaches: list[ch.Approach]
    errors: dict[str, str]  # approach -> why it could not be fitted
    holdout: list[dict[str, Any]] = field(default_factory=list)  # name, N, D, actual, predicted, interval, error
    figures: list[Path] = field(default_factory=list)
    loss_law: Fit | None = None  # seed 000 §3.2's L(C) = L∞ + β·C^−α through approach 1's envelope

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"approaches": {}, "errors": self.errors, "holdout": self.holdout,
                               "figures": [str(p) for p in self.figures],
                               "loss_law": self.loss_law.params if self.loss_law else None}
        for a in self.approaches:
            d = {"a": a.a, "b": a.b, "a_ci": a.a_ci, "b_ci": a.b_ci,
                 "points": {"C": a.C.tolist(), "N_opt": a.N_opt.tolist(), "D_opt": a.D_opt.tolist()}}
            if a.extra.get("skipped"):
                d["budgets_left_out"] = {str(c): w for c, w in a.extra["skipped"].items()}
            if a.extra.get("outside"):
                d["minimum_outside_sizes"] = a.extra["outside"]
            if a.law is not None:
                d["law"] = a.law.params
                d["law_ci"] = a.law.ci
            out["approaches"][a.name] = d
        return out


def _curves(rows: list[dict[str, Any]]) -> list[tuple[float, np.ndarray, np.ndarray]]:
    curves = []
    for r in rows:
        pts = [p for p in r.get("curve") or [] if p[0] > 0 and p[1] > 0]
        if not pts or pts[-1][0] < r["C"] * 0.999:
            pts.append([r["C"], r["loss"]])
        f, l = np.array(pts, dtype=np.float64).T
        curves.append((float(r["N"]), f, l))
    return curves


def fit_runs(rows: list[dict[str, Any]], out_dir: Path | None = None, n_boot: int = 100, level: float = 0.9,
             seed: int = 0, window: float | None = None) -> RunsFit:
    """Approaches 1-3 on the non-held-out rows; predict the held-out ones; figures into ``out_dir``."""
    fit_rows = [r for r in rows if not r.get("holdout")]
    held = [r for r in rows if r.get("holdout")]
    if len(fit_rows) < 5:
        raise ValueError(f"{len(fit_rows)} runs to fit; the scaling fits need >= 5 (L(N, D) has 5 parameters)")
    N, D, L, C = columns(fit_rows, "N", "D", "loss", "C")
    budget = np.array([float(r.get("budget", r["C"])) for r in fit_rows])
    res = RunsFit([], {})
    curves = _curves(fit_rows)
    for name, fn in (("approach 1", lambda: ch.approach1(curves, n_boot=n_boot, level=level, seed=seed)),
                     ("approach 2", lambda: ch.approach2(budget, N, L, n_boot=n_boot, level=level, seed=seed,
                                                              window=window)),
                     ("approach 3", lambda: ch.approach3(N, D, L, n_boot=n_boot, level=level, seed=seed))):
        try:
            res.approaches.append(fn())
        except ValueError as e:
            res.errors[name] = str(e)
    a1 = next((a for a in res.approaches if "envelope_loss" in a.extra), None)
    if a1 is not None:
        try:
            res.loss_law = fit_loss_law(a1.C, a1.extra["envelope_loss"])
        except ValueError as e:
            res.errors["L(C)"] = str(e)
    a3 = next((a for a in res.approaches if a.law is not None), None)
    if a3 is not None:
        for r in held:
            pred = float(chinchilla_loss(r["N"], r["D"], **a3.law.params))
            interval = None
            if a3.law.samples is not None:
                interval = prediction_interval(a3.law, lambda p, r=r: float(chinchilla_loss(r["N"], r["D"], **p)),
                                               level)
            res.holdout.append({"name": r["name"], "N": r["N"], "D": r["D"], "C": r["C"], "actual": r["loss"],
                                "predicted": pred, "interval": interval,
                                "error": (pred - r["loss"]) / r["loss"]})
    if out_dir is not None:
        res.figures = _figures(rows, fit_rows, curves, res, out_dir)
        atomic_write_text(out_dir / "fit.json", json.dumps(res.summary(), indent=2, default=float) + "\n")
    return res


def _figures(rows, fit_rows, curves, res: RunsFit, out_dir: Path) -> list[Path]:

    out_dir.mkdir(parents=True, exist_ok=True)
    by = {a.name.split(" (")[0]: a for a in res.approaches}
    figs = []
    if "approach 2" in by:
        figs.append(plots.plot_isoflop(fit_rows, by["approach 2"], out_dir / "isoflop.png"))
    if "approach 1" in by:
        figs.append(plots.plot_envelope(curves, by["approach 1"], out_dir / "envelope.png"))
    if "approach 3" in by:
        a3 = by["approach 3"]
        figs.append(plots.plot_contours(rows, a3, out_dir / "contours.png"))
        N, D, L = columns(rows, "N", "D", "loss")
        pred = chinchilla_loss(N, D, **a3.law.params)
        held = np.array([bool(r.get("holdout")) for r in rows])
        figs.append(plots.plot_predicted_vs_actual(L, pred, held, out_dir / "predicted_vs_actual.png"))
    return figs
