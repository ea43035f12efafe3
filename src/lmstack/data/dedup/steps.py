"""Dedup in a pipeline: every stage of exact, line and MinHash dedup as a registered step (docs/data.md).

Each dedup keeps its files in one work folder, ``<pipeline output>/dedup/<dedup>`` (``dedup`` defaults to
``"exact"``, ``"lines"``, ``"minhash"``; ``folder=`` overrides it), set when the step joins a
:class:`~lmstack.data.pipeline.Pipeline` (:meth:`Step.bind`). Three kinds of step:

- the **first stage** (``exact_hashes``, ``line_counts``, ``minhash_signatures``) sits anywhere in a stage
  that carries documents and passes them on unchanged; its files are complete when the task's stream ends.
  ``exact_hashes`` and ``minhash_signatures`` also write ``ids/{rank:05d}.npy``, the 64-bit hash of each
  document's id in stream order, which turns the later stages' nodes back into document ids;
- the **global stages** (``exact_duplicates``, ``duplicate_lines``, ``minhash_buckets``, ``minhash_confirm``,
  ``minhash_clusters``) read only the folder: each is the only step of a ``[[stage]]`` of its own, task
  ``rank`` of ``world`` takes its slice (``minhash_clusters`` must be one task: one union-find over all edges);
- the **filter** (``exact_filter``, ``line_dedup``, ``minhash_filter``) drops what the global stages listed.
  The exact and MinHash filters match documents by id, so they may run in any later stage, over any
  sharding of the same documents (e.g. the shards a writer wrote after the first stage); ids must be unique
  (every reader's are: source + record or offset).

MinHash's parameters are given once, to ``minhash_signatures``, which writes them to ``config.json``; the
later MinHash stages read them from there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np

from lmstack.data.dedup.bloom import BloomParagraphDedup
from lmstack.data.dedup.decontam import Decontaminate
from lmstack.data.dedup.exact import (
    LineDedup,
    duplicate_lines,
    exact_duplicates,
    exact_hash_stream,
    line_count_stream,
)
from lmstack.data.dedup.minhash import (
    MinHashConfig,
    minhash_buckets,
    minhash_clusters,
    minhash_confirm,
    signature_stream,
)
from lmstack.data.dedup.normalize import hash64
from lmstack.data.dedup.runs import load_array, node_index, node_task, run_files, save_array
from lmstack.data.document import Document
from lmstack.data.step import Step, StepStats
from lmstack.utils import atomic_write_text

DEDUP_DIR = "dedup"  # <pipeline output>/dedup/<dedup name>/


class DedupStep(Step):
    """A dedup stage with a work folder: ``folder`` if given, else ``<pipeline output>/dedup/<dedup>``."""

    kind = ""  # the default dedup name

    def __init__(self, dedup: str | None = None, folder: str | os.PathLike | None = None):
        self.dedup = dedup or self.kind
        if not self.dedup or "/" in self.dedup or self.dedup.startswith("."):
            raise ValueError(f"{self.name}: dedup={self.dedup!r}: expected a plain folder name")
        self.folder = os.path.abspath(folder) if folder is not None else None

    def bind(self, output: str) -> None:
        if self.folder is None:
            self.folder = os.path.join(output, DEDUP_DIR, self.dedup)

    def work(self) -> Path:
        if self.folder is None:
            raise ValueError(
                f"{self.name}: no work folder: give folder=... or run the step in a Pipeline "
                "(the folder is then <output>/dedup/<dedup>)"
            )
        return Path(self.folder)


class _FirstStage(DedupStep):
    """Passes documents on; ``_stream`` is the dedup's first-stage generator; ``ids`` writes the id hashes."""

    ids = True

    def _stream(self, docs: Iterable[Document], folder: Path) -> Iterator[Document]:
        raise NotImplementedError

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        folder = self.work()
        ids: list[int] = []

        def seen() -> Iterator[Document]:
            for d in docs:
                stats.seen(d)
                if self.ids:
                    ids.append(hash64(d.id))
                yield d

        for d in self._stream(seen(), folder):
            stats.kept(d)
            yield d
        if self.ids:
            save_array(folder / "ids" / f"{self.rank:05d}.npy", np.array(ids, dtype=np.uint64))


