"""Exact deduplication: whole documents, and lines across the whole corpus.

**Documents** (two stages and a filter). Stage 1, one task per input shard: the hash of each document's
normalised text (``normalize.text_hash``) with its node, written as one sorted run. Stage 2, any number of
tasks, each over one slice of the hash space: the k-way merge of all runs; in each group of equal hashes
the smallest node — the first copy in (shard, index) order — survives, the rest are listed. Then
:class:`ExactDedupFilter` drops them ("exact_duplicate").

**Lines** (C4's and Gopher's "duplicate line" rule over a whole corpus, not one document). Stage 1: each task
counts the hashes of its normalised lines into a sorted run of (hash, count). Stage 2: the merge sums the
counts per hash and keeps the hashes seen more than once (one file per slice of the hash space). Stage 3:
:class:`LineDedup` removes every such line from every document (lines that normalise to nothing — blank
lines, lone punctuation — are never counted nor removed), keeping each document's id and metadata and the
order of its remaining lines; a document left with no line that has a word is dropped
("duplicate_lines_only").

Memory: a task holds its own shard's hashes (stage 1), one block per run (stage 2), and the set of duplicated
line hashes (stage 3: 8 bytes per distinct duplicated line).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from lmstack.data.dedup.drop import DropListed
from lmstack.data.dedup.normalize import hash64, normalize, text_hash
from lmstack.data.dedup.runs import (
    group_starts,
    key_range,
    load_array,
    merge_runs,
    node,
    run_files,
    save_array,
    save_removed,
    write_run,
)
from lmstack.data.document import Document
from lmstack.data.step import Step, StepStats

# ---- documents ---------------------------------------------------------------------------------


def exact_hashes(docs: Iterable[Document], folder: str | os.PathLike, task: int) -> int:
    """Stage 1: ``folder/hashes/{task:05d}.npy``, the run of (normalised-text hash, node). Returns the count."""
    return sum(1 for _ in exact_hash_stream(docs, folder, task))


def exact_hash_stream(
    docs: Iterable[Document], folder: str | os.PathLike, task: int
) -> Iterator[Document]:
    """Stage 1 as a pass-through: yields every document on, writes the run when the stream ends."""
    keys = []
    for d in docs:
        keys.append(text_hash(d.text))
        yield d
    keys = np.array(keys, dtype=np.uint64)
    write_run(Path(folder) / "hashes" / f"{task:05d}.npy", keys, node(task, np.arange(len(keys))))


def exact_duplicates(folder: str | os.PathLike, part: int = 0, parts: int = 1) -> int:
    """Stage 2, task ``part`` of ``parts``: every node but the smallest of each group of equal hashes in this
    slice of the hash space -> ``folder/removed/{part:05d}.npy``. Returns how many are removed."""
    removed = []
    for keys, nodes in merge_runs(run_files(Path(folder) / "hashes"), *key_range(part, parts)):
        later = np.ones(len(keys), dtype=bool)
        later[group_starts(keys)] = (
            False  # runs merge in (key, node) order: a group's first is its smallest
        )
        removed.append(nodes[later])
    out = np.concatenate(removed) if removed else np.empty(0, np.uint64)
    save_removed(folder, part, out)
    return len(out)


class ExactDedupFilter(DropListed):
    """Stage 3: drops what :func:`exact_duplicates` listed for task ``task`` ("exact_duplicate")."""

    def __init__(self, folder: str | os.PathLike, task: int):
        super().__init__(folder, task, "exact_duplicate")


# ---- lines -------------------------------------------------------------------------------------


def line_keys(text: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(lines split on "\\n", (n,) uint64 hash of each normalised line, (n,) bool: the line has any word)."""
    lines = text.split("\n")
    normed = [normalize(line) for line in lines]
    keys = np.fromiter((hash64(s) if s else 0 for s in normed), dtype=np.uint64, count=len(lines))
    return lines, keys, np.fromiter((bool(s) for s in normed), dtype=bool, count=len(lines))


