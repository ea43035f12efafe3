"""Verifiable tasks and rewards: seeded, disjoint splits, exact verifiers checked against Python's own
arithmetic / str methods / json, math-verify for symbolic answers, failing rewards counted as 0."""

import json
import math

import pytest

from lmstack.align.rewards import (
    correctness_reward,
    extract_answer,
    format_reward,
    math_reward,
    numeric_equal,
    score,
    symbolic_equal,
)
from lmstack.align.tasks import TASKS, Countdown, Problem, evaluate, get_task


@pytest.mark.parametrize("name", sorted(TASKS))
def test_generation_is_seeded_and_splits_are_disjoint(name):
    task = get_task(name)
    a = task.generate(50, seed=3)
    assert [p.prompt for p in a] == [p.prompt for p in get_task(name).generate(50, seed=3)]
    assert [p.prompt for p in a] != [p.prompt for p in task.generate(50, seed=4)]
    test = {p.prompt for p in task.generate(20, seed=0, split="test")}
    train = {p.prompt for s in range(3) for p in task.generate(50, seed=s)}
    assert not test & train
    for (
        p
    ) in a:  # the worked solution is accepted by the task's own verifier through the reward path
        assert correctness_reward(p, task.solution(p)) == 1.0
        assert format_reward(p, f"<answer>{p.answer}</answer>") == 1.0


def test_arithmetic_answers_are_python_arithmetic():
    for p in get_task("arithmetic", digits=3).generate(30):
        a, b, op = p.data["a"], p.data["b"], p.data["op"]
        assert int(p.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert f"{a} {op} {b}" in p.prompt
        assert not get_task("arithmetic").check(p, str(int(p.answer) + 1))
        assert get_task("arithmetic").check(p, f" {p.answer} ")


def test_countdown_verifier():
    p = Problem("countdown", "", "(3 + 5) * 2", {"numbers": [3, 5, 2], "target": 16})
    task = Countdown()
    assert task.check(p, "(5 + 3) * 2") and task.check(p, "2*(3+5)")
    assert not task.check(p, "(3 + 5) * 2 + 0")  # a number that is not given
    assert not task.check(p, "(3 + 5) * 2 * 1")
    assert not task.check(p, "8 * 2")  # does not use the given numbers
    assert not task.check(p, "(3 + 5) + 2")  # wrong value
    assert not task.check(p, "__import__('os')")  # no names or calls are ever evaluated
    assert (
        evaluate("7 / 2") == 3.5 and evaluate("1 / (2 - 2)") is None and evaluate("2 ** 3") is None
    )
    for q in Countdown(n_numbers=4).generate(30):  # every generated target is reachable
        assert sorted(q.data["numbers"]) == sorted(
            int(t) for t in q.answer.replace("(", " ").replace(")", " ").split() if t.isdigit()
        )
        assert eval(q.answer) == pytest.approx(
            q.data["target"]
        )  # Python's own evaluation of the expression


def test_strings_and_format_tasks_against_python():
    for p in get_task("strings").generate(30):
        w = p.data["word"]
        assert p.answer == (
            w[::-1] if p.data["kind"] == "reverse" else str(w.count(p.data["letter"]))
        )
    fmt = get_task("format")
    for p in fmt.generate(30):
        if p.data["kind"] == "json":
            assert fmt.check(
                p, json.dumps({"n": p.data["n"], "word": p.data["word"]})
            )  # key order is free
            assert not fmt.check(p, "{word: 1}")
        else:
            assert not fmt.check(p, p.answer.lower() + "x")


def test_format_reward_and_extraction():
    p = Problem("arithmetic", "", "5", {"a": 2, "b": 3, "op": "+"})
    assert format_reward(p, "<think>2+3</think> <answer>5</answer>") == 1.0
    assert format_reward(p, "<answer>5</answer>\n") == 1.0
    assert format_reward(p, "so <answer>5</answer>") == 0.0
    assert format_reward(p, "<answer>5</answer><answer>6</answer>") == 0.0
    assert extract_answer("a <answer>1</answer> b <answer> 2 </answer>") == "2"
    assert correctness_reward(p, "<answer>6</answer>") == 0.0 and correctness_reward(p, "5") == 0.0


def test_numeric_and_symbolic_equality():
    assert (
        numeric_equal("1,000", "1000")
        and numeric_equal("50%", "0.5")
        and not numeric_equal("0.5", "0.51")
    )
    assert not numeric_equal("x", "1")
    assert symbolic_equal("\\frac{1}{2}", "0.5")
    assert symbolic_equal("(x+1)^2", "x^2+2x+1")
    assert not symbolic_equal("x^2", "x^3")
    p = Problem("math", "", "\\frac{3}{4}")
    assert (
        math_reward(p, "<answer>0.75</answer>") == 1.0
        and math_reward(p, "<answer>3/5</answer>") == 0.0
    )


def test_weighted_rewards_and_failures_count_as_zero():
    p = Problem("arithmetic", "", "5", {"a": 2, "b": 3, "op": "+"})

    def raises(problem, completion):
        raise RuntimeError("boom")

    def nan(problem, completion):
        return math.nan if "5" in completion else 1.0

    res = score(
        [p, p],
        ["<answer>5</answer>", "nope"],
        {"format": format_reward, "correct": correctness_reward, "raises": raises, "nan": nan},
        weights={"format": 0.5, "correct": 2.0},
    )
    assert res.total == [0.5 + 2.0 + 0 + 0, 0 + 0 + 0 + 1.0]
    assert res.failures == {"format": 0, "correct": 0, "raises": 2, "nan": 1}
    assert "RuntimeError: boom" in res.errors["raises"] and "nan" in res.errors["nan"]
    with pytest.raises(ValueError, match="weights for \\['typo'\\]"):
        score([p], ["x"], ["format"], weights={"typo": 1.0})
