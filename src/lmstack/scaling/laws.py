"""Scaling-law forms and their fits, each with bootstrap confidence intervals.

Book of LLMs §3.2 (the compute–learning-rate law LR(C) = β·C^−α, fitted as a line in log–log space, and the
compute–loss law L(C) = L∞ + β·C^−α, which needs the irreducible loss L∞ or the fit sends L → 0),
CS336 notes "规模定律" (data scaling loss = c·n^−α; repeated data is nearly as good as fresh data for up to
~4 epochs), Chinchilla's parametric loss L(N, D) = E + A/N^α + B/D^β (Hoffmann et al. 2022, eq. 2) and
the data-constrained form of Muennighoff et al. 2023 (effective data D' with a decaying value per repeat).

Every fit returns a ``Fit`` (parameter dict, a ``predict`` function and, once ``bootstrap`` has run,
percentile intervals). Nonlinear forms are fitted in log space with a Huber loss (``lstsq.robust_fit``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy import optimize

from lmstack.scaling.lstsq import grid, linear_fit, robust_fit

HUBER_DELTA = 1e-3  # Hoffmann et al. 2022 (approach 3) and Besiroglu et al. 2024


def _lse_softmax(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log Σ_k exp(z_k) over axis 0 with the max trick, and the softmax weights (its gradient).
    (scipy.special.logsumexp gives the same numbers at ~20x the per-call cost, which a grid of starts feels.)"""
    m = z.max(axis=0)
    e = np.exp(z - m)
    s = e.sum(axis=0)
    return m + np.log(s), e / s


def _positive(name: str, x) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1 or len(a) == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array (got shape {a.shape})")
    if not (np.isfinite(a).all() and (a > 0).all()):
        bad = a[~(np.isfinite(a) & (a > 0))][:3]
        raise ValueError(f"{name} must be finite and > 0 for a log-space fit; got {bad.tolist()}")
    return a


def _same_length(**arrays: np.ndarray) -> None:
    lens = {k: len(v) for k, v in arrays.items()}
    if len(set(lens.values())) != 1:
        raise ValueError(f"arrays of different lengths: {lens}")


@dataclass
class Fit:
    """A fitted law: ``params`` by name, ``predict(*x)``, and bootstrap intervals once computed."""

    form: str
    params: dict[str, float]
    predict: Callable[..., np.ndarray] = field(repr=False)
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)
    samples: np.ndarray | None = field(
        default=None, repr=False
    )  # (n_boot, n_params) bootstrap refits

    def __str__(self) -> str:
        parts = []
        for k, v in self.params.items():
            lo_hi = self.ci.get(k)
            parts.append(f"{k}={v:.4g}" + (f" [{lo_hi[0]:.4g}, {lo_hi[1]:.4g}]" if lo_hi else ""))
        return f"{self.form}: " + ", ".join(parts)


# ---- y = a·x^b (a line in log-log space) -----------------------------------------------------------
def fit_power_law(x, y, method: str = "qr") -> Fit:
    """y = a·x^b by linear least squares on (log x, log y); CS336 notes's data law c·n^−α has b = −α."""
    x, y = _positive("x", x), _positive("y", y)
    _same_length(x=x, y=y)
    log_a, b = linear_fit(np.log(x), np.log(y), method)
    with np.errstate(
        over="ignore"
    ):  # a bootstrap resample's degenerate line may give a = inf; b still counts
        a = float(np.exp(log_a))
    return Fit("y = a*x^b", {"a": a, "b": b}, lambda q: a * np.asarray(q, dtype=np.float64) ** b)


def fit_lr_law(C, lr) -> Fit:
    """Book of LLMs §3.2 “compute-LR and compute-loss fits”: LR(C) = β·C^−α  ⇔  log LR = log β − α log C (the closed-form line fit)."""
    p = fit_power_law(C, lr)
    beta, alpha = p.params["a"], -p.params["b"]
    return Fit(
        "LR(C) = beta*C^-alpha",
        {"beta": beta, "alpha": alpha},
        lambda c: beta * np.asarray(c, dtype=np.float64) ** -alpha,
    )


# ---- L(x) = L∞ + β·x^−α ----------------------------------------------------------------------------
def offset_power_law(x, L_inf: float, beta: float, alpha: float) -> np.ndarray:
    return L_inf + beta * np.asarray(x, dtype=np.float64) ** -alpha