class _GlobalStage(DedupStep):
    """Reads only the work folder; ``one_task``: the stage must be a single task."""

    one_task = False
    after = ""  # the step whose files it reads (for the error message)

    def _work(self, folder: Path, stats: StepStats) -> None:
        raise NotImplementedError

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        for _ in docs:
            raise ValueError(
                f"{self.name} reads {self.work()}, not documents: give it a [[stage]] of its own, "
                f"after the stage that runs {self.after}"
            )
        if self.one_task and self.world != 1:
            raise ValueError(
                f"{self.name} is one task (it joins every edge), got a stage of {self.world} tasks: "
                "set the stage's tasks = 1"
            )
        self._work(self.work(), stats)
        return
        yield


def removed_ids(folder: str | os.PathLike) -> np.ndarray:
    """Sorted uint64 id hashes of every document listed in ``folder/removed/*.npy`` (nodes -> ``ids/``)."""
    folder = Path(folder)
    files = run_files(folder / "removed")
    if not files:
        raise FileNotFoundError(
            f"{folder / 'removed'}: no removed lists (run the dedup's global stages first)"
        )
    nodes = np.concatenate([load_array(f) for f in files])
    tasks, index = node_task(nodes), node_index(nodes)
    out = []
    for t in np.unique(tasks).tolist():
        path = folder / "ids" / f"{t:05d}.npy"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no document ids for task {t} (its first stage did not write them)"
            )
        ids = load_array(path, mmap=True)
        idx = index[tasks == t].astype(np.int64)
        if len(idx) and idx.max() >= len(ids):
            raise ValueError(
                f"{path}: {len(ids)} documents, but the removed list names index {idx.max()}"
            )
        out.append(np.asarray(ids[idx]))
    return np.unique(np.concatenate(out)) if out else np.empty(0, np.uint64)


class _DropById(DedupStep):
    reason = ""

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        removed = removed_ids(self.work())
        for doc in docs:
            stats.seen(doc)
            h = np.uint64(hash64(doc.id))
            at = int(np.searchsorted(removed, h))
            if at < len(removed) and removed[at] == h:
                stats.drop(doc, self.reason)
                continue
            stats.kept(doc)
            yield doc


# ---- exact documents -------------------------------------------------------------------------------


class ExactHashes(_FirstStage):
    """Exact dedup, stage 1: the hash of each document's normalised text (``hashes/``), passing documents on."""

    name, kind = "exact_hashes", "exact"

    def _stream(self, docs, folder):
        return exact_hash_stream(docs, folder, self.rank)


class ExactDuplicates(_GlobalStage):
    """Exact dedup, stage 2: task ``rank`` of ``world`` merges one slice of the hash space (counter ``removed``)."""

    name, kind, after = "exact_duplicates", "exact", "exact_hashes"

    def _work(self, folder, stats):
        stats.counters["removed"] += exact_duplicates(folder, self.rank, self.world)


class ExactFilter(_DropById):
    """Exact dedup, stage 3: drops every copy but the first ("exact_duplicate")."""

    name, kind, reason = "exact_filter", "exact", "exact_duplicate"


# ---- lines -------------------------------------------------------------------------------------------


class LineCounts(_FirstStage):
    """Line dedup, stage 1: counts each normalised line (``line_counts/``), passing documents on."""

    name, kind, ids = "line_counts", "lines", False

    def _stream(self, docs, folder):
        return line_count_stream(docs, folder, self.rank)


class DuplicateLines(_GlobalStage):
    """Line dedup, stage 2: the lines seen more than once in the corpus, one hash slice per task."""

    name, kind, after = "duplicate_lines", "lines", "line_counts"

    def _work(self, folder, stats):
        stats.counters["duplicate_lines"] += duplicate_lines(folder, self.rank, self.world)


