"""The runs table: one JSON object per line (``runs.jsonl``), one line per finished training run.

Every write replaces the file atomically (``lmstack.utils.atomic_write_text``), so an interrupted sweep
never leaves a half-written line; reading checks every line and names the file and line of a bad one.
A row holds at least ``name``, ``N`` (parameters), ``D`` (tokens), ``C`` (FLOPs, 6ND) and ``loss``
(final validation loss); the sweep adds the budget, the exact FLOPs, the loss curve, timings. A run that
diverged holds ``diverged`` (the reason) and ``loss: null``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from lmstack.utils import atomic_write_text, read_jsonl

REQUIRED = ("name", "N", "D", "C", "loss")


class RunsFileError(ValueError):
    """A runs.jsonl line that is not a valid run row."""


def _check_row(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise RunsFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise RunsFileError(
            f"{where}: missing field(s) {missing}; a run row needs {list(REQUIRED)}"
        )
    if not isinstance(row["name"], str) or not row["name"]:
        raise RunsFileError(f"{where}: name={row['name']!r} must be a non-empty string")
    diverged = row.get("diverged")
    if diverged is not None and (not isinstance(diverged, str) or not diverged):
        raise RunsFileError(f"{where}: diverged={diverged!r} must be the reason, a string")
    for k in ("N", "D", "C") if diverged else ("N", "D", "C", "loss"):  # a diverged run has no loss
        v = row[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise RunsFileError(f"{where}: {k}={v!r} must be a finite number > 0")
    return row


def read_runs(path: str | os.PathLike, missing_ok: bool = False) -> list[dict[str, Any]]:
    """All rows of ``path``; a corrupt line raises ``RunsFileError`` naming ``path:line``."""
    p = Path(path)
    if not p.exists():
        if missing_ok:
            return []
        raise FileNotFoundError(
            f"runs file {str(p)!r} does not exist (run `lmstack scaling sweep` first)"
        )
    rows, names = [], {}
    try:
        lines = list(read_jsonl(p, RunsFileError))
    except RunsFileError as e:
        raise RunsFileError(
            f"{e}; delete or fix that line (the sweep reruns a run whose line is missing)"
        ) from None
    for i, row in lines:
        where = f"{p}:{i}"
        row = _check_row(row, where)
        if row["name"] in names:
            raise RunsFileError(
                f"{where}: run {row['name']!r} already recorded on line {names[row['name']]}"
            )
        names[row["name"]] = i
        rows.append(row)
    return rows


def append_run(path: str | os.PathLike, row: dict[str, Any]) -> None:
    """Add ``row`` to ``path`` (the whole file is rewritten atomically: old lines + the new one)."""
    _check_row(row, f"new row for {path}")
    p = Path(path)
    old = p.read_text(encoding="utf-8") if p.exists() else ""
    if old and not old.endswith("\n"):
        old += "\n"
    atomic_write_text(p, old + json.dumps(row, sort_keys=True) + "\n")


def columns(rows: list[dict[str, Any]], *keys: str) -> tuple[np.ndarray, ...]:
    """The numeric columns ``keys`` of ``rows`` as float arrays."""
    return tuple(np.array([float(r[k]) for r in rows]) for k in keys)