def fit_offset_power_law(
    x, y, starts: np.ndarray | None = None, delta: float = HUBER_DELTA, top_k: int | None = 8
) -> Fit:
    """L(x) = L∞ + β·x^−α, fitted as log L = LSE(log L∞, log β − α log x) with a Huber loss.

    Book of LLMs §3.2 “compute-LR and compute-loss fits”'s L(C); parameters θ = (e, b, α) with L∞ = eᵉ, β = eᵇ, searched from a grid of starts.
    """
    x, y = _positive("x", x), _positive("y", y)
    _same_length(x=x, y=y)
    lx, ly = np.log(x), np.log(y)

    def residuals(theta):
        e, b, alpha = theta
        lse, w = _lse_softmax(np.stack([np.full_like(lx, e), b - alpha * lx]))  # (2, n)
        r = lse - ly
        return r, np.column_stack([w[0], w[1], -w[1] * lx])

    if starts is None:
        lo = float(np.log(y.min()))
        starts = grid([lo - 2, lo - 0.5, lo - 0.05], [0.0, 5.0, 10.0, 20.0], [0.05, 0.2, 0.5, 1.0])
    res = robust_fit(
        residuals, starts, delta, bounds=[(None, None), (None, None), (0.0, 5.0)], top_k=top_k
    )
    e, b, alpha = res.params
    p = {"L_inf": float(np.exp(e)), "beta": float(np.exp(b)), "alpha": float(alpha)}
    return Fit("L = L_inf + beta*x^-alpha", p, lambda q: offset_power_law(q, **p))


def fit_loss_law(C, L, **kw) -> Fit:
    """Book of LLMs §3.2 “compute-LR and compute-loss fits”: L(C) = L∞ + β·C^−α (the irreducible term keeps L from reaching 0 as C → ∞)."""
    f = fit_offset_power_law(C, L, **kw)
    f.form = "L(C) = L_inf + beta*C^-alpha"
    return f


# ---- L(N, D) = E + A/N^α + B/D^β ---------------------------------------------------------------------
def chinchilla_loss(N, D, E: float, A: float, B: float, alpha: float, beta: float) -> np.ndarray:
    """Hoffmann et al. 2022 eq. 2: irreducible loss + finite-model term + finite-data term."""
    return (
        E
        + A / np.asarray(N, dtype=np.float64) ** alpha
        + B / np.asarray(D, dtype=np.float64) ** beta
    )


def hoffmann_grid() -> np.ndarray:
    """The grid of starts of Hoffmann et al. 2022 (appendix D.2): α, β ∈ {0, 0.5, …, 2},
    e ∈ {−1, −0.5, …, 1}, a, b ∈ {0, 5, …, 25} (4 500 starts; columns a, b, e, α, β)."""
    ab = np.arange(0, 26, 5.0)
    return grid(ab, ab, np.arange(-1, 1.01, 0.5), np.arange(0, 2.01, 0.5), np.arange(0, 2.01, 0.5))


def fit_chinchilla(
    N,
    D,
    L,
    starts: np.ndarray | None = None,
    delta: float = HUBER_DELTA,
    top_k: int | None = 24,
    return_objective: bool = False,
) -> Fit | tuple[Fit, float]:
    """Chinchilla's approach 3 fit: minimise Σ Huber_δ(LSE(a − α log N, b − β log D, e) − log L)
    over θ = (a, b, e, α, β) with L-BFGS from a grid of starts; A = eᵃ, B = eᵇ, E = eᵉ.

    ``starts`` default to Hoffmann's grid; L-BFGS runs from the ``top_k`` starts with the lowest
    objective (None: from all 4 500, as the paper did; same optimum on the tests' data, 100× slower).
    ``return_objective``: also return the Huber objective at the optimum (to compare fits of one data set)."""
    N, D, L = _positive("N", N), _positive("D", D), _positive("loss", L)
    _same_length(N=N, D=D, loss=L)
    if len(L) < 5:
        raise ValueError(f"L(N, D) has 5 parameters; {len(L)} runs cannot determine them")
    lN, lD, lL = np.log(N), np.log(D), np.log(L)

    def residuals(theta):
        a, b, e, alpha, beta = theta
        lse, w = _lse_softmax(
            np.stack([a - alpha * lN, b - beta * lD, np.full_like(lN, e)])
        )  # (3, n)
        r = lse - lL
        return r, np.column_stack([w[0], w[1], w[2], -w[0] * lN, -w[1] * lD])

    res = robust_fit(
        residuals,
        hoffmann_grid() if starts is None else starts,
        delta,
        bounds=[(None, None), (None, None), (None, None), (0.0, 3.0), (0.0, 3.0)],
        top_k=top_k,
    )
    a, b, e, alpha, beta = res.params
    p = {
        "E": float(np.exp(e)),
        "A": float(np.exp(a)),
        "B": float(np.exp(b)),
        "alpha": float(alpha),
        "beta": float(beta),
    }
    fit = Fit("L(N,D) = E + A/N^alpha + B/D^beta", p, lambda n, d: chinchilla_loss(n, d, **p))
    return (fit, res.objective) if return_objective else fit


