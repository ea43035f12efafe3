"""Training checkpoints: model, optimizer, schedule, RNG states, step, config, tokenizer reference.

Layout of one checkpoint, ``<dir>/step_00001000/``:

    model.safetensors      model weights (fp32 master weights, lmstack names)
    optimizer.safetensors  per-parameter optimizer tensors, keys ``state.<param index>.<name>``
    rng.safetensors        torch CPU/CUDA generator states and the data sampler's generator state
    state.json             step, tokens seen, config, schedule, optimizer hyper-parameters,
                           python/numpy RNG states, tokenizer path, last metrics

Tensors go through safetensors only (never pickle). Writing is atomic: everything is written
into a hidden temporary directory, each file is fsync'ed, then the directory is renamed to its
final name and ``<dir>/latest`` is rewritten atomically. A crash at any point leaves the last
good checkpoint (and the ``latest`` pointer to it) untouched; ``recover`` (run when a run
starts) puts back a checkpoint moved aside by an interrupted re-save and removes the leftovers
(``.tmp_step_*``, ``.old_step_*``, ``.staging_*``, ``.pruned_step_*``). A failed write (disk
full) raises ``CheckpointWriteError`` and leaves the previous checkpoint as it was.

Pruning keeps ``keep_last`` checkpoints and never removes the one just written nor the one
``latest`` names. After a rollback (a resume from an earlier checkpoint) the checkpoints past
the resumed step belong to the abandoned continuation and go first; the others go oldest
first. A pruned folder is renamed away before it is deleted, so a ``step_N`` folder is always
either complete or absent. ``latest`` naming a missing checkpoint is an error, never a silent
fall-back to another one.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmstack.run_state import (
    CheckpointError,
    capture_rng,
    commit_dir,
    fsync_path,
    join_optimizer,
    restore_rng,
    split_optimizer,
)
from lmstack.utils import atomic_write_text

FORMAT = "lmstack-train-checkpoint-v1"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, I/O error); the previous checkpoint is intact."""


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    except (
        SafetensorError
    ) as e:  # safetensors reports an OSError (ENOSPC, EIO) as its own error type
        code = errno.ENOSPC if "No space left" in str(e) or "StorageFull" in str(e) else errno.EIO
        raise OSError(code, f"{os.strerror(code)} ({e})", str(path)) from None
    fsync_path(path)


# ---- save / find / load -----------------------------------------------------------------------