class LineDedupStep(DedupStep):
    """Line dedup, stage 3: removes those lines from every document (:class:`~lmstack.data.dedup.exact.LineDedup`)."""

    name, kind = "line_dedup", "lines"

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        return LineDedup(self.work()).run(docs, stats)


# ---- MinHash -------------------------------------------------------------------------------------------


def load_config(folder: Path) -> MinHashConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no MinHash config (run minhash_signatures in an earlier stage)"
        )
    return MinHashConfig(**json.loads(path.read_text()))


class MinHashSignatures(_FirstStage):
    """MinHash, stage 1: shingle sets and band runs; the MinHashConfig's fields are keyword arguments."""

    name, kind = "minhash_signatures", "minhash"

    def __init__(
        self,
        dedup: str | None = None,
        folder: str | os.PathLike | None = None,
        n_gram: int = 5,
        bands: int = 14,
        rows: int = 8,
        threshold: float = 0.8,
        seed: int = 1,
        max_group: int = 32,
        batch: int = 256,
    ):
        super().__init__(dedup, folder)
        self.config = MinHashConfig(n_gram, bands, rows, threshold, seed, max_group)
        self.batch = batch

    def _stream(self, docs, folder):
        cfg = json.dumps(asdict(self.config), sort_keys=True) + "\n"
        path = folder / "config.json"
        if path.is_file() and path.read_text() != cfg:
            raise ValueError(
                f"{path} holds another MinHash config ({path.read_text().strip()}), this step has "
                f"{cfg.strip()}: use a new dedup name or output folder"
            )
        atomic_write_text(path, cfg)
        return signature_stream(docs, folder, self.rank, self.config, self.batch)


class MinHashBuckets(_GlobalStage):
    """MinHash, stage 2: task ``rank`` merges bands ``rank, rank + world, ...`` (counter ``candidate_pairs``)."""

    name, kind, after = "minhash_buckets", "minhash", "minhash_signatures"

    def __init__(
        self,
        dedup: str | None = None,
        folder: str | os.PathLike | None = None,
        budget: int = 1 << 20,
    ):
        super().__init__(dedup, folder)
        self.budget = budget

    def _work(self, folder, stats):
        stats.counters["candidate_pairs"] += minhash_buckets(
            folder, self.rank, self.world, load_config(folder), budget=self.budget
        )


class MinHashConfirm(_GlobalStage):
    """MinHash, stage 3: the candidate pairs of this task's hash slice with true Jaccard >= τ (``edges``)."""

    name, kind, after = "minhash_confirm", "minhash", "minhash_buckets"

    def _work(self, folder, stats):
        stats.counters["edges"] += minhash_confirm(
            folder, self.rank, self.world, load_config(folder)
        )


class MinHashClusters(_GlobalStage):
    """MinHash, stage 4 (one task): union-find over the edges (counter ``removed``)."""

    name, kind, after, one_task = "minhash_clusters", "minhash", "minhash_confirm", True

    def _work(self, folder, stats):
        stats.counters["removed"] += minhash_clusters(folder, load_config(folder))


class MinHashDedupFilter(_DropById):
    """MinHash, stage 5: drops every member of a cluster but its first ("minhash_duplicate")."""

    name, kind, reason = "minhash_filter", "minhash", "minhash_duplicate"


STEPS: dict[str, type[Step]] = {
    "exact_hashes": ExactHashes,
    "exact_duplicates": ExactDuplicates,
    "exact_filter": ExactFilter,
    "line_counts": LineCounts,
    "duplicate_lines": DuplicateLines,
    "line_dedup": LineDedupStep,
    "minhash_signatures": MinHashSignatures,
    "minhash_buckets": MinHashBuckets,
    "minhash_confirm": MinHashConfirm,
    "minhash_clusters": MinHashClusters,
    "minhash_filter": MinHashDedupFilter,
    "bloom_paragraph_dedup": BloomParagraphDedup,
    "decontaminate": Decontaminate,
}
