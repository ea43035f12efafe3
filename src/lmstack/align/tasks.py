"""Verifiable tasks for RL with verifiable rewards (RLVR; DeepSeek-R1, Tülu 3): seeded generators whose answers
a program checks exactly, with a held-out split that never meets the training one.

Each ``Task`` makes ``Problem``s (prompt, answer, the data the verifier needs) and a worked ``solution`` text
(for SFT and expert iteration). The split of a problem is a hash of its content (``split_of``), so train and
test are disjoint whatever seeds, sizes or orders are asked for, and a seed gives the same problems every run.

- ``arithmetic``: a ∘ b with ``digits``-digit operands, ∘ ∈ {+, −, ×}.
- ``countdown``: reach N with each of the given numbers once and + − × ÷ (TinyZero's Countdown); the target
  is built from a random expression, so every problem is solvable; the answer is checked by evaluating the
  expression exactly (``fractions.Fraction``) after checking it uses exactly the given numbers.
- ``strings``: reverse a word, or count a letter in it.
- ``format``: follow a required answer format exactly (an upper-cased word, a list of k copies, a JSON object).
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

SPLITS = ("train", "test")
INSTRUCTION = "Put the final answer inside <answer></answer>."


@dataclass
class Problem:
    task: str
    prompt: str
    answer: str
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"task": self.task, "prompt": self.prompt, "answer": self.answer, "data": self.data}


def split_of(key: str, test_fraction: float = 0.1) -> str:
    """'test' for a fixed ``test_fraction`` of problem keys, by their SHA-256 — never depends on the seed."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "test" if h / 2**64 < test_fraction else "train"


