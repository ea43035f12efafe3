"""A pipeline: stages of steps, written in Python or in a TOML file.

A stage is a list of steps run as ``tasks`` independent tasks (task ``rank`` of ``world``: a reader takes
every ``world``-th input file); stages run one after another, each a global barrier: dedup's signatures ->
buckets -> clusters -> filter are four stages, each reading what the one before wrote. A stage's task count
defaults to its reader's number of input files (1 when it does not start with a reader).

The TOML file (paths relative to the working directory the command runs in)::

    output = "runs/data/demo"     # logs: <output>/<stage>/{stats,completions,excluded}/
    exclusions = true             # keep every dropped document with its step and reason (default true)
    tasks = 8                     # optional (default: one task per input file)

    [[step]]                      # a one-stage pipeline; for several, use [[stage]] with [[stage.step]]
    type = "read_warc"            # a registered step name (lmstack.data.step.register_step) ...
    paths = ["crawl/"]
    [[step]]
    type = "gopher_quality"       # ... every other key is a keyword argument of the step's class
    [[step]]
    type = "write_jsonl"
    output = "runs/data/demo/clean"

    # [[stage]]
    # name = "signatures"
    # tasks = 4
    # [[stage.step]]
    # type = "..."
"""

from __future__ import annotations

import inspect
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmstack.data.readers import Reader, _glob_root
from lmstack.data.step import STEPS, Filter, Step, register_step, step_class
from lmstack.data.writers import ShardWriter

__all__ = ["Pipeline", "Stage", "build_step", "register_step", "STEPS"]


def build_step(spec: dict[str, Any], where: str = "step") -> Step:
    """A step from ``{"type": name, **kwargs}`` (``name`` optionally renames it in the stats; ``routes``
    limits a filter to documents on those routes, :class:`~lmstack.data.step.Filter`)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise ValueError(f"{where}: expected a table with a string 'type', got {spec!r}")
    kwargs = {k: v for k, v in spec.items() if k not in ("type", "name", "routes")}
    try:
        cls = step_class(spec["type"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    routes = spec.get("routes")
    if routes is not None and not (
        issubclass(cls, Filter)
        and isinstance(routes, list)
        and all(isinstance(r, str) for r in routes)
    ):
        raise ValueError(
            f"{where} (type {spec['type']!r}): routes={routes!r} must be a list of route names, "
            "on a filter"
        )
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ValueError(
            f"{where} (type {spec['type']!r}): {e}; {cls.__name__} takes {inspect.signature(cls)}"
        ) from None
    _check_types(cls, kwargs, f"{where} (type {spec['type']!r})")
    try:
        step = cls(**kwargs)
    except ValueError as e:  # a value out of range: say where it was written
        raise ValueError(f"{where} (type {spec['type']!r}): {e}") from None
    if "name" in spec:
        step.name = str(spec["name"])
    if routes is not None:
        step.routes = tuple(routes)
    return step


_SCALARS = (bool, int, float, str, type(None))


def _check_types(cls: type, kwargs: dict[str, Any], where: str) -> None:
    """A keyword whose annotation is made of bool/int/float/str/None must get one of those (a TOML typo such
    as ``min_doc_words = "fifty"`` is an error naming the key here, not a TypeError inside a task)."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that does not resolve: nothing to check against
        return
    for key, value in kwargs.items():
        hint = hints.get(key)
        if hint is None:
            continue
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if typing.get_origin(hint) is typing.Union:
            allowed = typing.get_args(hint)
        if not all(t in _SCALARS for t in allowed):
            continue
        ok = (
            (bool in allowed)
            if isinstance(value, bool)
            else (int in allowed or float in allowed)
            if isinstance(value, int)
            else (float in allowed)
            if isinstance(value, float)
            else any(isinstance(value, t) for t in allowed)
        )
        if not ok:
            names = " or ".join(t.__name__ for t in allowed if t is not type(None))
            raise ValueError(
                f"{where}: {key}={value!r} is a {type(value).__name__}; expected {names}"
            )


@dataclass
class Stage:
    """Steps run as ``tasks`` tasks (None: the reader's file count, or 1)."""

    name: str
    steps: list[Step]
    tasks: int | None = None

    def __post_init__(self):
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"stage name {self.name!r}: expected a plain folder name")
        if not self.steps:
            raise ValueError(f"stage {self.name!r} has no steps")
        if self.tasks is not None and (
            isinstance(self.tasks, bool) or not isinstance(self.tasks, int) or self.tasks < 1
        ):
            raise ValueError(f"stage {self.name!r}: tasks={self.tasks!r} must be an integer >= 1")

    def task_count(self) -> int:
        if self.tasks is not None:
            return self.tasks
        first = self.steps[0]
        return max(1, len(first.files())) if isinstance(first, Reader) else 1


