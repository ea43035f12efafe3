"""A pipeline step: a generator over documents that counts what it sees and says why it drops.

The shape of datatrove's pipeline (readers -> extractors -> filters -> dedup -> tokenizer -> writers): every
step takes an iterator of :class:`Document` and yields the documents that go on. What a step drops it hands to
``stats.drop(doc, reason)``: the reason is counted, and the executor's exclusion writer (if any) keeps the
document with its reason, so every dropped document can be found again.

Three kinds:
- :class:`Step`: any generator (readers ignore their input; writers pass documents through after writing).
- :class:`Filter`: ``reason(doc) -> str | None`` (None keeps the document; a string names the rule that dropped it).
- :class:`Mapper`: ``apply(doc) -> Document`` (extraction, PII replacement, tagging: changes text or metadata).

Tasks: the executor runs each stage as ``world`` tasks; before task ``rank`` runs, every step is replaced by
``step.for_task(rank, world)`` (a shallow copy with ``rank``/``world`` set), so a reader picks its share of the
input files and a writer names its shards after the task. Steps must be picklable (they travel to worker
processes and Ray tasks): keep open files and models out of ``__init__``, open them in ``run``.

Registry: ``@register_step("gopher_quality")`` on a class makes ``type = "gopher_quality"`` work in a pipeline
TOML file (:mod:`lmstack.data.pipeline`); :data:`STEP_MODULES` lists the modules imported to fill it.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import importlib.util
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lmstack.data.document import Document


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@dataclass
class StepStats:
    """One step's counters in one task: documents and UTF-8 bytes in and out, drops per reason, free counters."""

    name: str
    docs_in: int = 0
    docs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> documents
    counters: Counter = field(default_factory=Counter)  # e.g. "email_replaced" -> 12
    on_drop: Callable[[Document, str, str], None] | None = field(
        default=None, repr=False, compare=False
    )

    def seen(self, doc: Document) -> None:
        self.docs_in += 1
        self.bytes_in += len(doc.text.encode("utf-8", "surrogatepass"))

    def kept(self, doc: Document) -> None:
        self.docs_out += 1
        self.bytes_out += len(doc.text.encode("utf-8", "surrogatepass"))

    def drop(self, doc: Document, reason: str) -> None:
        """Count ``reason`` and hand the document to the exclusion writer (``on_drop(doc, step, reason)``)."""
        self.dropped[reason] += 1
        if self.on_drop is not None:
            self.on_drop(doc, self.name, reason)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "docs_in": self.docs_in,
            "docs_out": self.docs_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "dropped": dict(sorted(self.dropped.items())),
            "counters": dict(sorted(self.counters.items())),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepStats:
        return cls(
            d["name"],
            d["docs_in"],
            d["docs_out"],
            d["bytes_in"],
            d["bytes_out"],
            Counter(d.get("dropped", {})),
            Counter(d.get("counters", {})),
        )

    def merge(self, other: StepStats) -> StepStats:
        """The sum of two tasks' stats for the same step (``lmstack data stats``)."""
        if other.name != self.name:
            raise ValueError(f"cannot merge stats of step {other.name!r} into {self.name!r}")
        return StepStats(
            self.name,
            self.docs_in + other.docs_in,
            self.docs_out + other.docs_out,
            self.bytes_in + other.bytes_in,
            self.bytes_out + other.bytes_out,
            self.dropped + other.dropped,
            self.counters + other.counters,
        )


class Step:
    """A generator over documents. Subclasses override :meth:`run`; ``name`` defaults to the class in snake_case."""

    name: str = ""
    rank: int = 0  # this task's index in its stage, set by for_task
    world: int = 1  # the stage's task count
    # attributes that do not change what the step outputs (left out of its recorded configuration)
    config_ignore: tuple[str, ...] = ()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if not cls.__dict__.get("name"):
            cls.name = _snake(cls.__name__)

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        for doc in docs:
            stats.seen(doc)
            stats.kept(doc)
            yield doc

    def __call__(
        self, docs: Iterable[Document], stats: StepStats | None = None
    ) -> Iterator[Document]:
        return self.run(docs, stats if stats is not None else StepStats(self.name))

    def bind(self, output: str) -> None:
        """Called by :class:`~lmstack.data.pipeline.Pipeline` with its output folder (absolute): a step that
        keeps work files between stages (dedup) derives its folder from it. Default: nothing."""

    def for_task(self, rank: int, world: int) -> Step:
        """This step as task ``rank`` of ``world`` sees it: a shallow copy with ``rank`` and ``world`` set."""
        if not (isinstance(rank, int) and isinstance(world, int) and 0 <= rank < world):
            raise ValueError(
                f"task rank={rank!r} of world={world!r}: expected integers with 0 <= rank < world"
            )
        step = copy.copy(self)
        step.rank, step.world = rank, world
        return step


class Filter(Step):
    """Keeps a document when :meth:`reason` returns None; otherwise drops it with that reason.

    ``routes`` (None: every document): the filter judges only documents whose ``metadata["route"]`` is one
    of these (or that have no route); the others pass untouched, counted as ``passed_route_<route>``. A
    router step (``code_router``, :mod:`lmstack.data.route`) sets the route; in a pipeline file it is the
    key ``routes = ["prose"]`` of any filter's table."""

    routes: tuple[str, ...] | None = None

    def reason(self, doc: Document) -> str | None:
        raise NotImplementedError

    def judges(self, doc: Document, stats: StepStats) -> bool:
        """False when ``routes`` sends ``doc`` past this filter (and counts it)."""
        route = doc.metadata.get("route") if self.routes is not None else None
        if route is None or route in self.routes:
            return True
        stats.counters[f"passed_route_{route}"] += 1
        return False

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        for doc in docs:
            stats.seen(doc)
            why = self.reason(doc) if self.judges(doc, stats) else None
            if why is None:
                stats.kept(doc)
                yield doc
            else:
                stats.drop(doc, why)


