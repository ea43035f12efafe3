"""Fuzzy deduplication with MinHash and LSH, in stages that run as separate tasks.

**MinHash** (Broder 1997, "On the resemblance and containment of documents"). A document is the set S of
the hashes of its word n-grams (shingles) of normalised text. For a random hash function h,
P[min h(S_A) = min h(S_B)] = J(A, B) = |S_A ∩ S_B| / |S_A ∪ S_B|, so the fraction of k independent functions
whose minima agree estimates the Jaccard similarity with standard error sqrt(J (1 - J) / k).

The k functions are Dietzfelbinger's multiply-add-shift family (Dietzfelbinger 1996, "Universal hashing
and k-wise independent random variables via integer arithmetic without primes"): a shingle's hash gives a
32-bit key x and h_i(x) = ((a_i x + b_i) mod 2^64) >> 32, a_i and b_i 64-bit seeded constants — pairwise
independent, like the textbook (a x + b) mod p with a Mersenne prime p, and exact in numpy's uint64 (the
mod-(2^61 - 1) form needs 125-bit products, which datasketch and datatrove let overflow). A batch of
documents is one (shingles, k) product, reduced per document with ``np.minimum.reduceat``.

**LSH banding** (Leskovec, Rajaraman, Ullman, "Mining of Massive Datasets", ch. 3.4). The k = b r values are
cut into b bands of r rows; two documents are candidates when all r rows of some band agree, which happens
with probability 1 - (1 - s^r)^b for Jaccard s: an S-curve with its steepest rise near (1/b)^(1/r).

Stages (one folder; each stage reads what the previous ones wrote there):

1. :func:`minhash_signatures` — one task per input shard: the shingle sets (``shingles/``, to confirm
   candidates later) and, per band, the sorted run of (band hash, node) (``buckets/band_XXX/``).
2. :func:`minhash_buckets` — one task per band (or several bands per task): the streaming k-way merge of the
   band's runs (``runs.merge_runs``: a block per run in memory, never a dict of the corpus); each group of
   equal band hashes gives candidate pairs -> ``pairs/XXXXX.npy`` (one file per task).
3. :func:`minhash_confirm` — any number of tasks, each a hash slice of the pairs: the pair's true Jaccard
   similarity on the stored shingle sets; pairs with J >= τ are edges -> ``edges/XXXXX.npy``.
4. :func:`minhash_clusters` — one task: union-find over the edges (Tarjan 1975, union by smaller root,
   path halving); each cluster's smallest node — its first document in (shard, index) order — survives,
   the rest -> ``removed/00000.npy`` (``clusters.npy`` keeps node -> survivor).
5. :class:`MinHashFilter` — one task per input shard: drops the listed documents ("minhash_duplicate").

Memory: stage 1 holds one shard's band hashes (b x 8 bytes a document); stages 2-4 hold one block per run
plus the candidate pairs and edges — they grow with the duplicates, not with the corpus.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import numpy as np

from lmstack.data.dedup.drop import DropListed
from lmstack.data.dedup.normalize import (
    WordHasher,
    _constants,
    mix64,
    ngram_hashes,
    sorted_unique,
    words,
)
from lmstack.data.dedup.runs import (
    group_starts,
    load_array,
    merge_runs,
    node,
    run_files,
    save_array,
    save_removed,
    write_run,
)
from lmstack.data.document import Document
from lmstack.utils import atomic_path

PAIR = np.dtype([("a", "<u8"), ("b", "<u8")])  # a < b
EDGE = np.dtype([("a", "<u8"), ("b", "<u8"), ("jaccard", "<f8")])
_ROWS_PER_PRODUCT = (
    2048  # shingles per (rows, k) product: 2048 x 112 x 8 bytes = 1.8 MB, about an L2 cache
)


@dataclass(frozen=True)
class MinHashConfig:
    """``n_gram`` words per shingle, ``bands`` x ``rows`` = k hash functions, ``threshold`` τ on the true
    Jaccard similarity of confirmed pairs, ``seed`` of the hash functions (every task must use the same),
    ``max_group``: a band bucket of up to this many documents gives all its pairs, a larger one only each
    member with the bucket's first and with its predecessor (a star and a chain: the same clusters when the
    bucket's documents are near-copies, without a quadratic number of pairs)."""

    n_gram: int = 5
    bands: int = 14
    rows: int = 8
    threshold: float = 0.8
    seed: int = 1
    max_group: int = 32

    def __post_init__(self):
        for name in ("n_gram", "bands", "rows", "max_group"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MinHashConfig.{name}={v!r} must be a positive integer")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"MinHashConfig.threshold={self.threshold!r} must be in (0, 1]")

    @property
    def k(self) -> int:
        return self.bands * self.rows

    def candidate_probability(self, s):
        """P[a pair of Jaccard s shares a band] = 1 - (1 - s^r)^b (Mining of Massive Datasets, 3.4.2)."""
        return 1.0 - (1.0 - np.asarray(s, dtype=np.float64) ** self.rows) ** self.bands


class MinHasher:
    """Shingles and MinHash signatures for one :class:`MinHashConfig`."""

    def __init__(self, config: MinHashConfig | None = None):
        self.config = config or MinHashConfig()
        k, seed = self.config.k, self.config.seed
        self.a = _constants(f"minhash-a:{seed}", k)  # (k,) odd 64-bit multipliers
        self.b = _constants(f"minhash-b:{seed}", k)  # (k,) 64-bit offsets
        self.band_mult = _constants(f"minhash-band:{seed}", self.config.rows)  # (r,)
        self.word_hashes = WordHasher()

    def shingles(self, text: str) -> np.ndarray:
        """The document's shingle set: sorted unique uint64 hashes of its normalised word n-grams (a text of
        fewer than n words is one shingle; an empty one has none)."""
        return sorted_unique(ngram_hashes(self.word_hashes(words(text)), self.config.n_gram))

    def signatures(self, sets: Sequence[np.ndarray]) -> np.ndarray:
        """(len(sets), k) uint32: each shingle set's k minima. An empty set gets all 0xFFFFFFFF."""
        k = self.config.k
        out = np.full((len(sets), k), np.iinfo(np.uint64).max, dtype=np.uint64)
        sizes = np.fromiter((len(s) for s in sets), dtype=np.int64, count=len(sets))
        nonempty = np.flatnonzero(sizes)
        if len(nonempty):
            x = np.concatenate([sets[i] for i in nonempty]) >> np.uint64(32)  # (N,) 32-bit keys
            ends = np.cumsum(sizes[nonempty])
            starts = ends - sizes[nonempty]
            buf = np.empty((min(_ROWS_PER_PRODUCT, len(x)), k), dtype=np.uint64)
            d = 0  # documents are taken in chunks of about _ROWS_PER_PRODUCT shingles; a longer one alone, in parts
            while d < len(nonempty):
                e = int(np.searchsorted(ends, starts[d] + _ROWS_PER_PRODUCT, "right"))
                e = max(e, d + 1)
                lo, hi = int(starts[d]), int(ends[e - 1])
                acc = None
                for s in range(lo, hi, buf.shape[0]):
                    rows = buf[: min(buf.shape[0], hi - s)]
                    np.multiply(
                        x[s : s + len(rows), None], self.a, out=rows
                    )  # (rows, k) a_i x mod 2^64
                    rows += self.b
                    if e == d + 1:  # one document in parts
                        part = rows.min(axis=0)
                        acc = part if acc is None else np.minimum(acc, part)
                    else:
                        acc = np.minimum.reduceat(rows, starts[d:e] - lo, axis=0)  # (docs, k)
                out[nonempty[d:e]] = acc
                d = e
        return (out >> np.uint64(32)).astype(np.uint32)

    def band_hashes(self, sigs: np.ndarray) -> np.ndarray:
        """(n, b) uint64: one hash per band of r rows of the (n, k) signatures."""
        n = len(sigs)
        bands = sigs.reshape(n, self.config.bands, self.config.rows).astype(np.uint64)  # (n, b, r)
        return mix64((bands * self.band_mult).sum(axis=2, dtype=np.uint64))

    @staticmethod
    def estimate(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
        """The MinHash estimate of the Jaccard similarity: the fraction of equal minima."""
        return float(np.mean(np.asarray(sig_a) == np.asarray(sig_b)))


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """|A ∩ B| / |A ∪ B| of two sorted unique arrays (0 for two empty sets)."""
    if len(a) == 0 or len(b) == 0:
        return 0.0
    if len(a) > len(b):
        a, b = b, a
    at = np.minimum(np.searchsorted(b, a), len(b) - 1)
    inter = int(np.count_nonzero(b[at] == a))
    return inter / (len(a) + len(b) - inter)


# ---- stage 1: signatures -----------------------------------------------------------------------


def _band_dir(folder: Path, band: int) -> Path:
    return folder / "buckets" / f"band_{band:03d}"


def minhash_signatures(
    docs: Iterable[Document],
    folder: str | os.PathLike,
    task: int,
    config: MinHashConfig | None = None,
    batch: int = 256,
) -> int:
    """Stage 1 for input shard ``task``: ``shingles/{task}.u64`` + ``.offsets.npy`` (document i's set is
    ``u64[offsets[i]:offsets[i+1]]``) and one run ``buckets/band_XXX/{task}.npy`` per band. Documents without
    a word have no signature (they are never fuzzy duplicates). Returns the number of documents."""
    return sum(1 for _ in signature_stream(docs, folder, task, config, batch))


def signature_stream(
    docs: Iterable[Document],
    folder: str | os.PathLike,
    task: int,
    config: MinHashConfig | None = None,
    batch: int = 256,
) -> Iterator[Document]:
    """Stage 1 as a pass-through: yields every document on; the files are complete when the stream ends."""
    hasher = MinHasher(config)
    folder = Path(folder)
    offsets = [0]
    bands, nodes = [], []
    with atomic_path(folder / "shingles" / f"{task:05d}.u64") as tmp, open(tmp, "wb") as f:
        pending: list[np.ndarray] = []

        def flush():
            sigs = hasher.signatures(pending)
            keep = np.fromiter((len(s) > 0 for s in pending), dtype=bool, count=len(pending))
            first = len(offsets) - 1 - len(pending)
            bands.append(hasher.band_hashes(sigs[keep]))
            nodes.append(node(task, first + np.flatnonzero(keep)))
            pending.clear()

        for doc in docs:
            s = hasher.shingles(doc.text)
            f.write(s.tobytes())
            offsets.append(offsets[-1] + len(s))
            pending.append(s)
            if len(pending) == batch:
                flush()
            yield doc
        if pending:
            flush()
    save_array(folder / "shingles" / f"{task:05d}.offsets.npy", np.array(offsets, dtype=np.int64))
    keys = (
        np.concatenate(bands) if bands else np.empty((0, hasher.config.bands), np.uint64)
    )  # (n, b)
    vals = np.concatenate(nodes) if nodes else np.empty(0, np.uint64)
    for band in range(hasher.config.bands):
        write_run(_band_dir(folder, band) / f"{task:05d}.npy", keys[:, band], vals)


# ---- stage 2: buckets -> candidate pairs --------------------------------------------------------


def _bucket_pairs(keys: np.ndarray, nodes: np.ndarray, max_group: int) -> np.ndarray:
    """Candidate pairs (a < b) of one merged block: (key, node)-sorted, so each group's nodes ascend."""
    starts = group_starts(keys)
    sizes = np.diff(np.append(starts, len(keys)))
    multi = sizes > 1
    if not multi.any():
        return np.empty(0, PAIR)
    first = np.repeat(starts, sizes)  # (n,) the start of each element's group
    member = np.arange(len(keys)) != first
    star_a, star_b = nodes[first[member]], nodes[member]  # every member with its group's first
    chain = member & (
        np.arange(len(keys)) - 1 != first
    )  # ... and with its predecessor (if not the first)
    chain_a, chain_b = nodes[np.flatnonzero(chain) - 1], nodes[chain]
    extra_a, extra_b = [], []
    mid = multi & (sizes > 3) & (sizes <= max_group)  # size 2 and 3: star + chain are all the pairs
    for s, g in zip(starts[mid], sizes[mid]):
        for i, j in combinations(
            range(s + 1, s + g), 2
        ):  # star + chain already hold (s, .) and (j-1, j)
            if j != i + 1:
                extra_a.append(nodes[i])
                extra_b.append(nodes[j])
    pairs = np.empty(len(star_a) + len(chain_a) + len(extra_a), PAIR)
    pairs["a"] = np.concatenate([star_a, chain_a, np.array(extra_a, np.uint64)])
    pairs["b"] = np.concatenate([star_b, chain_b, np.array(extra_b, np.uint64)])
    return pairs


def minhash_buckets(
    folder: str | os.PathLike,
    task: int = 0,
    n_tasks: int = 1,
    config: MinHashConfig | None = None,
    budget: int = 1 << 20,
    block: int | None = None,
) -> int:
    """Stage 2, task ``task`` of ``n_tasks``: bands ``task, task + n_tasks, ...``; for each, merge the runs of
    all shards (``budget`` records in memory, see ``runs.merge_runs``); the candidate pairs of their buckets,
    without repeats -> ``pairs/{task}.npy``. Returns their number."""
    config = config or MinHashConfig()
    folder = Path(folder)
    found = [
        _bucket_pairs(k, v, config.max_group)
        for band in range(task, config.bands, n_tasks)
        for k, v in merge_runs(run_files(_band_dir(folder, band)), budget=budget, block=block)
    ]
    pairs = np.unique(np.concatenate(found)) if found else np.empty(0, PAIR)
    save_array(folder / "pairs" / f"{task:05d}.npy", pairs)
    return len(pairs)


# ---- stage 3: confirm by true Jaccard ------------------------------------------------------------


class ShingleStore:
    """Read-only access to the shingle sets stage 1 wrote: ``store[node]`` -> sorted uint64 array."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder) / "shingles"
        self._open: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _task(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        if task in self._open:
            return self._open[task]
        data = self.folder / f"{task:05d}.u64"
        offsets = load_array(self.folder / f"{task:05d}.offsets.npy", mmap=True)
        if not data.is_file():
            raise FileNotFoundError(
                f"{data}: no shingles for task {task} (did minhash_signatures run for it?)"
            )
        values = (
            np.memmap(data, dtype=np.uint64, mode="r") if offsets[-1] else np.empty(0, np.uint64)
        )
        self._open[task] = values, offsets
        return values, offsets

    def __getitem__(self, nd: int) -> np.ndarray:
        nd = int(nd)
        values, offsets = self._task(nd >> 32)
        i = nd & 0xFFFFFFFF
        return values[offsets[i] : offsets[i + 1]]


def _pair_part(pairs: np.ndarray, parts: int) -> np.ndarray:
    return (mix64(pairs["a"] ^ mix64(pairs["b"])) % np.uint64(parts)).astype(np.int64)


def minhash_confirm(
    folder: str | os.PathLike, task: int = 0, n_tasks: int = 1, config: MinHashConfig | None = None
) -> int:
    """Stage 3, task ``task`` of ``n_tasks``: of all bands' candidate pairs, those hashing to this task, kept
    when their true Jaccard similarity is >= τ -> ``edges/{task}.npy``. Returns the number of edges."""
    config = config or MinHashConfig()
    folder = Path(folder)
    found = [load_array(f) for f in run_files(folder / "pairs")]
    pairs = np.unique(np.concatenate(found)) if found else np.empty(0, PAIR)
    pairs = pairs[_pair_part(pairs, n_tasks) == task]
    store = ShingleStore(folder)
    sims = np.array(
        [jaccard(store[a], store[b]) for a, b in zip(pairs["a"].tolist(), pairs["b"].tolist())],
        dtype=np.float64,
    )
    keep = sims >= config.threshold
    edges = np.empty(int(keep.sum()), EDGE)
    edges["a"], edges["b"], edges["jaccard"] = pairs["a"][keep], pairs["b"][keep], sims[keep]
    save_array(folder / "edges" / f"{task:05d}.npy", edges)
    return len(edges)


# ---- stage 4: clusters ----------------------------------------------------------------------------


def union_find(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(n,) the root of each of n items after joining the pairs (a[i], b[i]); the root of a set is its
    smallest item (union by smaller root, path halving: Tarjan & van Leeuwen 1984)."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for x, y in zip(a.tolist(), b.tolist()):
        rx, ry = find(x), find(y)
        if rx != ry:
            if rx < ry:
                parent[ry] = rx
            else:
                parent[rx] = ry
    return np.array([find(x) for x in range(n)], dtype=np.int64)


def minhash_clusters(folder: str | os.PathLike, config: MinHashConfig | None = None) -> int:
    """Stage 4 (one task): clusters of the confirmed edges; every node but each cluster's smallest ->
    ``removed/00000.npy``; ``clusters.npy`` holds (node, survivor) for every node in a cluster. Returns the
    number removed."""
    folder = Path(folder)
    found = [load_array(f) for f in run_files(folder / "edges")]
    edges = np.concatenate(found) if found else np.empty(0, EDGE)
    nodes, inv = np.unique(
        np.concatenate([edges["a"], edges["b"]]), return_inverse=True
    )  # sorted nodes
    root = union_find(len(nodes), inv[: len(edges)], inv[len(edges) :])
    clusters = np.empty(len(nodes), PAIR)
    clusters["a"], clusters["b"] = nodes, nodes[root]
    save_array(folder / "clusters.npy", clusters)
    removed = nodes[root != np.arange(len(nodes))]
    save_removed(folder, 0, removed)
    return len(removed)


def load_clusters(folder: str | os.PathLike) -> dict[int, list[int]]:
    """survivor node -> sorted member nodes (the survivor first), from ``clusters.npy``."""
    c = load_array(Path(folder) / "clusters.npy")
    out: dict[int, list[int]] = {}
    for nd, root in zip(c["a"].tolist(), c["b"].tolist()):
        out.setdefault(root, []).append(nd)
    return out


# ---- stage 5: filter ----------------------------------------------------------------------------


class MinHashFilter(DropListed):
    """Stage 5: drops the documents of task ``task`` that :func:`minhash_clusters` listed
    ("minhash_duplicate")."""

    def __init__(self, folder: str | os.PathLike, task: int):
        super().__init__(folder, task, "minhash_duplicate")


def minhash_dedup(
    shards: Sequence[Iterable[Document]],
    folder: str | os.PathLike,
    config: MinHashConfig | None = None,
) -> list[list[Document]]:
    """All five stages in this process, one shard after another (what the pipeline runs as separate tasks):
    the surviving documents of each shard. ``shards`` must be re-iterable (lists)."""
    config = config or MinHashConfig()
    for t, docs in enumerate(shards):
        minhash_signatures(docs, folder, t, config)
    minhash_buckets(folder, 0, 1, config)
    minhash_confirm(folder, 0, 1, config)
    minhash_clusters(folder, config)
    return [list(MinHashFilter(folder, t)(docs)) for t, docs in enumerate(shards)]
