"""A training run's state as safetensors tensors + JSON: RNG states and optimizer state, and how a
finished checkpoint folder is committed into place.

Shared by the single-process checkpoint (:mod:`lmstack.train.checkpoint`) and the sharded one
(:mod:`lmstack.parallel.checkpoint`), which both store tensors with safetensors only (never pickle)
and everything else in ``state.json`` (Book of LLMs §1.8 “training memory”: optimizer states are part of training memory
and of every checkpoint).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete or does not match the model."""


# ---- committing a checkpoint folder -----------------------------------------------------------


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file, or a directory so the renames and new entries in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_dir(staged: Path, final: Path, aside: Path) -> Path | None:
    """Rename the finished folder ``staged`` to ``final`` and fsync their parent. A ``final`` already
    there (a re-save of the same step) is first moved to ``aside`` (a leftover ``aside`` replaced):
    returns ``aside`` then, for the caller to delete once the new checkpoint is committed, else None."""
    old = None
    if final.exists():
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
        old = aside
    os.rename(staged, final)
    fsync_path(final.parent)
    return old


# ---- RNG states ------------------------------------------------------------------------------


def capture_rng(
    data_generator: torch.Generator | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, json) with every RNG state a run depends on."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    if data_generator is not None:
        tensors["data"] = data_generator.get_state()
    py = random.getstate()
    np_state = np.random.get_state()
    meta = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [
            np_state[0],
            np_state[1].tolist(),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
    }
    return tensors, meta


def restore_rng(
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    data_generator: torch.Generator | None = None,
) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    if data_generator is not None and "data" in tensors:
        data_generator.set_state(tensors["data"])
    if "python" in meta:
        v, st, g = meta["python"]
        random.setstate((v, tuple(st), g))
    if "numpy" in meta:
        name, keys, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---- optimizer state <-> (tensors, json) ------------------------------------------------------


def split_optimizer(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer ``state_dict`` -> (tensors keyed ``state.<param index>.<name>``, JSON metadata)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{idx}.{k}"] = v
            else:
                scalars.setdefault(str(idx), {})[k] = v
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
        for g in sd["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def join_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_optimizer`: a ``state_dict`` for ``optimizer.load_state_dict``."""
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = v
    for idx, d in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(d)
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}