def line_counts(docs: Iterable[Document], folder: str | os.PathLike, task: int) -> int:
    """Stage 1: ``folder/line_counts/{task:05d}.npy``, the run of (line hash, occurrences in this shard).
    Returns the number of counted lines."""
    counted = [0]
    for _ in line_count_stream(docs, folder, task, counted):
        pass
    return counted[0]


def line_count_stream(
    docs: Iterable[Document], folder: str | os.PathLike, task: int, counted: list[int] | None = None
) -> Iterator[Document]:
    """Stage 1 as a pass-through: yields every document on, writes the run when the stream ends (and adds the
    number of counted lines to ``counted[0]``)."""
    parts = []
    for doc in docs:
        _, keys, has_words = line_keys(doc.text)
        parts.append(keys[has_words])
        yield doc
    keys = np.concatenate(parts) if parts else np.empty(0, np.uint64)
    uniq, counts = np.unique(keys, return_counts=True)
    write_run(Path(folder) / "line_counts" / f"{task:05d}.npy", uniq, counts)
    if counted is not None:
        counted[0] += len(keys)


def duplicate_lines(folder: str | os.PathLike, part: int = 0, parts: int = 1) -> int:
    """Stage 2, task ``part`` of ``parts``: the line hashes of this slice whose corpus-wide count is above one
    -> ``folder/duplicate_lines/{part:05d}.npy`` (sorted). Returns how many."""
    dups = []
    for keys, counts in merge_runs(
        run_files(Path(folder) / "line_counts"), *key_range(part, parts)
    ):
        starts = group_starts(keys)
        total = np.add.reduceat(counts, starts)
        dups.append(keys[starts][total > 1])
    out = np.concatenate(dups) if dups else np.empty(0, np.uint64)
    save_array(Path(folder) / "duplicate_lines" / f"{part:05d}.npy", out)
    return len(out)


def load_duplicate_lines(folder: str | os.PathLike) -> np.ndarray:
    """All parts' duplicated line hashes, sorted (the parts are disjoint, ascending slices)."""
    parts = [load_array(f) for f in run_files(Path(folder) / "duplicate_lines")]
    return np.concatenate(parts) if parts else np.empty(0, np.uint64)


class LineDedup(Step):
    """Stage 3: removes every line whose normalised hash is in ``folder/duplicate_lines`` (counter
    "lines_removed"); drops documents left with no line that has a word ("duplicate_lines_only")."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = folder
        self._dups: np.ndarray | None = None

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        if self._dups is None:
            self._dups = load_duplicate_lines(self.folder)
        dups = self._dups
        for doc in docs:
            stats.seen(doc)
            lines, keys, has_words = line_keys(doc.text)
            if len(dups):
                at = np.minimum(np.searchsorted(dups, keys), len(dups) - 1)
                drop = has_words & (dups[at] == keys)
            else:
                drop = np.zeros(len(lines), dtype=bool)
            n_drop = int(drop.sum())
            if n_drop == 0:
                stats.kept(doc)
                yield doc
                continue
            stats.counters["lines_removed"] += n_drop
            if not (has_words & ~drop).any():
                stats.drop(doc, "duplicate_lines_only")
                continue
            out = Document(
                "\n".join(line for line, d in zip(lines, drop) if not d), doc.id, doc.metadata
            )
            stats.kept(out)
            yield out


def exact_dedup(
    shards: Sequence[Iterable[Document]], folder: str | os.PathLike
) -> list[list[Document]]:
    """The document stages in this process, one shard after another: each shard's survivors (``shards`` must
    be re-iterable)."""
    for t, docs in enumerate(shards):
        exact_hashes(docs, folder, t)
    exact_duplicates(folder)
    return [list(ExactDedupFilter(folder, t)(docs)) for t, docs in enumerate(shards)]


def line_dedup(
    shards: Sequence[Iterable[Document]], folder: str | os.PathLike
) -> list[list[Document]]:
    """The line stages in this process: each shard's documents without the corpus's duplicated lines."""
    for t, docs in enumerate(shards):
        line_counts(docs, folder, t)
    duplicate_lines(folder)
    step = LineDedup(folder)
    return [list(step(docs)) for docs in shards]
