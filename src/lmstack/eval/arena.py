"""Arena ratings from pairwise battles (CS336 notes "基准测试": Chatbot Arena rates models from human
pairwise votes "like chess").

A battles file is JSONL, one battle a line: ``{"model_a": str, "model_b": str, "winner": w}`` with
``w`` one of ``model_a``, ``model_b``, ``tie``, ``tie (bothbad)`` (Chatbot Arena's own values).

- **Online Elo**: battles in file order, ``R_a += K (S_a - E_a)`` with ``E_a = 1 / (1 + 10^((R_b - R_a)/400))``,
  a tie scoring 0.5; order-dependent by construction.
- **Bradley–Terry**: the maximum-likelihood fit of ``P(a beats b) = σ(β_a - β_b)`` over all battles at
  once (logistic regression without intercept; a tie counts as half a win each way), solved by
  Newton's method (IRLS) with a tiny ridge that pins the otherwise free shift, then reported on the
  Elo scale ``1000 + 400/ln 10 · (β - mean β)``. Order-independent.
- **Confidence intervals**: battles resampled with replacement, the fit repeated, percentile intervals.
- **When the MLE does not exist** (Zermelo 1929, Ford 1957: it is finite iff, for every split of the models
  into two groups, each group took a point — a win or a tie — from the other; i.e. the directed "took a point
  from" graph is strongly connected): with *separation* (some group won every battle against the rest) the
  likelihood keeps rising as the gap grows, so the fit uses an N(0, 1) prior on each strength (ridge 1, the L2
  penalty of scikit-learn's default ``LogisticRegression(C=1)``) for the estimate and every resample alike,
  and warns; a *disconnected* comparison graph (groups that never met) is warned about: ratings across
  those groups are not comparable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmstack.utils import pyplot, read_jsonl, save_png

WINNERS = {"model_a": 1.0, "model_b": 0.0, "tie": 0.5, "tie (bothbad)": 0.5}
SCALE, BASE, INIT = 400.0, 10.0, 1000.0


class BattlesError(ValueError):
    """A battles file that cannot be rated: names the file, line and field."""


@dataclass
class Battles:
    models: list[str]
    a: np.ndarray  # (n,) index of model_a
    b: np.ndarray  # (n,) index of model_b
    score: np.ndarray  # (n,) 1 = a won, 0 = b won, 0.5 = tie
    warnings: list[str] = field(default_factory=list)


def read_battles(path) -> Battles:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such battles file")
    names: dict[str, int] = {}
    a, b, s, seen_line = [], [], [], {}
    for n, obj in read_jsonl(path, BattlesError):
        where = f"{path}:{n}"
        for key in ("model_a", "model_b", "winner"):
            if key not in obj:
                raise BattlesError(f"{where}: missing field {key!r}")
            if not isinstance(obj[key], str) or not obj[key]:
                raise BattlesError(
                    f"{where}: field {key!r} = {obj[key]!r:.60} must be a non-empty string"
                )
        if obj["winner"] not in WINNERS:
            raise BattlesError(
                f"{where}: field 'winner' = {obj['winner']!r} must be one of {list(WINNERS)}"
            )
        if obj["model_a"] == obj["model_b"]:
            raise BattlesError(f"{where}: model_a and model_b are both {obj['model_a']!r}")
        for key in ("model_a", "model_b"):
            seen_line.setdefault(obj[key], n)
        a.append(names.setdefault(obj["model_a"], len(names)))
        b.append(names.setdefault(obj["model_b"], len(names)))
        s.append(WINNERS[obj["winner"]])
    if not s:
        raise BattlesError(f"{path}: no battles (empty file)")
    models = list(names)
    counts = np.bincount(np.array(a + b), minlength=len(models))
    warnings = [
        f"{path}:{seen_line[m]}: model {m!r} appears in only one battle (a typo of another name?)"
        for m, c in zip(models, counts)
        if c == 1
    ]
    return Battles(models, np.array(a), np.array(b), np.array(s, dtype=np.float64), warnings)


def online_elo(battles: Battles, k: float = 4.0) -> np.ndarray:
    """Ratings (M,) after one pass over the battles in order."""
    r = np.full(len(battles.models), INIT)
    for i, j, s in zip(battles.a, battles.b, battles.score):
        e = 1.0 / (1.0 + BASE ** ((r[j] - r[i]) / SCALE))
        r[i] += k * (s - e)
        r[j] -= k * (s - e)
    return r


def bt_fit(
    a: np.ndarray,
    b: np.ndarray,
    score: np.ndarray,
    M: int,
    ridge: float = 1e-6,
    iters: int = 100,
    tol: float = 1e-10,
) -> np.ndarray:
    """Bradley–Terry strengths β (M,) (natural-log scale, mean 0) by Newton's method on the ridge-penalised
    log-likelihood Σ [s log σ(β_a - β_b) + (1 - s) log σ(β_b - β_a)] - ridge/2 ||β||²."""
    beta = np.zeros(M)
    n = len(score)
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(beta[a] - beta[b])))  # (n,) P(a beats b)
        r = score - p
        grad = np.bincount(a, r, M) - np.bincount(b, r, M) - ridge * n * beta
        w = p * (1 - p)
        H = np.zeros(
            (M, M)
        )  # the Hessian of the negative log-likelihood: a weighted graph Laplacian
        np.add.at(H, (a, a), w)
        np.add.at(H, (b, b), w)
        np.add.at(H, (a, b), -w)
        np.add.at(H, (b, a), -w)
        H += ridge * n * np.eye(M)
        step = np.linalg.solve(H, grad)
        beta += step
        if np.abs(step).max() < tol:
            break
    return beta - beta.mean()


PRIOR_RIDGE = 1.0  # with separation: an N(0, 1) prior on each strength β (natural-log scale)


def identifiability(battles: Battles) -> tuple[list[str], bool]:
    """(warnings, separated) for the Bradley–Terry fit of ``battles``: a disconnected comparison graph
    (groups of models that never met) and separation (the directed graph "a took a point from b" — a win,
    or a tie both ways — is not strongly connected within a connected group: the MLE is infinite)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    M, names = len(battles.models), np.array(battles.models)
    took = battles.score > 0  # a took a point from b (a win or a tie)
    lost = battles.score < 1  # b took a point from a
    src = np.concatenate([battles.a[took], battles.b[lost]])
    dst = np.concatenate([battles.b[took], battles.a[lost]])
    g = coo_matrix((np.ones(len(src)), (src, dst)), shape=(M, M)).tocsr()
    n_weak, weak = connected_components(g, directed=True, connection="weak")
    n_strong, strong = connected_components(g, directed=True, connection="strong")

    def groups(labels, n):
        return ", ".join("{" + ", ".join(names[labels == k]) + "}" for k in range(n))

    out = []
    if n_weak > 1:
        out.append(
            f"the comparison graph is disconnected: the groups {groups(weak, n_weak)} never met, so "
            "ratings across them are not comparable (only their within-group differences mean anything)"
        )
    separated = n_strong > n_weak
    if separated:
        out.append(
            f"perfect separation: the models split into groups {groups(strong, n_strong)} of which one "
            "won every battle against another (no loss or tie back), so the Bradley–Terry maximum-"
            "likelihood ratings do not exist (those gaps are infinite); the ratings and intervals shown "
            f"are the fit with an N(0, 1) prior on each strength (ridge {PRIOR_RIDGE:g}): gaps between "
            "these groups are set by the prior and the battle counts, a lower bound, not an estimate"
        )
    return out, separated


