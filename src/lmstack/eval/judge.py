"""Pairwise LLM-as-judge battles (CS336 notes "基准测试": judge benchmarks such as AlpacaEval/WildBench, and
their agreement with the Arena): models answer the same prompts, a judge model compares each pair of
answers, and the verdicts are battles for ``arena.rate``.

The judge reads a fixed template (question, "Answer A", "Answer B", "Which answer is better? Answer:") and
its verdict is the option with the larger log-likelihood, `` A`` or `` B``. Every pair is judged twice,
in both positions: a winner must win in both orders; a judge that prefers a position whatever the
answers (position bias) gives a tie instead.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from lmstack.eval.tasks import TaskError, read_jsonl
from lmstack.utils import atomic_write_text

TEMPLATE = (
    "Question: {question}\n\nAnswer A: {a}\n\nAnswer B: {b}\n\n"
    "Which answer is better, A or B? The better answer is"
)


def prefers_first(judge, question: str, a: str, b: str) -> bool:
    """True when the judge's log-likelihood of " A" exceeds that of " B" after the template."""
    ctx = TEMPLATE.format(question=question, a=a.strip(), b=b.strip())
    (la, _), (lb, _) = judge.loglikelihood([(ctx, " A"), (ctx, " B")])
    return la > lb


def verdict(judge, question: str, x: str, y: str) -> str:
    """``model_a`` (x wins in both orders), ``model_b`` (y wins in both) or ``tie`` (the orders disagree)."""
    first = prefers_first(judge, question, x, y)  # x shown as A
    swapped = prefers_first(judge, question, y, x)  # y shown as A
    if first and not swapped:
        return "model_a"
    if not first and swapped:
        return "model_b"
    return "tie"


def battles(
    answers: dict[str, list[str]], questions: list[str], judge, progress: bool = True
) -> list[dict]:
    """Battles between every pair of models on every question; ``answers[model][i]`` answers ``questions[i]``."""
    from tqdm import tqdm

    names = list(answers)
    for m in names:
        if len(answers[m]) != len(questions):
            raise ValueError(
                f"model {m!r} has {len(answers[m])} answers for {len(questions)} questions"
            )
    pairs = list(itertools.combinations(names, 2))
    out = []
    with tqdm(total=len(pairs) * len(questions), desc="judging", disable=not progress) as bar:
        for i, q in enumerate(questions):
            for ma, mb in pairs:
                out.append(
                    {
                        "model_a": ma,
                        "model_b": mb,
                        "question": i,
                        "winner": verdict(judge, q, answers[ma][i], answers[mb][i]),
                    }
                )
                bar.update(1)
    return out


def read_questions(path) -> list[str]:
    """JSONL with a ``prompt`` (or ``question``) string a line; errors name the line."""
    out = []
    for n, obj in read_jsonl(Path(path)):
        q = obj.get("prompt", obj.get("question"))
        if not isinstance(q, str) or not q:
            raise TaskError(f"{path}:{n}: missing field 'prompt' (a non-empty string)")
        out.append(q)
    return out


def write_battles(path, rows: list[dict]) -> None:

    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
