"""Evaluation tasks defined in small files: a YAML task spec naming a JSONL data file, or a JSONL file
alone (CS336 notes "基准测试": exams scored by log-likelihood, generation tasks).

Three kinds, as lm-evaluation-harness names them:

- ``multiple_choice``: items ``{"context", "choices": [str, ...], "answer": index}``; each option is
  scored by the summed log-probability of ``target_delimiter + choice`` after the prompt;
- ``loglikelihood``: items ``{"context", "continuation"}``: the continuation's log-likelihood and
  whether greedy decoding would produce it;
- ``generate``: items ``{"context", "answer"}``: greedy generation until a stop sequence, the answer
  extracted by ``regex`` (its first group, else the whole match) and compared exactly.

The YAML spec (all keys but ``data`` optional)::

    name: my-task
    kind: multiple_choice          # inferred from the items when absent
    data: items.jsonl              # relative to the YAML file
    prompt: "Q: {question}\\nA:"    # str.format over each item's fields (default "{context}")
    target_delimiter: " "          # between prompt and option/continuation/answer
    fewshot: 3                     # examples drawn from the other items (fixed seed)
    fewshot_seed: 1234
    fewshot_delimiter: "\\n\\n"
    stop: ["\\n"]                   # generate: stop sequences
    max_tokens: 32                 # generate: longest answer
    regex: "answer is (\\\\d+)"     # generate: extraction

Every error names the file, the line (for items) and the field.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from lmstack.utils import read_jsonl as utils_read_jsonl

KINDS = ("multiple_choice", "loglikelihood", "generate")


class TaskError(ValueError):
    """A task file that cannot be evaluated: names the file, line and field."""


@dataclass
class Item:
    fields: dict
    line: int  # 1-based line of the JSONL file
    context: str = ""  # the rendered prompt (without few-shot examples)
    choices: list[str] = field(default_factory=list)  # multiple_choice
    answer: int | str | None = None  # index (multiple_choice) or text (generate)
    continuation: str = ""  # loglikelihood

    def target(self) -> str:
        """The gold text after the prompt (few-shot examples show it)."""
        if self.choices:
            return self.choices[self.answer]
        return self.continuation or str(self.answer)


@dataclass
class Task:
    name: str
    kind: str
    path: Path  # the data file
    items: list[Item]
    target_delimiter: str = " "
    fewshot: int = 0
    fewshot_seed: int = 1234
    fewshot_delimiter: str = "\n\n"
    stop: list[str] = field(default_factory=lambda: ["\n\n"])
    max_tokens: int = 32
    regex: str | None = None

    def prompts(self) -> list[str]:
        """Each item's full prompt: ``fewshot`` other items (drawn with a seeded RNG, the same on every
        run) with their gold targets, then the item's own context."""
        rng = random.Random(self.fewshot_seed)
        out = []
        for i, it in enumerate(self.items):
            if self.fewshot:
                pool = [j for j in range(len(self.items)) if j != i]
                shots = [self.items[j] for j in rng.sample(pool, min(self.fewshot, len(pool)))]
                prefix = "".join(
                    s.context + self.target_delimiter + s.target() + self.fewshot_delimiter
                    for s in shots
                )
            else:
                prefix = ""
            out.append(prefix + it.context)
        return out


def _spec_value(spec: dict, key: str, kind, default, where: str):
    v = spec.get(key, default)
    if v is not default and not isinstance(v, kind):
        raise TaskError(
            f"{where}: field {key!r} = {v!r:.60} must be {getattr(kind, '__name__', kind)}"
        )
    return v


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a line that is not a JSON object is an error."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such task data file")
    rows = list(utils_read_jsonl(path, TaskError))
    if not rows:
        raise TaskError(f"{path}: no items (empty dataset)")
    return rows


def infer_kind(obj: dict) -> str:
    if "choices" in obj:
        return "multiple_choice"
    if "continuation" in obj:
        return "loglikelihood"
    return "generate"


def _render(template: str, obj: dict, where: str) -> str:
    try:
        return template.format_map(obj)
    except KeyError as e:
        raise TaskError(
            f"{where}: missing field {e.args[0]!r} (the prompt template {template!r:.60} uses it)"
        ) from None
    except (ValueError, IndexError) as e:
        raise TaskError(
            f"{where}: the prompt template {template!r:.60} cannot be filled: {e}"
        ) from None


def _check_text(obj: dict, where: str) -> None:
    """Refuse a lone surrogate (a JSON escape like ``"\\ud800"`` with no partner) in any string field:
    it is not Unicode text, and would fail later in the tokenizer with no file or line."""
    for key, v in obj.items():
        for s in v if isinstance(v, list) else [v]:
            if isinstance(s, str):
                try:
                    s.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise TaskError(
                        f"{where}: field {key!r} holds a lone surrogate {s[e.start]!r} at character "
                        f"{e.start} (an unpaired \\ud800-\\udfff escape): not valid Unicode text"
                    ) from None