@dataclass
class Pipeline:
    """Stages run in order; ``output`` holds each stage's stats, completion markers and exclusions."""

    stages: list[Stage]
    output: str | os.PathLike
    exclusions: bool = True
    source: str | None = field(default=None, compare=False)  # the TOML file it came from

    def __post_init__(self):
        self.output = os.path.abspath(self.output)
        names = [s.name for s in self.stages]
        if not names:
            raise ValueError("a pipeline needs at least one stage")
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        for st in self.stages:
            for step in st.steps:
                step.bind(self.output)
        self._check_paths()

    def _check_paths(self) -> None:
        """No output may land inside an input folder: a relaunch would read it (and split tasks differently).
        A stage may read exactly the folder an earlier stage wrote."""
        outs = [
            (i, f"stage {st.name!r} step {step.name!r} output", Path(step.output))
            for i, st in enumerate(self.stages)
            for step in st.steps
            if isinstance(step, ShardWriter)
        ]
        outs.append(
            (
                len(self.stages),
                "the pipeline's output (stats, markers, exclusions)",
                Path(self.output),
            )
        )
        for _, what, out in outs[:-1]:
            for st in self.stages:
                logs = (Path(self.output) / st.name).resolve()
                if out.resolve() == logs or logs in out.resolve().parents:
                    raise ValueError(
                        f"{what} {str(out)!r} is inside stage {st.name!r}'s log folder {str(logs)!r} "
                        "(stats, markers, exclusions); rename the stage or the output"
                    )
        for j, st in enumerate(self.stages):
            for step in st.steps:
                if not isinstance(step, Reader):
                    continue
                for given, full in step.paths:
                    root = Path(
                        _glob_root(full) if any(c in given for c in "*?[") else full
                    ).resolve()
                    for i, what, out in outs:
                        out = out.resolve()
                        if out == root and what.endswith(" output") and i < j:
                            continue  # this stage reads what an earlier one wrote
                        if out == root or root in out.parents:
                            raise ValueError(
                                f"{what} {str(out)!r} lies inside stage {st.name!r}'s input "
                                f"{given!r}: a relaunch would read it; write it elsewhere"
                            )

    @classmethod
    def from_steps(
        cls,
        steps: list[Step],
        output: str | os.PathLike,
        tasks: int | None = None,
        name: str = "main",
        **kw,
    ) -> Pipeline:
        return cls([Stage(name, list(steps), tasks)], output, **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "pipeline") -> Pipeline:
        known = {"output", "exclusions", "tasks", "step", "stage"}
        extra = set(d) - known
        if extra:
            raise ValueError(
                f"{where}: unknown top-level keys {sorted(extra)}; expected {sorted(known)}"
            )
        if "output" not in d:
            raise ValueError(
                f"{where}: missing 'output' (the folder for stats, completion markers, exclusions)"
            )
        if ("step" in d) == ("stage" in d):
            raise ValueError(
                f"{where}: give either [[step]] tables (one stage) or [[stage]] tables, not "
                f"{'both' if 'step' in d else 'neither'}"
            )
        if "tasks" in d and "stage" in d:
            raise ValueError(
                f"{where}: a top-level 'tasks' is for a [[step]] pipeline; give each [[stage]] its own"
            )
        if not isinstance(d["output"], str) or not d["output"]:
            raise ValueError(f"{where}: output={d['output']!r} must be a folder path (a string)")
        if not isinstance(d.get("exclusions", True), bool):
            raise ValueError(
                f"{where}: exclusions={d['exclusions']!r} must be true or false (a TOML boolean)"
            )
        raw = (
            [{"name": "main", "step": d["step"], **({"tasks": d["tasks"]} if "tasks" in d else {})}]
            if "step" in d
            else d["stage"]
        )
        stages = []
        for i, s in enumerate(raw):
            sw = f"{where}: stage {i} ({s.get('name', f'stage{i}')!r})"
            extra = set(s) - {"name", "tasks", "step"}
            if extra:
                raise ValueError(f"{sw}: unknown keys {sorted(extra)}; expected name, tasks, step")
            steps = [build_step(spec, f"{sw} step {j}") for j, spec in enumerate(s.get("step", []))]
            stages.append(Stage(str(s.get("name", f"stage{i}")), steps, s.get("tasks")))
        return cls(stages, d["output"], d.get("exclusions", True))

    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> Pipeline:
        path = Path(path)
        try:
            d = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML: {e}") from None
        p = cls.from_dict(d, str(path))
        p.source = str(path)
        return p
