"""Paragraph dedup in one pass and fixed memory: a Bloom filter of the paragraphs seen so far.

A Bloom filter (Bloom 1970, "Space/time trade-offs in hash coding with allowable errors") is an m-bit array
and k hash functions; an item sets its k bits, and an item is "seen" when all its k bits are set. It never
misses an item it holds; an item it does not hold is reported seen with probability
(1 - e^(-k n / m))^k after n insertions. For n items and a target false-positive rate p the smallest m and
its best k are

    m = -n ln p / (ln 2)^2        k = (m / n) ln 2

(about 9.6 bits and 7 hashes per item for p = 1%). The k positions come from two hashes, g_i = h1 + i h2
mod m (Kirsch & Mitzenmacher 2006, "Less hashing, same performance: building a better Bloom filter").

:class:`BloomParagraphDedup` keeps the first occurrence of each paragraph (a block of text between blank
lines, compared after ``normalize``) and removes the later ones, in stream order, with memory fixed by
(n, p) whatever the corpus size — for corpora whose exact line counts would not fit on disk or in a merge.
Its filter is per process: run it as one task (or accept that copies in different tasks survive). A false
positive removes a paragraph that was new, at rate ≈ p.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Iterator

import numpy as np

from lmstack.data.dedup.normalize import hash64, mix64, normalize
from lmstack.data.dedup.runs import load_array, save_array
from lmstack.data.document import Document
from lmstack.data.step import Step, StepStats

_SECOND = np.uint64(0x9E3779B97F4A7C15)


def bloom_size(n: int, p: float) -> tuple[int, int]:
    """(m bits, k hashes) for ``n`` items at false-positive rate ``p``: m = ceil(-n ln p / (ln 2)^2),
    k = max(1, round(m / n ln 2))."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} (expected items) must be a positive integer")
    if not 0.0 < p < 1.0:
        raise ValueError(f"p={p!r} (false-positive rate) must be in (0, 1)")
    m = math.ceil(-n * math.log(p) / math.log(2) ** 2)
    return m, max(1, round(m / n * math.log(2)))


class BloomFilter:
    """A Bloom filter of 64-bit item hashes over a numpy bit array (``bits``: ceil(m / 64) uint64 words)."""

    def __init__(self, n: int, p: float = 0.01):
        self.n, self.p = n, p
        self.m, self.k = bloom_size(n, p)
        self.bits = np.zeros((self.m + 63) // 64, dtype=np.uint64)

    def _positions(self, items: np.ndarray) -> np.ndarray:
        """(N, k) bit positions of N item hashes."""
        h = np.asarray(items, dtype=np.uint64)
        h1 = mix64(h)
        h2 = mix64(h ^ _SECOND) | np.uint64(1)
        i = np.arange(self.k, dtype=np.uint64)
        return (h1[:, None] + i * h2[:, None]) % np.uint64(
            self.m
        )  # (N, k), wraps mod 2^64 before mod m

    def _test(self, pos: np.ndarray) -> np.ndarray:
        word, bit = pos >> np.uint64(6), pos & np.uint64(63)
        return ((self.bits[word] >> bit) & np.uint64(1)).astype(bool).all(axis=1)

    def contains(self, items: np.ndarray) -> np.ndarray:
        """(N,) bool: each item's k bits are all set."""
        return self._test(self._positions(items))

    def add(self, items: np.ndarray) -> np.ndarray:
        """Insert the items in order; (N,) bool: whether each was already seen (by the filter before this call,
        or as an equal hash earlier in ``items``)."""
        items = np.asarray(items, dtype=np.uint64)
        pos = self._positions(items)
        seen = self._test(pos)
        _, first = np.unique(items, return_index=True)
        repeat = np.ones(len(items), dtype=bool)
        repeat[first] = False
        flat = pos.ravel()
        np.bitwise_or.at(self.bits, flat >> np.uint64(6), np.uint64(1) << (flat & np.uint64(63)))
        return seen | repeat

    def fill_ratio(self) -> float:
        """The fraction of bits set."""
        return float(np.unpackbits(self.bits.view(np.uint8)).sum()) / (len(self.bits) * 64)

    def save(self, path: str | os.PathLike) -> None:
        save_array(path, np.concatenate([np.array([self.n, self.m, self.k], np.uint64), self.bits]))

    @classmethod
    def load(cls, path: str | os.PathLike, p: float = 0.01) -> BloomFilter:
        arr = load_array(path)
        f = cls(int(arr[0]), p)
        if (f.m, f.k) != (int(arr[1]), int(arr[2])):
            raise ValueError(
                f"{path}: a filter of m={int(arr[1])}, k={int(arr[2])} bits; "
                f"n={f.n}, p={p} gives m={f.m}, k={f.k}: pass the p it was made with"
            )
        f.bits = arr[3:].copy()
        return f


_BLANK = re.compile(
    r"(\n[ \t\r\f\v]*\n\s*)"
)  # a blank line (and the whitespace around it) ends a paragraph


class BloomParagraphDedup(Step):
    """Removes each paragraph whose normalised text the filter has seen (counter "paragraphs_removed");
    drops a document left with no paragraph that has a word ("duplicate_paragraphs_only"). Paragraphs that
    normalise to nothing are kept and never inserted. ``n``: the paragraphs expected, ``p``: the false-positive
    rate."""

    def __init__(self, n: int = 10_000_000, p: float = 0.001):
        self.filter = BloomFilter(n, p)

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        for doc in docs:
            stats.seen(doc)
            parts = _BLANK.split(doc.text)  # paragraph, separator, paragraph, ...
            paras = parts[0::2]
            normed = [normalize(p) for p in paras]
            has = np.array([bool(s) for s in normed], dtype=bool)
            dup = np.zeros(len(paras), dtype=bool)
            if has.any():
                keys = np.array([hash64(s) for s, h in zip(normed, has) if h], dtype=np.uint64)
                dup[has] = self.filter.add(keys)
            n_dup = int(dup.sum())
            if n_dup == 0:
                stats.kept(doc)
                yield doc
                continue
            stats.counters["paragraphs_removed"] += n_dup
            if not (has & ~dup).any():
                stats.drop(doc, "duplicate_paragraphs_only")
                continue
            out, sep = [], ""
            for i, para in enumerate(paras):
                if not dup[i]:
                    out.append(sep + para if out else para)
                sep = parts[2 * i + 1] if 2 * i + 1 < len(parts) else ""
            yield_doc = Document("".join(out), doc.id, doc.metadata)
            stats.kept(yield_doc)
            yield yield_doc