def to_elo_scale(beta: np.ndarray) -> np.ndarray:
    return INIT + SCALE / math.log(BASE) * beta


@dataclass
class ArenaResult:
    models: list[str]
    elo: np.ndarray
    bt: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    n_battles: int
    warnings: list[str]

    def to_dict(self) -> dict:
        order = np.argsort(-self.bt)
        return {
            "n_battles": self.n_battles,
            "warnings": self.warnings,
            "ratings": [
                {
                    "model": self.models[i],
                    "bradley_terry": float(self.bt[i]),
                    "ci_low": float(self.ci_low[i]),
                    "ci_high": float(self.ci_high[i]),
                    "online_elo": float(self.elo[i]),
                }
                for i in order
            ],
        }

    def table(self) -> str:
        rows = [("rank", "model", "Bradley-Terry", "95% CI", "online Elo")]
        for k, d in enumerate(self.to_dict()["ratings"], 1):
            rows.append(
                (
                    str(k),
                    d["model"],
                    f"{d['bradley_terry']:.1f}",
                    f"[{d['ci_low']:.1f}, {d['ci_high']:.1f}]",
                    f"{d['online_elo']:.1f}",
                )
            )
        w = [max(len(r[i]) for r in rows) for i in range(5)]
        return "\n".join("  ".join(c.ljust(x) for c, x in zip(r, w)).rstrip() for r in rows)


def rate(
    battles: Battles,
    n_bootstrap: int = 200,
    seed: int = 0,
    k: float = 4.0,
    level: float = 0.95,
    progress: bool = True,
) -> ArenaResult:
    """Online Elo, the Bradley–Terry fit and its bootstrap percentile intervals; with separation (no
    finite MLE: ``identifiability``) the fit and every resample use the N(0, 1) prior, and the result's
    warnings say so."""
    from tqdm import tqdm

    M, n = len(battles.models), len(battles.score)
    notes, separated = identifiability(battles)
    ridge = PRIOR_RIDGE / n if separated else 1e-6  # bt_fit's penalty is ridge·n/2·||β||²
    bt = to_elo_scale(bt_fit(battles.a, battles.b, battles.score, M, ridge=ridge))
    rng = np.random.default_rng(seed)
    boots = []
    for _ in tqdm(range(n_bootstrap), desc="bootstrap", disable=not progress):
        idx = rng.integers(0, n, n)
        boots.append(
            to_elo_scale(bt_fit(battles.a[idx], battles.b[idx], battles.score[idx], M, ridge=ridge))
        )
    if boots:
        q = (1 - level) / 2
        lo, hi = np.quantile(np.array(boots), [q, 1 - q], axis=0)
    else:
        lo = hi = np.full(M, np.nan)
    elo = online_elo(battles, k)
    return ArenaResult(battles.models, elo, bt, lo, hi, n, [*battles.warnings, *notes])


def plot_ratings(result: ArenaResult, path) -> None:
    """PNG: Bradley–Terry ratings with their intervals, best first (written atomically)."""
    plt = pyplot()

    order = np.argsort(-result.bt)
    y = result.bt[order]
    err = np.vstack([y - result.ci_low[order], result.ci_high[order] - y])
    fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(order) + 2), 4))
    ax.errorbar(range(len(order)), y, yerr=np.nan_to_num(err), fmt="o", capsize=4)
    ax.set_xticks(range(len(order)), [result.models[i] for i in order], rotation=30, ha="right")
    ax.set_ylabel("Bradley–Terry rating (Elo scale)")
    ax.set_title(f"Arena ratings, {result.n_battles} battles, 95% bootstrap CI")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_png(fig, path, dpi=120)