def step_dirs(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``directory`` (``step_N`` folders), oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in d.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names (or, while an interrupted re-save has it moved aside, its
    ``.old_step_N_<pid>`` folder); without a ``latest`` file the highest step; None when there is
    none. A ``latest`` that names a missing or incomplete checkpoint raises CheckpointError."""
    d = Path(directory)
    pointer = d / "latest"
    if pointer.is_file():
        name = pointer.read_text().strip()
        p = d / name
        if not _STEP_DIR.match(name):
            raise CheckpointError(
                f"{pointer} holds {name!r}, not a checkpoint name like 'step_00000010'"
            )
        if (
            not p.exists()
        ):  # a re-save died between moving the old one aside and renaming the new one in
            aside = sorted(q for q in d.glob(f".old_{name}_*") if (q / "state.json").is_file())
            if aside:
                return aside[-1]  # recover() renames it back when the next run starts
        if not (p / "state.json").is_file():
            others = [q.name for q in step_dirs(d)]
            raise CheckpointError(
                f"{pointer} names {p}, which is {'incomplete' if p.exists() else 'missing'}; "
                f"resume from one of {others or 'no other checkpoints'} with --resume PATH"
            )
        return p
    dirs = step_dirs(d)
    return dirs[-1] if dirs else None


_LEFTOVER = re.compile(r"^\.(tmp|old|staging|pruned)_(step_\d+)(?:_\d+)?(\.shards)?$")


def recover(directory: str | os.PathLike) -> list[str]:
    """Repair what a crash mid-save can leave; run once when a run starts, before reading ``latest``.

    A re-save of step N moves the old ``step_N`` aside (``.old_step_N_<pid>``) before renaming the
    new one in: if it died between the two renames, the old one is put back. Every other leftover
    (``.tmp_step_*``, ``.old_step_*``, ``.staging_*``, ``.pruned_step_*``) is removed. Returns
    what was done, one line per item.
    """
    d = Path(directory)
    done: list[str] = []
    if not d.is_dir():
        return done
    for p in sorted(d.iterdir()):
        m = _LEFTOVER.match(p.name)
        if m is None:
            continue
        kind, name = m.group(1), m.group(2) + (m.group(3) or "")
        if kind == "old" and not (d / name).exists():
            os.rename(p, d / name)
            done.append(f"restored {name} from {p.name} (a re-save was interrupted)")
        else:
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed {p.name}")
    if done:
        fsync_path(d)
    return done


def prune(directory: str | os.PathLike, keep_last: int, current: Path) -> list[Path]:
    """Remove checkpoints beyond ``keep_last``, never ``current`` (just written) nor the one ``latest``
    names. Those past ``current``'s step (an abandoned continuation after a rollback) go first,
    then the oldest. Each is renamed away before deletion. Returns the removed paths."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    d = Path(directory)
    pointer = d / "latest"
    protected = {current.name, pointer.read_text().strip() if pointer.is_file() else current.name}
    step = int(_STEP_DIR.match(current.name).group(1))
    others = [p for p in step_dirs(d) if p.name not in protected]
    # keep order: steps before ``current``, newest first; then the abandoned ones past it
    ranked = sorted(others, key=lambda p: (int(p.name[5:]) > step, -int(p.name[5:])))
    removed = ranked[max(keep_last - len(protected), 0) :]
    for p in removed:
        gone = d / f".pruned_{p.name}_{os.getpid()}"
        os.rename(p, gone)
        shutil.rmtree(gone, ignore_errors=True)
    return removed


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    state: dict[str, Any] | None = None,
    data_generator: torch.Generator | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write ``<directory>/step_<step>`` atomically; prune to ``keep_last``; return its path.

    ``state`` is any JSON-ready dict (config, schedule, tokens seen, metrics, tokenizer path).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"step_{step:08d}"
    tmp = d / f".tmp_step_{step:08d}_{os.getpid()}"
    try:
        _write_checkpoint_files(tmp, model, optimizer, step, state, data_generator)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            prev = latest_checkpoint(d)
        except CheckpointError:
            prev = None
        kept = (
            f"the previous checkpoint {prev} is intact"
            if prev is not None
            else "no earlier checkpoint exists"
        )
        raise CheckpointWriteError(
            e.errno or errno.EIO,
            f"cannot write checkpoint {final} ({e.strerror or e}); "
            f"{kept}. Free some space (or set out_dir elsewhere) and resume",
        ) from None
    # re-saving the same step moves the old one aside first (recover() puts it back)
    old = commit_dir(tmp, final, d / f".old_step_{step:08d}_{os.getpid()}")
    atomic_write_text(d / "latest", final.name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for stale in d.glob(".tmp_step_*"):  # leftovers of crashed saves
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last is not None:
        prune(d, keep_last, final)
    return final


def _write_checkpoint_files(
    tmp: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    state: dict[str, Any] | None,
    data_generator: torch.Generator | None,
) -> None:
    """Every file of one checkpoint into the fresh folder ``tmp``, each fsync'ed."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    _save_tensors(dict(model.state_dict()), tmp / "model.safetensors")
    opt_meta = None
    if optimizer is not None:
        opt_tensors, opt_meta = split_optimizer(optimizer.state_dict())
        _save_tensors(opt_tensors, tmp / "optimizer.safetensors")
    rng_tensors, rng_meta = capture_rng(data_generator)
    _save_tensors(rng_tensors, tmp / "rng.safetensors")
    meta = {"format": FORMAT, "step": step, "optimizer": opt_meta, "rng": rng_meta, **(state or {})}
    with open(tmp / "state.json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint into ``{"meta", "model", "optimizer", "rng"}`` (tensors on the CPU)."""
    p = Path(path)
    if not (p / "state.json").is_file():
        raise CheckpointError(f"{p}: not a checkpoint (no state.json)")
    try:
        meta = json.loads((p / "state.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p / 'state.json'}: corrupt ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{p}: format {meta.get('format')!r}, expected {FORMAT!r}")
    out: dict[str, Any] = {"meta": meta}
    for name in ("model", "optimizer", "rng"):
        f = p / f"{name}.safetensors"
        if f.is_file():
            try:
                out[name] = load_file(str(f))
            except Exception as e:  # safetensors raises its own error types for truncated files
                raise CheckpointError(f"{f}: cannot read ({e})") from None
        elif name != "optimizer":
            raise CheckpointError(f"{p}: missing {f.name}")
    return out


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    data_generator: torch.Generator | None = None,
    restore_rng_states: bool = True,
) -> dict[str, Any]:
    """Restore model (and optimizer, RNG states) from ``path``; returns the JSON state."""
    ck = read_checkpoint(path)
    state = ck["model"]
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise CheckpointError(
            f"{path}: model tensors do not match: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise CheckpointError(
                f"{path}: {k} has shape {tuple(v.shape)}, the model expects {tuple(own[k].shape)}"
            )
    model.load_state_dict(state)
    meta = ck["meta"]
    if optimizer is not None:
        if "optimizer" not in ck or meta.get("optimizer") is None:
            raise CheckpointError(f"{path}: no optimizer state to resume from")
        sd = join_optimizer(ck["optimizer"], meta["optimizer"])
        device = next(model.parameters()).device
        for st in sd["state"].values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    st[k] = v.to(device)
        optimizer.load_state_dict(sd)
    if restore_rng_states:
        restore_rng(ck["rng"], meta.get("rng", {}), data_generator)
    return meta