def make_item(obj: dict, line: int, kind: str, template: str | None, path: Path) -> Item:
    where = f"{path}:{line}"
    _check_text(obj, where)

    def need(key, typ, what):
        if key not in obj:
            raise TaskError(f"{where}: missing field {key!r} ({kind} items need {what})")
        v = obj[key]
        if not isinstance(v, typ) or isinstance(v, bool):
            raise TaskError(f"{where}: field {key!r} = {v!r:.60} must be {what}")
        return v

    if template is None:
        context = need("context", str, "a string 'context'")
    else:
        context = _render(template, obj, where)
    it = Item(obj, line, context)
    if kind == "multiple_choice":
        choices = need("choices", list, "a list of option strings")
        if len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise TaskError(
                f"{where}: field 'choices' = {choices!r:.80} must hold at least 2 non-empty strings"
            )
        ans = need("answer", int, "the index of the correct option (an integer)")
        if not 0 <= ans < len(choices):
            raise TaskError(
                f"{where}: field 'answer' = {ans} is out of range: there are {len(choices)} choices "
                f"(0..{len(choices) - 1})"
            )
        it.choices, it.answer = choices, ans
    elif kind == "loglikelihood":
        it.continuation = need("continuation", str, "a string 'continuation'")
        if not it.continuation:
            raise TaskError(f"{where}: field 'continuation' is empty")
    else:
        ans = obj.get("answer")
        if isinstance(ans, (int, float)) and not isinstance(ans, bool):
            ans = str(ans)
        if "answer" not in obj:
            raise TaskError(
                f"{where}: missing field 'answer' (generate items need the expected answer)"
            )
        if not isinstance(ans, str):
            raise TaskError(f"{where}: field 'answer' = {ans!r:.60} must be a string or number")
        it.answer = ans
    return it


def load_task(path, name: str | None = None) -> Task:
    """A task from a ``.yaml``/``.yml`` spec or a ``.jsonl`` data file (kind inferred from the first item)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such task file")
    spec: dict = {}
    data = path
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            spec = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise TaskError(f"{path}: not valid YAML ({e})") from None
        if not isinstance(spec, dict):
            raise TaskError(f"{path}: expected a mapping of task fields, got {type(spec).__name__}")
        where = str(path)
        if "data" not in spec:
            raise TaskError(
                f"{path}: missing field 'data' (the JSONL file of items, relative to the spec)"
            )
        data = path.parent / _spec_value(spec, "data", str, None, where)
        known = {
            "name",
            "kind",
            "data",
            "prompt",
            "target_delimiter",
            "fewshot",
            "fewshot_seed",
            "fewshot_delimiter",
            "stop",
            "max_tokens",
            "regex",
        }
        unknown = sorted(set(spec) - known)
        if unknown:
            raise TaskError(f"{path}: unknown field(s) {unknown}; expected some of {sorted(known)}")
    elif path.suffix != ".jsonl":
        raise TaskError(f"{path}: a task file is .yaml/.yml (a spec) or .jsonl (items)")
    where = str(path)
    rows = read_jsonl(data)
    kind = _spec_value(spec, "kind", str, None, where) or infer_kind(rows[0][1])
    if kind not in KINDS:
        raise TaskError(f"{where}: field 'kind' = {kind!r} must be one of {list(KINDS)}")
    template = _spec_value(spec, "prompt", str, None, where)
    items = [make_item(obj, n, kind, template, data) for n, obj in rows]
    stop = _spec_value(spec, "stop", (list, str), ["\n\n"], where)
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise TaskError(f"{where}: field 'stop' = {stop!r:.60} must be non-empty strings")
    regex = _spec_value(spec, "regex", str, None, where)
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise TaskError(f"{where}: field 'regex' = {regex!r}: {e}") from None
    task = Task(
        name=name or _spec_value(spec, "name", str, None, where) or path.stem,
        kind=kind,
        path=data,
        items=items,
        target_delimiter=_spec_value(spec, "target_delimiter", str, " ", where),
        fewshot=_spec_value(spec, "fewshot", int, 0, where),
        fewshot_seed=_spec_value(spec, "fewshot_seed", int, 1234, where),
        fewshot_delimiter=_spec_value(spec, "fewshot_delimiter", str, "\n\n", where),
        stop=stop,
        max_tokens=_spec_value(spec, "max_tokens", int, 32, where),
        regex=regex,
    )
    if task.fewshot < 0 or task.max_tokens < 1:
        raise TaskError(
            f"{where}: fewshot={task.fewshot} must be >= 0 and max_tokens={task.max_tokens} >= 1"
        )
    return task
