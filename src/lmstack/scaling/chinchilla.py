"""Chinchilla's three approaches to the compute-optimal N_opt(C) ∝ C^a, D_opt(C) ∝ C^b (Hoffmann et al.
2022 §3), on a table of training runs (N parameters, D tokens, C = 6ND FLOPs, final loss).

1. ``approach1``: the lower envelope of the loss-vs-FLOPs curves of all runs; at each C the run on the
   envelope names N_opt(C); power laws through those points.
2. ``approach2``: IsoFLOP profiles — for each budget C a parabola in log N through the final losses,
   its minimum N_opt(C); power laws through the minima.
3. ``approach3``: fit L(N, D) = E + A/N^α + B/D^β (``laws.fit_chinchilla``) and minimise it on 6ND = C:
   a = β/(α+β), b = α/(α+β) (``planner``).

CS336 notes "规模定律" (the compute-optimal allocation), Book of LLMs §3.3 (the least-squares fits).
Each result carries bootstrap intervals for a and b.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lmstack.scaling.laws import (
    R_STAR_D,
    Fit,
    bootstrap_chinchilla,
    fit_chinchilla,
    fit_chinchilla_repeated,
    fit_power_law,
)
from lmstack.scaling.lstsq import qr_lstsq
from lmstack.scaling.planner import Law


@dataclass
class Approach:
    name: str
    a: float  # N_opt ∝ C^a
    b: float  # D_opt ∝ C^b
    a_ci: tuple[float, float] | None = None
    b_ci: tuple[float, float] | None = None
    C: np.ndarray = field(
        default_factory=lambda: np.zeros(0)
    )  # the points the power laws went through
    N_opt: np.ndarray = field(default_factory=lambda: np.zeros(0))
    D_opt: np.ndarray = field(default_factory=lambda: np.zeros(0))
    n_fit: Fit | None = None  # N_opt(C) power law (approaches 1, 2)
    law: Fit | None = None  # L(N, D) (approach 3)
    extra: dict = field(default_factory=dict)  # parabolas (approach 2), envelope (approach 1)

    def n_opt(self, C) -> np.ndarray:
        C = np.asarray(C, dtype=np.float64)
        if self.law is not None:
            law = Law.from_params(self.law.params)
            return law.G * (C / 6.0) ** law.a
        return self.n_fit.predict(C)

    def __str__(self) -> str:
        def fmt(v, ci):
            return f"{v:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")

        return f"{self.name}: a = {fmt(self.a, self.a_ci)}, b = {fmt(self.b, self.b_ci)}"


def _ci(samples: np.ndarray, level: float) -> tuple[float, float]:
    q = np.percentile(samples, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return float(q[0]), float(q[1])


def _alloc(name: str, C: np.ndarray, N: np.ndarray) -> Approach:
    if len(np.unique(C)) < 2:
        raise ValueError(
            f"{name}: N_opt is known at {len(np.unique(C))} compute budget(s); a power law needs >= 2"
        )
    n_fit = fit_power_law(C, N)
    D = C / (6.0 * N)
    b = fit_power_law(C, D).params["b"]
    return Approach(name, n_fit.params["b"], b, C=C, N_opt=N, D_opt=D, n_fit=n_fit)


# ---- approach 1 -----------------------------------------------------------------------------------
def envelope(
    curves: list[tuple[float, np.ndarray, np.ndarray]], points: int = 40, slack: float = 0.05
) -> tuple[np.ndarray, ...]:
    """The lower envelope of loss-vs-FLOPs curves ``(N, flops (k,), loss (k,))``: at log-spaced C, the
    lowest loss any run reached at that C (loss interpolated linearly in log C) and that run's N.

    A run counts as reaching up to ``(1 + slack)`` × its last FLOP count at its final loss: runs of one
    budget end a little apart (whole optimizer steps), and without the slack the envelope's last point
    would belong to whichever run happened to end last, however bad its loss."""
    lo = min(float(np.min(f)) for _, f, _ in curves)
    hi = max(float(np.max(f)) for _, f, _ in curves)
    grid_c = np.unique(
        np.concatenate([np.geomspace(lo, hi, points)] + [np.asarray(f)[-1:] for _, f, _ in curves])
    )
    best_l = np.full(len(grid_c), np.inf)
    best_n = np.full(len(grid_c), np.nan)
    for N, f, loss in curves:
        f, loss = np.asarray(f, dtype=np.float64), np.asarray(loss, dtype=np.float64)
        order = np.argsort(f)
        f, loss = f[order], loss[order]
        inside = (grid_c >= f[0] * (1 - 1e-9)) & (grid_c <= f[-1] * (1 + slack))
        li = np.interp(np.log(grid_c[inside]), np.log(f), loss)  # constant beyond the last point
        better = li < best_l[inside]
        idx = np.flatnonzero(inside)[better]
        best_l[idx] = li[better]
        best_n[idx] = N
    ok = np.isfinite(best_l)
    return grid_c[ok], best_n[ok], best_l[ok]


def approach1(
    curves: list[tuple[float, np.ndarray, np.ndarray]],
    n_boot: int = 200,
    level: float = 0.9,
    seed: int = 0,
) -> Approach:
    """Approach 1: N_opt(C) from the envelope; intervals from resampling the runs (curves)."""
    if len(curves) < 2:
        raise ValueError(f"approach 1 needs the curves of >= 2 runs (got {len(curves)})")
    C, N, L = envelope(curves)
    res = _alloc("approach 1 (envelope)", C, N)
    res.extra["envelope_loss"] = L
    rng = np.random.default_rng(seed)
    a_s, b_s = [], []
    for _ in range(n_boot):
        pick = [curves[i] for i in rng.integers(0, len(curves), len(curves))]
        try:
            c, n, _ = envelope(pick)
            r = _alloc("", c, n)
        except ValueError:
            continue
        a_s.append(r.a)
        b_s.append(r.b)
    if len(a_s) >= 10:
        res.a_ci, res.b_ci = _ci(np.array(a_s), level), _ci(np.array(b_s), level)
    return res


# ---- approach 2 -----------------------------------------------------------------------------------
def isoflop_parabola(N, L) -> tuple[float, float, float]:
    """Least-squares parabola L ≈ p0 + p1·x + p2·x², x = ln N (QR path); returns (p0, p1, p2)."""
    x = np.log(np.asarray(N, dtype=np.float64))
    p = qr_lstsq(np.column_stack([np.ones_like(x), x, x * x]), np.asarray(L, dtype=np.float64))
    return float(p[0]), float(p[1]), float(p[2])


def _minima(
    groups: dict[float, tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, dict, dict]:
    """Per-budget parabola minima; budgets whose profile has < 3 sizes or is not convex are skipped
    (with the reason), and at least 2 budgets must remain for the power law."""
    Cs, Ns, parabolas, skipped = [], [], {}, {}
    for C, (N, L) in sorted(groups.items()):
        if len(np.unique(N)) < 3:
            skipped[C] = f"{len(np.unique(N))} distinct model sizes; a parabola needs >= 3"
            continue
        p0, p1, p2 = isoflop_parabola(N, L)
        if p2 <= 0:
            skipped[C] = (
                f"the IsoFLOP curve is not convex (fitted curvature {p2:.3g}); widen the range of model "
                "sizes so the minimum lies inside it"
            )
            continue
        Cs.append(C)
        Ns.append(np.exp(-p1 / (2 * p2)))
        parabolas[C] = (p0, p1, p2)
    if len(Cs) < 2:
        why = "; ".join(f"C={c:.3g}: {w}" for c, w in skipped.items())
        raise ValueError(
            f"approach 2: {len(Cs)} budget(s) with a convex IsoFLOP profile; a power law needs >= 2"
            + (f" ({why})" if why else "")
        )
    return np.array(Cs), np.array(Ns), parabolas, skipped


def approach2(
    C, N, L, n_boot: int = 200, level: float = 0.9, seed: int = 0, window: float | None = None
) -> Approach:
    """Approach 2: runs grouped by budget C; per-budget parabola minima; intervals from resampling runs
    within each budget. ``window``: fit each parabola only to the sizes within a factor ``window`` of that
    budget's best run (loss is parabolic in log N only near the minimum); None uses every run, as
    Hoffmann et al. did."""
    C, N, L = (np.asarray(v, dtype=np.float64) for v in (C, N, L))
    if window is not None and not window > 1:
        raise ValueError(
            f"window={window!r} must be > 1 (a factor in N around each budget's best run)"
        )
    groups = {}
    for c in np.unique(C):
        n, l = N[C == c], L[C == c]
        if window is not None:
            best = n[np.argmin(l)]
            keep = (n >= best / window) & (n <= best * window)
            n, l = n[keep], l[keep]
        groups[float(c)] = (n, l)
    Cs, Ns, parabolas, skipped = _minima(groups)
    res = _alloc("approach 2 (IsoFLOP)", Cs, Ns)
    res.extra["parabolas"] = parabolas
    res.extra["skipped"] = skipped
    res.extra["used"] = {
        c: groups[c][0] for c in parabolas
    }  # the sizes each parabola was fitted to
    # a minimum outside the sizes trained at that budget is an extrapolation: worth a warning
    res.extra["outside"] = [
        float(c) for c, n in zip(Cs, Ns) if not groups[c][0].min() <= n <= groups[c][0].max()
    ]
    rng = np.random.default_rng(seed)
    a_s, b_s = [], []
    for _ in range(n_boot):
        g = {}
        for c, (n, l) in groups.items():
            i = rng.integers(0, len(n), len(n))
            g[c] = (n[i], l[i])
        try:
            r = _alloc("", *_minima(g)[:2])
        except ValueError:
            continue
        a_s.append(r.a)
        b_s.append(r.b)
    if len(a_s) >= 10:
        res.a_ci, res.b_ci = _ci(np.array(a_s), level), _ci(np.array(b_s), level)
    return res


# ---- approach 3 -----------------------------------------------------------------------------------
def approach3(
    N,
    D,
    L,
    n_boot: int = 100,
    level: float = 0.9,
    seed: int = 0,
    U=None,
    r_star: float | None = R_STAR_D,
) -> Approach:
    """Approach 3: the parametric L(N, D); a = β/(α+β), b = α/(α+β) for the fit and each bootstrap refit.

    With ``U`` (unique training tokens, per run or one number) runs that repeat their data are fitted with
    the data-constrained D' (``laws.fit_chinchilla_repeated``; ``r_star`` fixed, or None to fit it). The
    compute-optimal a, b are unchanged by it: while D ≤ U, D' = D."""
    if U is None:
        fit = fit_chinchilla(N, D, L)
    else:
        fit = fit_chinchilla_repeated(N, D, U, L, r_star=r_star)
    p = fit.params
    try:  # N_opt = G·(C/6)^a needs alpha, beta > 0 and a finite G
        G = Law.from_params(p).G if p["alpha"] > 0 and p["beta"] > 0 else float("nan")
    except (OverflowError, ZeroDivisionError):  # losses near float64's limit: A or B overflow
        G = float("nan")
    if not (np.isfinite(G) and G > 0):
        raise ValueError(
            f"approach 3: the fitted law ({', '.join(f'{k}={v:.3g}' for k, v in p.items())}) gives "
            f"no allocation: N_opt needs alpha > 0, beta > 0 and finite A, B; the losses "
            f"({float(np.min(L)):.3g} to {float(np.max(L)):.3g}) do not fall with N and D "
            "(constant, noise-only or diverged runs?)"
        )
    if n_boot:
        bootstrap_chinchilla(
            fit, N, D, L, n_boot=n_boot, level=level, seed=seed, U=U, fit_r_star=r_star is None
        )
    p = fit.params
    res = Approach(
        "approach 3 (L(N,D) fit)",
        p["beta"] / (p["alpha"] + p["beta"]),
        p["alpha"] / (p["alpha"] + p["beta"]),
        law=fit,
    )
    if fit.samples is not None:
        names = list(p)
        al, be = fit.samples[:, names.index("alpha")], fit.samples[:, names.index("beta")]
        res.a_ci, res.b_ci = _ci(be / (al + be), level), _ci(al / (al + be), level)
    return res
