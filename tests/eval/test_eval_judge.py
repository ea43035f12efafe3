"""Pairwise judging: position swapping turns a position-biased judge's verdicts into ties, a judge that
reads the answers gives wins; the battles feed the arena code."""

import pytest

from lmstack.eval.arena import read_battles
from lmstack.eval.judge import (
    TEMPLATE,
    battles,
    prefers_first,
    read_questions,
    verdict,
    write_battles,
)


class StubJudge:
    """A judge with known behaviour: log-likelihoods from a rule on the rendered prompt."""

    def __init__(self, rule):
        self.rule = rule
        self.seen = []

    def loglikelihood(self, pairs):
        self.seen += pairs
        return [(self.rule(ctx, cont), False) for ctx, cont in pairs]


def answer_of(ctx, letter):
    return ctx.split(f"Answer {letter}: ")[1].split("\n\n")[0]


def quality_rule(ctx, cont):  # prefers the answer with more "good"
    return float(answer_of(ctx, cont.strip()).count("good"))


def test_position_bias_becomes_ties():
    always_a = StubJudge(lambda ctx, cont: 1.0 if cont == " A" else 0.0)
    assert verdict(always_a, "q", "good good", "bad") == "tie"
    assert len(always_a.seen) == 4  # both options, both orders
    assert always_a.seen[0][0] == TEMPLATE.format(question="q", a="good good", b="bad")


def test_quality_judge_gives_wins_both_ways():
    judge = StubJudge(quality_rule)
    assert verdict(judge, "q", "good good", "good") == "model_a"
    assert verdict(judge, "q", "meh", "good") == "model_b"
    assert verdict(judge, "q", "same", "same") == "tie"  # equal scores: " A" never strictly wins


def test_battles_feed_the_arena(tmp_path):
    answers = {
        "strong": ["good good good"] * 3,
        "mid": ["good", "good good", "x"],
        "weak": ["no"] * 3,
    }
    rows = battles(answers, ["q1", "q2", "q3"], StubJudge(quality_rule), progress=False)
    assert len(rows) == 9
    p = tmp_path / "b.jsonl"
    write_battles(p, rows)
    b = read_battles(p)
    assert b.models == ["strong", "mid", "weak"] and len(b.score) == 9
    wins = {(r["model_a"], r["model_b"], r["question"]): r["winner"] for r in rows}
    assert wins[("strong", "weak", 0)] == "model_a" and wins[("mid", "weak", 2)] == "tie"


def test_real_judge_matches_its_loglikelihoods(lm):
    from lmstack.eval.runner import Evaluator

    ev = Evaluator(*lm)
    ctx = TEMPLATE.format(question="where is the cat?", a="at the hat", b="the theatre")
    (la, _), (lb, _) = ev.loglikelihood([(ctx, " A"), (ctx, " B")])
    assert prefers_first(ev, "where is the cat?", "at the hat", "the theatre") == (la > lb)


def test_questions_file_errors(tmp_path):
    from lmstack.eval.tasks import TaskError

    p = tmp_path / "q.jsonl"
    p.write_text('{"prompt": "hi"}\n{"text": "x"}\n')
    with pytest.raises(TaskError, match=r"q\.jsonl:2: missing field 'prompt'"):
        read_questions(p)