# ---- data-constrained: repeated epochs (Muennighoff et al. 2023) -------------------------------------
R_STAR_D = 15.4  # Muennighoff et al. 2023 fit: repeated tokens lose value with a 1/e "half-life" of ~15 repeats


def effective_data(D, U, r_star: float = R_STAR_D) -> np.ndarray:
    """D' = U + U·R*·(1 − exp(−R/R*)) with R = D/U − 1 repeats of the U unique tokens (R ≤ 0: D' = D).

    Each extra epoch is worth a little less than the last; for R ≪ R* D' ≈ D (CS336 notes: up to ~4
    epochs repeated data is about as good as fresh), and D' never exceeds U·(1 + R*)."""
    D, U = np.asarray(D, dtype=np.float64), np.asarray(U, dtype=np.float64)
    R = np.maximum(D / U - 1.0, 0.0)
    return np.where(D <= U, D, U + U * r_star * (1.0 - np.exp(-R / r_star)))


def data_constrained_loss(N, D, U, E, A, B, alpha, beta, r_star: float = R_STAR_D) -> np.ndarray:
    """L(N, D, U) = E + A/N^α + B/D'^β with D' = ``effective_data(D, U, R*)``."""
    return chinchilla_loss(N, effective_data(D, U, r_star), E, A, B, alpha, beta)


def fit_data_constrained(N, D, U, L, law: dict[str, float], delta: float = HUBER_DELTA) -> Fit:
    """Fit R*_D of ``data_constrained_loss`` given the fresh-data law (E, A, B, α, β) — the order
    Muennighoff et al. use: fit L(N, D) on single-epoch runs, then the repeat decay on repeated runs."""
    N, D, U, L = (_positive(k, v) for k, v in (("N", N), ("D", D), ("U", U), ("loss", L)))
    _same_length(N=N, D=D, U=U, loss=L)
    lL = np.log(L)

    def residuals(theta):
        r = np.log(data_constrained_loss(N, D, U, r_star=float(np.exp(theta[0])), **law)) - lL
        h = 1e-6
        r2 = np.log(data_constrained_loss(N, D, U, r_star=float(np.exp(theta[0] + h)), **law)) - lL
        return r, ((r2 - r) / h)[:, None]

    res = robust_fit(
        residuals, [[np.log(s)] for s in (1.0, 5.0, 20.0, 100.0)], delta, bounds=[(-5.0, 10.0)]
    )
    r_star = float(np.exp(res.params[0]))
    return Fit(
        "L = E + A/N^alpha + B/D'^beta, D' = U + U*R*(1-exp(-R/R*))",
        {"r_star": r_star},
        lambda n, d, u: data_constrained_loss(n, d, u, r_star=r_star, **law),
    )


R_STAR_GRID = tuple(
    float(v) for v in np.geomspace(0.5, 1000.0, 12)
)  # the profile of fit_chinchilla_repeated


