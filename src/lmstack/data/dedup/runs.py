"""Sorted runs on disk and their streaming k-way merge: how every dedup stage meets across tasks.

A *run* is one task's records sorted by key, saved as a ``.npy`` structured array ``(key: u8, val: u8)``
(keys are hashes; ``val`` a document's node or a count). A later stage merges the runs of all tasks in key
order without ever holding them: each run is memory-mapped and read a block at a time, so memory is
a fixed budget of records plus the largest group of equal keys — never the corpus (the external merge sort of
Knuth, TAOCP vol. 3, 5.4.1, vectorised: each round merges with numpy everything up to the smallest
"last key read" among the runs still being read).

A document is named by its *node* ``task << 32 | index``: the task (input shard) that read it and its
position in that task's stream, so the smallest node is the first document in (shard, index) order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from lmstack.utils import atomic_path

RUN = np.dtype([("key", "<u8"), ("val", "<u8")])
_MAX_INDEX = (1 << 32) - 1


def node(task: int, index: np.ndarray | int):
    """The node of document ``index`` in task ``task`` (uint64)."""
    if not 0 <= task <= _MAX_INDEX:
        raise ValueError(f"task={task} must be in 0..{_MAX_INDEX}")
    return (np.uint64(task) << np.uint64(32)) | np.asarray(index, dtype=np.uint64)


def node_task(nodes: np.ndarray) -> np.ndarray:
    return (np.asarray(nodes, dtype=np.uint64) >> np.uint64(32)).astype(np.int64)


def node_index(nodes: np.ndarray) -> np.ndarray:
    return (np.asarray(nodes, dtype=np.uint64) & np.uint64(_MAX_INDEX)).astype(np.int64)


def save_array(path: str | os.PathLike, arr: np.ndarray) -> Path:
    """``np.save`` written atomically (the file is complete or absent)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)
    return path


def load_array(path: str | os.PathLike, mmap: bool = False) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{path}: not a readable .npy array ({e})") from None


def write_run(path: str | os.PathLike, keys: np.ndarray, vals: np.ndarray) -> Path:
    """Sort ``(keys, vals)`` by key then val and save them as one run."""
    keys = np.asarray(keys, dtype=np.uint64)
    vals = np.asarray(vals, dtype=np.uint64)
    if keys.shape != vals.shape or keys.ndim != 1:
        raise ValueError(
            f"a run needs 1-d keys and vals of one length, got {keys.shape} and {vals.shape}"
        )
    order = np.lexsort((vals, keys))
    run = np.empty(len(keys), dtype=RUN)
    run["key"] = keys[order]
    run["val"] = vals[order]
    return save_array(path, run)


def _open_run(path: Path) -> np.ndarray:
    run = load_array(path, mmap=True)
    if run.dtype != RUN or run.ndim != 1:
        raise ValueError(f"{path}: a run is a 1-d array of {RUN}, found {run.dtype} {run.shape}")
    return run


def _bisect(run: np.ndarray, key: int) -> int:
    """The first position of ``run`` with key >= ``key``, reading log2(len) records of the memory map
    (np.searchsorted on the strided key field would copy the whole run into memory)."""
    lo, hi = 0, len(run)
    while lo < hi:
        mid = (lo + hi) // 2
        if int(run[mid]["key"]) < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


def merge_runs(
    paths: Sequence[str | os.PathLike],
    lo: int = 0,
    hi: int | None = None,
    budget: int = 1 << 20,
    block: int | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Merge sorted runs: yield ``(keys, vals)`` blocks in (key, val) order, restricted to ``lo <= key < hi``
    (``hi=None``: no upper bound). A group of equal keys is never split across two blocks.

    Each round reads ``block`` records per run, by default ``budget // len(paths)`` (at least 64): about
    ``budget`` records (16 bytes each) in memory whatever the number of runs, plus the largest group of equal
    keys."""
    runs = [_open_run(Path(p)) for p in paths]
    if block is None:
        block = max(64, budget // max(1, len(runs)))
    pos = [_bisect(r, lo) for r in runs]
    end = [len(r) if hi is None else _bisect(r, hi) for r in runs]
    carry_k = np.empty(0, np.uint64)
    carry_v = np.empty(0, np.uint64)
    while any(p < e for p, e in zip(pos, end)):
        blocks = [
            (i, r[pos[i] : min(pos[i] + block, end[i])])
            for i, r in enumerate(runs)
            if pos[i] < end[i]
        ]
        # everything up to the smallest last key among runs with more to read is complete in this round
        bound = min(
            (int(b["key"][-1]) for i, b in blocks if pos[i] + len(b) < end[i]), default=None
        )
        ks, vs = [carry_k], [carry_v]
        for i, b in blocks:
            take = (
                len(b)
                if bound is None
                else int(np.searchsorted(b["key"], np.uint64(bound), "right"))
            )
            ks.append(b["key"][:take])
            vs.append(b["val"][:take])
            pos[i] += take
        k = np.concatenate(ks)
        v = np.concatenate(vs)
        order = np.lexsort((v, k))
        k, v = k[order], v[order]
        if bound is None:  # the last round
            carry_k = carry_v = np.empty(0, np.uint64)
            if len(k):
                yield k, v
            break
        cut = int(
            np.searchsorted(k, k[-1], "left")
        )  # hold back the last group: more of it may follow
        carry_k, carry_v = k[cut:], v[cut:]
        if cut:
            yield k[:cut], v[:cut]
    if len(carry_k):
        yield carry_k, carry_v


def group_starts(keys: np.ndarray) -> np.ndarray:
    """Indices where a new key starts in sorted ``keys`` (the first is 0)."""
    if len(keys) == 0:
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))


def key_range(part: int, parts: int) -> tuple[int, int | None]:
    """The key range ``[lo, hi)`` of part ``part`` of ``parts`` equal slices of the 64-bit hash space."""
    if not 0 <= part < parts:
        raise ValueError(f"part={part} must be in 0..{parts - 1}")
    lo = (part << 64) // parts
    hi = ((part + 1) << 64) // parts
    return lo, (None if part == parts - 1 else hi)


def run_files(folder: str | os.PathLike, pattern: str = "*.npy") -> list[Path]:
    """The complete run files of a folder, sorted by name (temporary files of atomic writes start with '.')."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder of runs (did the previous stage run?)")
    return sorted(p for p in folder.glob(pattern) if not p.name.startswith("."))


def save_removed(folder: str | os.PathLike, part: int, nodes: np.ndarray) -> Path:
    """The nodes a stage's part decided to drop, sorted, as ``removed/{part:05d}.npy``."""
    return save_array(
        Path(folder) / "removed" / f"{part:05d}.npy", np.sort(np.asarray(nodes, dtype=np.uint64))
    )


def load_removed(folder: str | os.PathLike, task: int) -> np.ndarray:
    """The sorted indices (in task ``task``'s stream) of the documents to drop, from every part's file."""
    files = run_files(Path(folder) / "removed")
    parts = [load_array(f) for f in files]
    nodes = np.concatenate(parts) if parts else np.empty(0, np.uint64)
    mine = nodes[node_task(nodes) == task]
    return np.sort(node_index(mine))
