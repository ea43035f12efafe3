"""Reward functions for verifiable tasks, and their weighted combination (TRL GRPOTrainer's ``reward_funcs``
with ``reward_weights``; DeepSeek-R1's accuracy + format rewards).

A reward function is ``f(problem, completion) -> float``. ``score`` runs several on a batch: a function that
raises, or returns NaN/±inf or a non-number, gives that sample 0 for that function and is counted (per
function, in ``RewardResult.failures``) — one bad sample never stops a run.

- ``format_reward``: 1 when the completion is ``[<think>…</think>] <answer>…</answer>`` and nothing else.
- ``correctness_reward``: 1 when the task's exact verifier accepts the text of the last ``<answer>`` block.
- ``numeric_equal`` / ``symbolic_equal``: numbers within a tolerance; math expressions through math-verify
  (Hugging Face's ``parse`` + ``verify``, which simplifies with sympy: ``\\frac{1}{2}`` = ``0.5``, ``(x+1)^2`` =
  ``x^2+2x+1``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lmstack.align.tasks import Problem, get_task

RewardFn = Callable[[Problem, str], float]

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
STRICT_FORMAT = re.compile(r"^\s*(<think>.*?</think>\s*)?<answer>.*?</answer>\s*$", re.DOTALL)


def extract_answer(completion: str) -> str | None:
    """The text of the last ``<answer>…</answer>`` block, or None."""
    found = ANSWER.findall(completion)
    return found[-1].strip() if found else None


def format_reward(problem: Problem, completion: str) -> float:
    """1.0 when the completion is an optional <think> block then one <answer> block, else 0.0."""
    return 1.0 if STRICT_FORMAT.match(completion) and completion.count("<answer>") == 1 else 0.0


def correctness_reward(problem: Problem, completion: str) -> float:
    """1.0 when the problem's task verifier accepts the extracted answer, else 0.0."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    return 1.0 if get_task(problem.task).check(problem, answer) else 0.0


def numeric_equal(a: str, b: str, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Both strings are numbers (commas dropped, a trailing % is read as /100) and equal within tolerance."""

    def num(s: str) -> float:
        s = s.strip().replace(",", "")
        return float(s[:-1]) / 100 if s.endswith("%") else float(s)

    try:
        return math.isclose(num(a), num(b), rel_tol=rel_tol, abs_tol=abs_tol)
    except ValueError:
        return False


def symbolic_equal(a: str, b: str) -> bool:
    """Mathematical equality via math-verify (LaTeX or plain; sympy underneath). False when either side does
    not parse."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError(
            "symbolic equality needs math-verify: pip install 'lmstack[align]'"
        ) from None

    def p(s: str):
        s = s.strip()
        return parse(
            s if s.startswith("$") else f"${s}$"
        )  # math mode: LaTeX and plain expressions alike

    try:
        x, y = p(a), p(b)
        return bool(x) and bool(y) and bool(verify(x, y))
    except Exception:  # noqa: BLE001 — an expression math-verify cannot handle is simply not equal
        return False


def math_reward(problem: Problem, completion: str) -> float:
    """1.0 when the extracted answer equals ``problem.answer`` numerically or symbolically."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    return (
        1.0
        if numeric_equal(answer, problem.answer) or symbolic_equal(answer, problem.answer)
        else 0.0
    )


REWARDS: dict[str, RewardFn] = {
    "format": format_reward,
    "correct": correctness_reward,
    "math": math_reward,
}


@dataclass
class RewardResult:
    """``total`` (N,) weighted sums; ``per_fn`` name -> (N,) values; ``failures`` name -> count of samples
    where that function raised or returned a non-finite value (scored 0); ``errors`` the first message each."""

    total: list[float]
    per_fn: dict[str, list[float]]
    failures: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def score(
    problems: Sequence[Problem],
    completions: Sequence[str],
    functions: dict[str, RewardFn] | Sequence[str],
    weights: dict[str, float] | None = None,
) -> RewardResult:
    """Every reward function on every (problem, completion); total = Σ_f w_f · r_f (weights default 1)."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems for {len(completions)} completions")
    if not isinstance(functions, dict):
        unknown = [f for f in functions if f not in REWARDS]
        if unknown:
            raise ValueError(f"reward {unknown[0]!r}; expected names from {sorted(REWARDS)}")
        functions = {f: REWARDS[f] for f in functions}
    if not functions:
        raise ValueError("no reward functions given")
    weights = weights or {}
    extra = set(weights) - set(functions)
    if extra:
        raise ValueError(
            f"weights for {sorted(extra)}, which are not among the rewards {sorted(functions)}"
        )
    per_fn: dict[str, list[float]] = {}
    failures = {name: 0 for name in functions}
    errors: dict[str, str] = {}
    for name, fn in functions.items():
        values = []
        for i, (p, c) in enumerate(zip(problems, completions)):
            try:
                v = fn(p, c)
                v = float(v)
                if not math.isfinite(v):
                    raise ValueError(f"returned {v}")
            except Exception as e:  # noqa: BLE001 — a failing reward scores 0 and is counted, the run goes on
                failures[name] += 1
                errors.setdefault(name, f"sample {i}: {type(e).__name__}: {e}")
                v = 0.0
            values.append(v)
        per_fn[name] = values
    total = [
        sum(weights.get(n, 1.0) * per_fn[n][i] for n in functions) for i in range(len(completions))
    ]
    return RewardResult(total, per_fn, failures, errors)
