"""The run folder (``out_dir``): what a run writes there, never mixing two runs in it.

A run writes ``RUN_FILES`` into ``out_dir`` (other files there, e.g. the token file, are left
alone). A fresh run into a folder that already holds a run is refused unless it resumes
(``--resume``) or overwrites (``--overwrite``: the previous run's ``RUN_FILES`` are deleted
first, nothing else). After a resume at step k the metrics rows past k (logged by the run
that went on past its checkpoint) are dropped, so replayed steps are not logged twice.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from lmstack.train.config import TrainConfigError
from lmstack.utils import OutputError, atomic_write_text, check_outputs

RUN_FILES = ("checkpoints", "metrics.jsonl", "config.json", "model", "loss_curve.png")
RUN_DIRS = ("checkpoints", "model")


def run_outputs(out_dir: str | os.PathLike) -> list[tuple[str, Path]]:
    """(label, path) of everything a run writes, for ``lmstack.utils.check_outputs``."""
    d = Path(out_dir)
    files = [
        (f"out_dir's {name}" + ("/" if name in RUN_DIRS else ""), d / name) for name in RUN_FILES
    ]
    return files + [
        (f"out_dir's model/{name}", d / "model" / name)
        for name in ("config.json", "model.safetensors", "tokenizer.json")
    ]


def other_model_files(out_dir: str | os.PathLike) -> list[str]:
    """Weights at the top of ``out_dir``: another model's folder (a run exports its own into model/)."""
    d = Path(out_dir)
    if not d.is_dir():
        return []
    return sorted(
        f.name
        for f in d.iterdir()
        if f.name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
        or f.suffix == ".gguf"
    )


def check_run_paths(config, config_file: str | os.PathLike | None = None) -> None:
    """No file the run writes may be (or link to) one it reads: ``train_data``, ``val_data``,
    ``tokenizer`` and the ``--config`` file (``lmstack.utils.check_outputs``; OutputError); and
    ``out_dir`` may not be another model's folder (its config.json would be replaced, even by
    ``--overwrite``)."""
    weights = other_model_files(config.out_dir)
    if weights:
        raise OutputError(
            f"out_dir {str(config.out_dir)!r} holds another model ({', '.join(weights[:3])}); a run "
            "writes config.json, metrics.jsonl and model/ there and would replace its config: choose "
            "another out_dir"
        )
    check_outputs(
        run_outputs(config.out_dir),
        [
            ("--config", config_file),
            ("train_data", config.train_data),
            ("val_data", config.val_data),
            ("tokenizer", config.tokenizer),
        ],
    )


def existing_run(out_dir: str | os.PathLike) -> list[str]:
    """The names of ``RUN_FILES`` present in ``out_dir`` (an empty checkpoints folder does not count)."""
    d = Path(out_dir)
    found = []
    for name in RUN_FILES:
        p = d / name
        if p.is_dir() and not any(p.iterdir()):
            continue
        if p.exists() or p.is_symlink():
            found.append(name)
    return found


def refuse_existing_run(out_dir: str | os.PathLike, found: list[str] | None = None) -> None:
    """A fresh run without ``--overwrite``: raise TrainConfigError when ``out_dir`` holds a run
    (``found``: what ``existing_run`` saw, when already looked up)."""
    found = existing_run(out_dir) if found is None else found
    if found:
        raise TrainConfigError(
            f"out_dir {str(out_dir)!r} already holds a run ({', '.join(found)}); pass --resume "
            "to continue it, --overwrite to delete it and start afresh, or choose another out_dir"
        )


def clear_run(out_dir: str | os.PathLike) -> list[str]:
    """``--overwrite``: delete the previous run's ``RUN_FILES`` (each renamed away first, so a crash
    leaves either the old file or none); returns the names removed."""
    d = Path(out_dir)
    removed = existing_run(d)
    for name in removed:
        gone = d / f".overwritten_{name}_{os.getpid()}"
        os.rename(d / name, gone)
        if gone.is_dir() and not gone.is_symlink():
            shutil.rmtree(gone)
        else:
            gone.unlink()
    for stale in d.glob(".overwritten_*"):  # leftovers of an earlier interrupted --overwrite
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(
            missing_ok=True
        )
    return removed


def truncate_metrics(path: str | os.PathLike, step: int) -> int:
    """Drop the rows of ``metrics.jsonl`` logged after ``step`` (atomically); returns how many."""
    p = Path(path)
    if not p.is_file():
        return 0
    keep, dropped = [], 0
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            row_step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):
            dropped += 1  # a torn last line of a killed run
            continue
        if isinstance(row_step, int) and row_step > step:
            dropped += 1
        else:
            keep.append(line)
    if dropped:
        atomic_write_text(p, "".join(line + "\n" for line in keep))
    return dropped