def fit_chinchilla_repeated(
    N,
    D,
    U,
    L,
    r_star: float | None = R_STAR_D,
    starts: np.ndarray | None = None,
    delta: float = HUBER_DELTA,
    top_k: int | None = 24,
    r_star_grid: tuple[float, ...] = R_STAR_GRID,
) -> Fit:
    """Approach 3 on runs that repeat their data: L = E + A/N^α + B/D'^β with D' = ``effective_data(D, U, R*)``.

    ``r_star``: Muennighoff et al.'s R*_D = 15.4 by default (a published constant, no extra parameter), or
    None to fit it as well — by profiling: ``fit_chinchilla`` on (N, D', L) from ``starts`` (default the
    whole grid; warm starts from a neighbouring R* fall into the E → 0 branch) for each R* of
    ``r_star_grid``, then a bounded 1-D search of ln R* between the best grid point's neighbours.
    Params: E, A, B, α, β, r_star (``data_constrained_loss(N, D, U, **params)``)."""
    N, D, U, L = (
        _positive(k, v) for k, v in (("N", N), ("D", D), ("unique tokens U", U), ("loss", L))
    )
    if len(U) == 1:
        U = np.full_like(D, U[0])
    _same_length(N=N, D=D, U=U, loss=L)
    if r_star is not None:
        fit = fit_chinchilla(
            N, effective_data(D, U, r_star), L, starts=starts, delta=delta, top_k=top_k
        )
        best_r = float(r_star)
    else:

        def profile(r, s=starts):
            return fit_chinchilla(
                N,
                effective_data(D, U, r),
                L,
                starts=s,
                delta=delta,
                top_k=top_k,
                return_objective=True,
            )

        grid_fits = [profile(r) for r in r_star_grid]
        k = int(np.argmin([f[1] for f in grid_fits]))
        fit, obj = grid_fits[k]
        best_r = r_star_grid[k]
        lo, hi = (
            np.log(r_star_grid[max(k - 1, 0)]),
            np.log(r_star_grid[min(k + 1, len(r_star_grid) - 1)]),
        )
        if hi > lo:
            p0 = fit.params
            warm = [[np.log(p0["A"]), np.log(p0["B"]), np.log(p0["E"]), p0["alpha"], p0["beta"]]]
            if starts is not None:
                warm = np.vstack([warm, np.atleast_2d(starts)])
            s = optimize.minimize_scalar(
                lambda x: profile(float(np.exp(x)), warm)[1],
                bounds=(lo, hi),
                method="bounded",
                options={"xatol": 0.02},
            )
            f2, obj2 = profile(float(np.exp(s.x)), warm)
            if obj2 < obj:
                fit, best_r = f2, float(np.exp(s.x))
    p = {**fit.params, "r_star": best_r}
    return Fit(
        "L(N,D) = E + A/N^alpha + B/D'^beta, D' = U + U*R*(1-exp(-R/R*)), R = D/U - 1",
        p,
        lambda n, d, u=U: data_constrained_loss(n, d, u, **p),
    )


# ---- uncertainty -----------------------------------------------------------------------------------
def bootstrap(
    fit: Fit,
    refit: Callable[[np.ndarray], Fit],
    n: int,
    n_boot: int = 200,
    level: float = 0.9,
    seed: int = 0,
) -> Fit:
    """Resample the n observations with replacement ``n_boot`` times, refit each (``refit(idx)``), and
    attach the percentile intervals at ``level`` and the refits' parameters to ``fit``."""
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} must be in (0, 1)")
    rng = np.random.default_rng(seed)
    names = list(fit.params)
    rows = []
    for _ in range(n_boot):
        idx = rng.integers(0, n, n)
        try:
            rows.append([refit(idx).params[k] for k in names])
        except ValueError:  # a resample that cannot determine the law (e.g. too few distinct x)
            continue
    if len(rows) < max(10, n_boot // 2):
        raise ValueError(
            f"only {len(rows)} of {n_boot} bootstrap refits succeeded; too few runs to bound the fit"
        )
    fit.samples = np.asarray(rows)
    q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
    fit.ci = {
        k: tuple(float(v) for v in np.percentile(fit.samples[:, i], q)) for i, k in enumerate(names)
    }
    return fit


def prediction_interval(
    fit: Fit, make_predict: Callable[[dict[str, float]], float], level: float = 0.9
) -> tuple[float, float]:
    """Percentile interval of an extrapolated quantity over the bootstrap refits of ``fit``."""
    if fit.samples is None:
        raise ValueError("run bootstrap() on the fit first")
    names = list(fit.params)
    vals = np.array([make_predict(dict(zip(names, row))) for row in fit.samples])
    vals = vals[np.isfinite(vals)]
    q = np.percentile(vals, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return float(q[0]), float(q[1])


def bootstrap_chinchilla(
    fit: Fit,
    N,
    D,
    L,
    n_boot: int = 100,
    level: float = 0.9,
    seed: int = 0,
    U=None,
    fit_r_star: bool = False,
) -> Fit:
    """Bootstrap ``fit_chinchilla`` (or, with ``U``, ``fit_chinchilla_repeated`` at the fit's R*; with
    ``fit_r_star`` R* is profiled again in every refit): each refit starts from the full-data optimum."""
    N, D, L = (np.asarray(v, dtype=np.float64) for v in (N, D, L))
    p = fit.params
    start = [[np.log(p["A"]), np.log(p["B"]), np.log(p["E"]), p["alpha"], p["beta"]]]
    if U is None:
        return bootstrap(
            fit,
            lambda i: fit_chinchilla(N[i], D[i], L[i], starts=start),
            len(L),
            n_boot,
            level,
            seed,
        )
    U = np.broadcast_to(np.asarray(U, dtype=np.float64), D.shape)
    r_star = None if fit_r_star else p["r_star"]
    return bootstrap(
        fit,
        lambda i: fit_chinchilla_repeated(N[i], D[i], U[i], L[i], r_star=r_star, starts=start),
        len(L),
        n_boot,
        level,
        seed,
    )