class Mapper(Step):
    """Changes each document (text or metadata); :meth:`apply` may count into ``stats.counters``."""

    def apply(self, doc: Document, stats: StepStats) -> Document:
        raise NotImplementedError

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        for doc in docs:
            stats.seen(doc)
            out = self.apply(doc, stats)
            stats.kept(out)
            yield out


# ---- the registry of step names (pipeline TOML ``type = "..."``) ------------------------------------------

STEPS: dict[str, type[Step]] = {}

# Modules whose import registers steps; a module not present in this install is skipped. Add yours here.
STEP_MODULES = (
    "lmstack.data.readers",
    "lmstack.data.writers",
    "lmstack.data.extract",
    "lmstack.data.langid",
    "lmstack.data.pii",
    "lmstack.data.quality",
    "lmstack.data.route",
    "lmstack.data.classifiers",
    "lmstack.data.dedup",
    "lmstack.data.tokenize",
)


def register_step(name: str) -> Callable[[type[Step]], type[Step]]:
    """Class decorator: ``type = name`` in a pipeline file builds this step (``cls(**the other keys)``)."""

    def add(cls: type[Step]) -> type[Step]:
        if not (isinstance(cls, type) and issubclass(cls, Step)):
            raise TypeError(f"register_step({name!r}) decorates a Step subclass, got {cls!r}")
        if STEPS.get(name, cls) is not cls:
            raise ValueError(
                f"step name {name!r} is already registered to {STEPS[name].__module__}.{STEPS[name].__qualname__}"
            )
        STEPS[name] = cls
        return cls

    return add


_SKIP = object()


def _plain(v: Any, depth: int = 0) -> Any:
    """``v`` as JSON-able data, or ``_SKIP`` for what is not plain data (a model, a tokenizer's bytes)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    if isinstance(v, (list, tuple, set, frozenset)):
        items = [_plain(x, depth) for x in v]
        if any(x is _SKIP for x in items):
            return _SKIP
        return sorted(items, key=repr) if isinstance(v, (set, frozenset)) else items
    if isinstance(v, dict):
        out = {str(k): _plain(x, depth) for k, x in v.items()}
        return {k: x for k, x in sorted(out.items()) if x is not _SKIP}
    if depth < 2 and type(v).__module__.startswith("lmstack.") and hasattr(v, "__dict__"):
        return _plain_attrs(v, depth + 1)
    return _SKIP


def step_config(step: Step) -> dict[str, Any]:
    """What a relaunch must agree on: the step's class, name and every public attribute that is plain data
    (numbers, strings, paths, lists/sets/dicts of them; lmstack objects such as a LanguageID or a
    MinHashConfig by their own attributes); models, open files, ``_private`` state and the attributes in
    ``config_ignore`` are left out."""
    cls = type(step)
    return {"type": f"{cls.__module__}.{cls.__qualname__}", "name": step.name, **_plain_attrs(step)}


def _plain_attrs(obj: Any, depth: int = 0) -> dict[str, Any]:
    ignore = set(getattr(obj, "config_ignore", ())) | {"rank", "world"}
    out = {}
    for k, v in sorted(vars(obj).items()):
        if k.startswith("_") or k in ignore:
            continue
        p = _plain(v, depth)
        if p is not _SKIP:
            out[k] = p
    return out


def check_number(
    step: str, key: str, value: Any, lo: float = 0.0, hi: float | None = None, integer: bool = False
) -> None:
    """A threshold must be None (the rule is off) or a number in [lo, hi] (an integer when ``integer``);
    otherwise a ValueError naming the step, the key and the value (``max_ellipsis_lines_ratio = 30`` for 0.3
    would otherwise silently turn the rule off)."""
    if value is None:
        return
    kind = "an integer" if integer else "a number"
    bad_type = isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
    if bad_type or value < lo or (hi is not None and value > hi):
        where = f"in [{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}"
        raise ValueError(f"{step}: {key}={value!r} must be {kind} {where} (or None: rule off)")


def step_class(name: str) -> type[Step]:
    """The class registered as ``name``, or ``"package.module:Class"`` for a step outside the registry."""
    if ":" in name:
        module, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(module), attr, None)
        if not (isinstance(cls, type) and issubclass(cls, Step)):
            raise ValueError(f"step type {name!r}: {module} has no Step subclass named {attr!r}")
        return cls
    if name not in STEPS:
        for module in STEP_MODULES:
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:
                found = False
            if found:  # a module registers with @register_step, or lists its steps in a STEPS dict
                for step_name, cls in getattr(importlib.import_module(module), "STEPS", {}).items():
                    if step_name not in STEPS:
                        register_step(step_name)(cls)
    if name not in STEPS:
        close = difflib.get_close_matches(name, sorted(STEPS), n=3)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise ValueError(
            f"unknown step type {name!r}{hint}; registered: {', '.join(sorted(STEPS))} "
            "(or give 'package.module:Class')"
        )
    return STEPS[name]