class Task:
    """A generator of problems and their exact verifier. Subclasses define ``_draw`` and ``check``."""

    name = "task"

    def generate(
        self,
        n: int,
        seed: int = 0,
        split: str = "train",
        test_fraction: float = 0.1,
        max_tries: int = 100_000,
    ) -> list[Problem]:
        """``n`` distinct problems of ``split``, the same for the same arguments."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; expected one of {SPLITS}")
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        rng = random.Random(f"{self.name}:{seed}:{split}")
        out, seen = [], set()
        for _ in range(max_tries):
            if len(out) == n:
                break
            p = self._draw(rng)
            key = p.prompt
            if key in seen or split_of(key, test_fraction) != split:
                continue
            seen.add(key)
            out.append(p)
        if len(out) < n:
            raise ValueError(
                f"task {self.name!r}: only {len(out)} distinct {split} problems found in {max_tries} "
                f"draws, {n} asked; ask for fewer or a larger problem space"
            )
        return out

    def _draw(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def check(self, problem: Problem, answer: str) -> bool:
        """Whether ``answer`` (the text inside <answer>…</answer>) solves ``problem``; never raises."""
        return answer.strip() == problem.answer

    def solution(self, problem: Problem) -> str:
        """A worked response in the required format."""
        return f"<answer>{problem.answer}</answer>"


def _int_answer(text: str) -> int | None:
    try:
        return int(text.strip().replace(",", ""))
    except ValueError:
        return None


class Arithmetic(Task):
    name = "arithmetic"

    def __init__(self, digits: int = 2, ops: str = "+-*"):
        if digits < 1:
            raise ValueError(f"digits={digits} must be >= 1")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"ops={ops!r} must be a non-empty subset of '+-*'")
        self.digits, self.ops = digits, ops

    def _draw(self, rng):
        lo, hi = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10**self.digits - 1
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(self.ops)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        sym = {"+": "+", "-": "-", "*": "*"}[op]
        return Problem(
            self.name,
            f"What is {a} {sym} {b}? {INSTRUCTION}",
            str(value),
            {"a": a, "b": b, "op": op},
        )

    def check(self, problem, answer):
        return _int_answer(answer) == int(problem.answer)

    def solution(self, problem):
        d = problem.data
        return f"{d['a']} {d['op']} {d['b']} = {problem.answer}. <answer>{problem.answer}</answer>"


class Countdown(Task):
    name = "countdown"

    def __init__(self, n_numbers: int = 3, max_number: int = 20):
        if not 2 <= n_numbers <= 6:
            raise ValueError(f"n_numbers={n_numbers} must be in [2, 6]")
        self.n, self.max_number = n_numbers, max_number

    def _draw(self, rng):
        while True:
            nums = [rng.randint(1, self.max_number) for _ in range(self.n)]
            order = nums[:]
            rng.shuffle(order)
            expr = str(order[0])
            for x in order[1:]:
                op = rng.choice("+-*/")
                expr = f"({expr} {op} {x})" if op in "+-" else f"{expr} {op} {x}"
            value = evaluate(expr)
            if value is not None and value.denominator == 1 and 0 < value <= 1000:
                target = int(value)
                prompt = (
                    f"Using the numbers {nums}, each exactly once, and + - * /, make {target}. "
                    f"Write the expression. {INSTRUCTION}"
                )
                return Problem(self.name, prompt, expr, {"numbers": nums, "target": target})

    def check(self, problem, answer):
        nums = numbers_in(answer)
        if nums is None or Counter(nums) != Counter(problem.data["numbers"]):
            return False
        value = evaluate(answer)
        return value is not None and value == problem.data["target"]

    def solution(self, problem):
        return f"{problem.answer} = {problem.data['target']}. <answer>{problem.answer}</answer>"


_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _parse(text: str):
    text = text.strip().replace("×", "*").replace("÷", "/")
    if not text or len(text) > 200:
        return None
    try:
        return ast.parse(text, mode="eval").body
    except SyntaxError:
        return None


def evaluate(expr: str) -> Fraction | None:
    """The exact value of an arithmetic expression of integers and + − × ÷ (and unary −); None when it is
    anything else or divides by zero. Only these AST nodes are evaluated: no names, calls or powers."""

    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("not an arithmetic expression")

    tree = _parse(expr)
    if tree is None:
        return None
    try:
        return ev(tree)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_in(expr: str) -> list[int] | None:
    """The integer literals of an expression, in order (None when it does not parse)."""
    tree = _parse(expr)
    if tree is None:
        return None
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and type(n.value) is int]


WORDS = (
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "lemon",
    "piano",
    "glass",
    "honey",
    "robot",
    "candle",
    "planet",
    "forest",
    "silver",
    "window",
    "garden",
    "rocket",
    "banana",
    "mirror",
    "castle",
    "pencil",
    "jungle",
    "violet",
    "marble",
    "dragon",
    "summer",
    "winter",
    "button",
    "camera",
    "island",
)


class Strings(Task):
    name = "strings"

    def _draw(self, rng):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 7)))
        if rng.random() < 0.5:
            return Problem(
                self.name,
                f"Reverse the string '{word}'. {INSTRUCTION}",
                word[::-1],
                {"kind": "reverse", "word": word},
            )
        letter = rng.choice(word)
        return Problem(
            self.name,
            f"How many times does the letter '{letter}' occur in '{word}'? {INSTRUCTION}",
            str(word.count(letter)),
            {"kind": "count", "word": word, "letter": letter},
        )

    def check(self, problem, answer):
        if problem.data["kind"] == "count":
            return _int_answer(answer) == int(problem.answer)
        return answer.strip() == problem.answer


class Format(Task):
    name = "format"

    def _draw(self, rng):
        word, k = rng.choice(WORDS), rng.randint(2, 4)
        kind = rng.choice(("upper", "repeat", "json"))
        if kind == "upper":
            return Problem(
                self.name,
                f"Write the word '{word}' in capital letters. {INSTRUCTION}",
                word.upper(),
                {"kind": kind},
            )
        if kind == "repeat":
            return Problem(
                self.name,
                f"Write the word '{word}' {k} times, separated by commas and no spaces. "
                f"{INSTRUCTION}",
                ",".join([word] * k),
                {"kind": kind},
            )
        return Problem(
            self.name,
            f'Write a JSON object with the key "word" set to "{word}" and the key '
            f'"n" set to {k}. {INSTRUCTION}',
            json.dumps({"word": word, "n": k}),
            {"kind": kind, "word": word, "n": k},
        )

    def check(self, problem, answer):
        if problem.data["kind"] != "json":
            return answer.strip() == problem.answer
        try:
            return json.loads(answer) == {"word": problem.data["word"], "n": problem.data["n"]}
        except (json.JSONDecodeError, TypeError):
            return False


TASKS = {"arithmetic": Arithmetic, "countdown": Countdown, "strings": Strings, "format": Format}


def get_task(name: str, **kw) -> Task:
    if name not in TASKS:
        raise ValueError(f"task={name!r}; expected one of {sorted(TASKS)}")
    return TASKS[name](**kw)
