"""``fit_runs``: everything ``lmstack scaling fit`` reports, from a runs table — Chinchilla's three
approaches with bootstrap intervals, the held-out prediction and the figures.

CS336 notes "规模定律" (use small runs to predict a larger one), Book of LLMs §3.2-3.3 (the fits).
Rows with ``holdout: true`` are kept out of every fit and predicted by approach 3's L(N, D).

Runs that see their U unique tokens more than once (``D > U``) can be fitted with the data-constrained
D' of Muennighoff et al. 2023 (``repeats``): "none" (D as trained), "muennighoff" (D' with their R* = 15.4),
"fit" (D' with R* profiled), or "auto": the one of the three with the lowest **backtest** error — fit on
every budget but the largest, predict the largest budget's runs — so the recipe is chosen from the fitted
runs alone, never from the held-out run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import optimize

from lmstack.scaling import chinchilla as ch
from lmstack.scaling import plots
from lmstack.scaling.laws import (
    R_STAR_D,
    Fit,
    chinchilla_loss,
    data_constrained_loss,
    fit_loss_law,
    fit_power_law,
)
from lmstack.scaling.runs import columns
from lmstack.utils import atomic_write_text


@dataclass
class RunsFit:
    approaches: list[ch.Approach]
    errors: dict[str, str]  # approach -> why it could not be fitted
    holdout: list[dict[str, Any]] = field(
        default_factory=list
    )  # name, N, D, actual, predicted, interval, error
    figures: list[Path] = field(default_factory=list)
    loss_law: Fit | None = (
        None  # Book of LLMs §3.2 “compute-LR and compute-loss fits”'s L(C) = L∞ + β·C^−α through approach 1's envelope
    )
    repeats: str = "none"  # the approach-3 recipe used: none | muennighoff | fit
    backtest: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # recipe -> errors at the largest budget
    diverged: list[dict[str, Any]] = field(default_factory=list)  # runs left out: name, N, D, why

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "approaches": {},
            "errors": self.errors,
            "holdout": self.holdout,
            "repeats": self.repeats,
            "backtest": self.backtest,
            "figures": [str(p) for p in self.figures],
            "loss_law": self.loss_law.params if self.loss_law else None,
            "diverged": self.diverged,
        }
        for a in self.approaches:
            d = {
                "a": a.a,
                "b": a.b,
                "a_ci": a.a_ci,
                "b_ci": a.b_ci,
                "points": {"C": a.C.tolist(), "N_opt": a.N_opt.tolist(), "D_opt": a.D_opt.tolist()},
            }
            if a.extra.get("skipped"):
                d["budgets_left_out"] = {str(c): w for c, w in a.extra["skipped"].items()}
            if a.extra.get("outside"):
                d["minimum_outside_sizes"] = a.extra["outside"]
            if a.law is not None:
                d["law"] = a.law.params
                d["law_ci"] = a.law.ci
            if a.extra.get("constrained"):
                d["constrained"] = a.extra["constrained"]
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


REPEATS = {
    "none": None,
    "muennighoff": R_STAR_D,
    "fit": None,
}  # recipe -> fixed R* (None: fitted / no D')


def unique_tokens(rows: list[dict[str, Any]], default: float | None = None) -> np.ndarray | None:
    """U per row: the row's ``unique_tokens`` (the sweep records its training split) or ``default``;
    None when some row has neither."""
    U = [r.get("unique_tokens", default) for r in rows]
    if any(u is None for u in U):
        return None
    U = np.array(U, dtype=np.float64)
    if not (np.isfinite(U).all() and (U > 0).all()):
        raise ValueError(f"unique token counts must be > 0; got {sorted(set(U.tolist()))[:3]}")
    return U


def law_loss(params: dict[str, float], N, D, U=None) -> np.ndarray:
    """Approach 3's L at (N, D): through D' when the law was fitted with repeats (``r_star`` in params)."""
    if "r_star" in params:
        return data_constrained_loss(N, D, U, **params)
    return chinchilla_loss(N, D, **params)


def _approach3(rows, repeats: str, U, n_boot: int, level: float, seed: int) -> ch.Approach:
    N, D, L = columns(rows, "N", "D", "loss")
    if repeats == "none":
        return ch.approach3(N, D, L, n_boot=n_boot, level=level, seed=seed)
    return ch.approach3(
        N, D, L, n_boot=n_boot, level=level, seed=seed, U=U, r_star=REPEATS[repeats]
    )


def _constrained_n_opt(params: dict[str, float], C: np.ndarray, U: float) -> np.ndarray:
    """argmin over N of the data-constrained L(N, C/6N; U), numerically (no closed form once D > U)."""
    out = []
    for c in C:
        hi = np.log(c / 6.0)  # D >= 1 token
        r = optimize.minimize_scalar(
            lambda ln: float(data_constrained_loss(np.exp(ln), c / 6.0 / np.exp(ln), U, **params)),  # noqa: B023
            bounds=(0.0, hi),
            method="bounded",
            options={"xatol": 1e-6},
        )
        out.append(float(np.exp(r.x)))
    return np.array(out)


def constrained_optimum(
    a3: ch.Approach, C: np.ndarray, U: float, level: float = 0.9
) -> dict[str, Any]:
    """Approach 3 with a fixed supply of U unique tokens: the compute-optimal N at each budget under the fitted
    D' law and the exponent a of N_opt ∝ C^a through them (with bootstrap intervals). a = β/(α+β) holds
    only while D_opt ≤ U; past it tokens are worth less and the optimum moves to larger models."""
    C = np.asarray(C, dtype=np.float64)
    n = _constrained_n_opt(a3.law.params, C, U)
    out = {
        "U": U,
        "C": C.tolist(),
        "N_opt": n.tolist(),
        "D_opt": (C / 6.0 / n).tolist(),
        "a": None,
        "a_ci": None,
    }
    if len(C) >= 2:
        out["a"] = fit_power_law(C, n).params["b"]
        if a3.law.samples is not None:
            names = list(a3.law.params)
            a_s = [
                fit_power_law(C, _constrained_n_opt(dict(zip(names, row)), C, U)).params["b"]
                for row in a3.law.samples
            ]
            q = np.percentile(a_s, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
            out["a_ci"] = (float(q[0]), float(q[1]))
    return out


def backtest(
    rows: list[dict[str, Any]], recipes=tuple(REPEATS), U: np.ndarray | None = None
) -> dict[str, dict]:
    """Fit approach 3 on the runs of every budget but the largest and predict the largest budget's runs,
    per recipe: {recipe: {"mean_abs_error", "errors" (relative, per test run), "test": names}}.
    Only non-held-out rows go in; ``U`` is per row (None: only "none" can run)."""
    rows = [r for r in rows if not r.get("holdout")]
    budget = np.array([float(r.get("budget", r["C"])) for r in rows])
    top = budget.max()
    train = [i for i in range(len(rows)) if budget[i] < top]
    test = [i for i in range(len(rows)) if budget[i] == top]
    if len(train) < 5 or not test:
        raise ValueError(
            f"backtest: {len(train)} runs below the largest budget {top:.3g} (need >= 5) and "
            f"{len(test)} at it"
        )
    out = {}
    for recipe in recipes:
        if recipe != "none" and U is None:
            continue
        a3 = _approach3(
            [rows[i] for i in train], recipe, None if U is None else U[train], 0, 0.9, 0
        )
        N, D, L = columns([rows[i] for i in test], "N", "D", "loss")
        pred = law_loss(a3.law.params, N, D, None if U is None else U[test])
        err = (pred - L) / L
        out[recipe] = {
            "mean_abs_error": float(np.mean(np.abs(err))),
            "errors": err.tolist(),
            "test": [rows[i]["name"] for i in test],
            "train_budgets": sorted(set(budget[train].tolist())),
            "test_budget": float(top),
            "law": a3.law.params,
        }
    return out


def fit_runs(
    rows: list[dict[str, Any]],
    out_dir: Path | None = None,
    n_boot: int = 100,
    level: float = 0.9,
    seed: int = 0,
    window: float | None = None,
    repeats: str = "none",
    unique: float | None = None,
) -> RunsFit:
    """Approaches 1-3 on the non-held-out rows; predict the held-out ones; figures into ``out_dir``.

    ``repeats``: approach 3's recipe for runs with D > U (module docstring); ``unique``: U for rows that
    do not record ``unique_tokens``."""
    if repeats not in (*REPEATS, "auto"):
        raise ValueError(f"repeats={repeats!r}; expected one of {[*REPEATS, 'auto']}")
    diverged = [
        {k: r.get(k) for k in ("name", "budget", "N", "D", "C", "holdout", "diverged")}
        for r in rows
        if r.get("diverged")
    ]
    rows = [r for r in rows if not r.get("diverged")]  # no loss to fit: listed and plotted only
    fit_rows = [r for r in rows if not r.get("holdout")]
    held = [r for r in rows if r.get("holdout")]
    if len(fit_rows) < 5:
        raise ValueError(
            f"{len(fit_rows)} runs to fit"
            + (f" ({len(diverged)} more diverged)" if diverged else "")
            + "; the scaling fits need >= 5 (L(N, D) has 5 parameters)"
        )
    U_all = unique_tokens(rows, unique)
    if repeats in ("muennighoff", "fit") and U_all is None:
        raise ValueError(
            f"repeats={repeats!r} needs the unique training tokens U: rows without 'unique_tokens' "
            "need --unique-tokens"
        )
    U_fit = None if U_all is None else U_all[[not r.get("holdout") for r in rows]]
    U_held = None if U_all is None else U_all[[bool(r.get("holdout")) for r in rows]]
    N, D, L, C = columns(fit_rows, "N", "D", "loss", "C")
    budget = np.array([float(r.get("budget", r["C"])) for r in fit_rows])
    res = RunsFit([], {}, diverged=diverged)
    if repeats == "auto":
        try:
            res.backtest = backtest(fit_rows, U=U_fit)
            repeats = min(res.backtest, key=lambda k: res.backtest[k]["mean_abs_error"])
        except ValueError as e:
            res.errors["backtest"] = f"{e}; approach 3 uses D as trained"
            repeats = "none"
    res.repeats = repeats
    curves = _curves(fit_rows)
    for name, fn in (
        ("approach 1", lambda: ch.approach1(curves, n_boot=n_boot, level=level, seed=seed)),
        (
            "approach 2",
            lambda: ch.approach2(
                budget, N, L, n_boot=n_boot, level=level, seed=seed, window=window
            ),
        ),
        ("approach 3", lambda: _approach3(fit_rows, repeats, U_fit, n_boot, level, seed)),
    ):
        try:
            res.approaches.append(fn())
        except ValueError as e:
            res.errors[name] = str(e)
    a3 = next((a for a in res.approaches if a.law is not None), None)
    if a3 is not None and "r_star" in a3.law.params:
        a3.extra["constrained"] = constrained_optimum(
            a3, np.unique(budget), float(np.median(U_fit)), level
        )
    a1 = next((a for a in res.approaches if "envelope_loss" in a.extra), None)
    if a1 is not None:
        try:
            res.loss_law = fit_loss_law(a1.C, a1.extra["envelope_loss"])
        except ValueError as e:
            res.errors["L(C)"] = str(e)
    a3 = next((a for a in res.approaches if a.law is not None), None)
    if a3 is not None:
        # the scatter of single runs about the law (log space): seeds, finite validation sets, schedule effects
        resid = np.log(L) - np.log(law_loss(a3.law.params, N, D, U_fit))
        names = list(a3.law.params)
        rng = np.random.default_rng(seed)
        for j, r in enumerate(held):
            u = None if U_held is None else U_held[j]
            pred = float(law_loss(a3.law.params, r["N"], r["D"], u))
            interval = interval_run = None
            if a3.law.samples is not None:
                vals = np.array(
                    [
                        float(law_loss(dict(zip(names, row)), r["N"], r["D"], u))
                        for row in a3.law.samples
                    ]
                )
                ok = np.isfinite(vals)
                q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
                interval = tuple(float(v) for v in np.percentile(vals[ok], q))
                runs = vals[ok] * np.exp(
                    rng.choice(resid, size=ok.sum())
                )  # law uncertainty + one run's scatter
                interval_run = tuple(float(v) for v in np.percentile(runs, q))
            res.holdout.append(
                {
                    "name": r["name"],
                    "N": r["N"],
                    "D": r["D"],
                    "C": r["C"],
                    "actual": r["loss"],
                    "predicted": pred,
                    "interval": interval,
                    "interval_run": interval_run,
                    "error": (pred - r["loss"]) / r["loss"],
                    "epochs": None if u is None else r["D"] / u,
                }
            )
    if out_dir is not None:
        try:
            res.figures = _figures(rows, fit_rows, curves, res, out_dir, unique)
        except ValueError as e:  # matplotlib cannot place ticks for values near float64's limit
            res.errors["figures"] = (
                f"matplotlib could not draw them ({e}; losses up to {L.max():.3g})"
            )
        atomic_write_text(
            out_dir / "fit.json", json.dumps(res.summary(), indent=2, default=float) + "\n"
        )
    return res


def _figures(
    rows, fit_rows, curves, res: RunsFit, out_dir: Path, unique: float | None
) -> list[Path]:

    out_dir.mkdir(parents=True, exist_ok=True)
    by = {a.name.split(" (")[0]: a for a in res.approaches}
    figs = []
    if "approach 2" in by:
        figs.append(
            plots.plot_isoflop(fit_rows, by["approach 2"], out_dir / "isoflop.png", res.diverged)
        )
    if "approach 1" in by:
        figs.append(plots.plot_envelope(curves, by["approach 1"], out_dir / "envelope.png"))
    if "approach 3" in by:
        a3 = by["approach 3"]
        U = unique_tokens(rows, unique)
        figs.append(
            plots.plot_contours(
                rows, a3, out_dir / "contours.png", None if U is None else float(np.median(U))
            )
        )
        N, D, L = columns(rows, "N", "D", "loss")
        pred = law_loss(a3.law.params, N, D, U)
        held = np.array([bool(r.get("holdout")) for r in rows])
        figs.append(
            plots.plot_predicted_vs_actual(L, pred, held, out_dir / "predicted_vs_actual.png")
        )
    return figs
