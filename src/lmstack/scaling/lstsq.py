"""Least squares, the two ways Book of LLMs §3.3 “least squares” names: the linear closed form and the nonlinear iteration.

- ``normal_equations(X, y)``: β = (XᵀX)⁻¹Xᵀy, solved with a Cholesky factorisation of XᵀX (never an
  explicit inverse). Squaring X squares its condition number, so ``qr_lstsq`` is the path to use when
  the columns are nearly collinear (e.g. log N and log C over a narrow range): X = QR, β = R⁻¹Qᵀy.
- ``robust_fit(...)``: a nonlinear fit minimising Σ Huber_δ(r_i) of residuals r_i computed in log
  space, with L-BFGS-B started from every point of a grid of starts and the best end point kept —
  the recipe of Chinchilla's approach 3 (Hoffmann et al. 2022, δ = 1e-3) and of its replication
  (Besiroglu et al. 2024). The caller supplies residuals and their Jacobian, so each start is cheap.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import linalg, optimize
from threadpoolctl import threadpool_limits


def _design(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if X.ndim == 1:
        X = X[:, None]
    if X.ndim != 2 or y.ndim != 1 or X.shape[0] != y.shape[0]:
        raise ValueError(f"X has shape {X.shape} and y {y.shape}; expected X (n, k) and y (n,)")
    if X.shape[0] < X.shape[1]:
        raise ValueError(f"{X.shape[0]} observations cannot determine {X.shape[1]} coefficients")
    if not (np.isfinite(X).all() and np.isfinite(y).all()):
        raise ValueError("X and y must be finite (a log of a non-positive value?)")
    return X, y


def normal_equations(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """β minimising ‖y − Xβ‖² from the normal equations XᵀXβ = Xᵀy (Cholesky; Book of LLMs §3.3 “least squares”)."""
    X, y = _design(X, y)
    gram = X.T @ X
    try:
        c = linalg.cho_factor(gram)
    except linalg.LinAlgError:
        raise ValueError("XᵀX is singular: the columns of X are linearly dependent") from None
    return linalg.cho_solve(c, X.T @ y)


def qr_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """β minimising ‖y − Xβ‖² through the QR factorisation X = QR (condition number of X, not of XᵀX)."""
    X, y = _design(X, y)
    q, r = np.linalg.qr(X, mode="reduced")
    if np.min(np.abs(np.diag(r))) <= 1e-12 * np.max(np.abs(np.diag(r))):
        raise ValueError("X is rank deficient: the columns of X are linearly dependent")
    return linalg.solve_triangular(r, q.T @ y)


def linear_fit(x: np.ndarray, y: np.ndarray, method: str = "qr") -> tuple[float, float]:
    """(intercept, slope) of the straight line y ≈ intercept + slope·x."""
    X = np.column_stack([np.ones(len(np.asarray(x))), np.asarray(x, dtype=np.float64)])
    solver = {"qr": qr_lstsq, "normal": normal_equations}.get(method)
    if solver is None:
        raise ValueError(f"method={method!r}; expected 'qr' or 'normal'")
    b = solver(X, y)
    return float(b[0]), float(b[1])


def huber(r: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss of residuals ``r`` and its derivative: r²/2 for |r| ≤ δ, δ(|r| − δ/2) beyond."""
    a = np.abs(r)
    small = a <= delta
    loss = np.where(small, 0.5 * r * r, delta * (a - 0.5 * delta))
    grad = np.where(small, r, delta * np.sign(r))
    return loss, grad


@dataclass
class RobustFit:
    params: np.ndarray  # the best end point over all starts
    objective: float  # Σ Huber(r) there
    n_starts: int
    n_converged: int


def robust_fit(
    residuals: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
    starts: Sequence[Sequence[float]] | np.ndarray,
    delta: float = 1e-3,
    bounds: Sequence[tuple[float | None, float | None]] | None = None,
    maxiter: int = 2000,
    top_k: int | None = None,
) -> RobustFit:
    """Minimise Σ_i Huber_δ(r_i(θ)) with L-BFGS-B from each start; keep the lowest.

    ``residuals(θ) -> (r (n,), J (n, p))`` returns the log-space residuals and their Jacobian.
    ``top_k``: evaluate the objective at every start and run L-BFGS only from the ``top_k`` best
    (a large grid costs one objective evaluation per start; None runs from all of them).
    """
    starts = np.atleast_2d(np.asarray(starts, dtype=np.float64))

    def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
        r, jac = residuals(theta)
        loss, g = huber(r, delta)
        return float(loss.sum()), jac.T @ g

    if top_k is not None and top_k < len(starts):
        with np.errstate(all="ignore"):
            values = np.array([objective(x0)[0] for x0 in starts])
        values[~np.isfinite(values)] = np.inf
        starts = starts[np.argsort(values, kind="stable")[:top_k]]
    best: tuple[float, np.ndarray] | None = None
    converged = 0
    for x0 in starts:
        # a few parameters: BLAS threads only add wake-up costs (100x slower on a loaded machine)
        with threadpool_limits(1, user_api="blas"):
            res = optimize.minimize(
                objective,
                x0,
                jac=True,
                method="L-BFGS-B",
                bounds=bounds,
                options={"maxiter": maxiter, "ftol": 1e-13, "gtol": 1e-9},
            )
        if not np.isfinite(res.fun):
            continue
        converged += bool(res.success)
        if best is None or res.fun < best[0]:
            best = (float(res.fun), res.x)
    if best is None:
        raise ValueError("the nonlinear fit failed from every start (non-finite objective)")
    return RobustFit(best[1], best[0], len(starts), converged)


def grid(*axes: Sequence[float]) -> np.ndarray:
    """The Cartesian product of the axes, one start per row."""
    return np.array(list(itertools.product(*axes)), dtype=np.float64)
