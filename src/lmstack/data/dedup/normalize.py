"""The one text normalisation and the stable hashes every dedup step shares.

``normalize`` is what two texts must agree on to count as the same: lower-cased, accents stripped (NFD,
then the combining marks dropped), punctuation and symbols turned into spaces, whitespace collapsed
(the normalisation of the GPT-3 report's overlap test and of datatrove's ``simplify_text``, without
datatrove's number folding). Words are the runs of letters and digits that are left.

Hashes are blake2b (stable across processes, machines and Python's hash seed: every task of a stage must
hash the same text to the same value). Word n-gram hashes are built from per-word hashes with numpy, so a
document costs one dictionary look-up per word, not one string hash per n-gram.
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata

import numpy as np
import regex

_WORD = re.compile(
    r"[^\W_]+"
)  # letters and digits (str.isalnum), as lmstack.eval.contamination's words
_MASK64 = (1 << 64) - 1


_ASCII_SPACES = str.maketrans(
    {c: " " for c in map(chr, range(128)) if not (c.isascii() and c.isalnum())}
)
_MARKS = regex.compile(r"\p{Mn}+")  # combining marks (accents once NFD has split them off)


def words(text: str) -> list[str]:
    """The normalised words of ``text`` (see :func:`normalize`)."""
    text = text.lower()
    if (
        text.isascii()
    ):  # the common case: NFD of ASCII is itself, and str.translate + split is 3x findall
        return text.translate(_ASCII_SPACES).split()
    return _WORD.findall(_MARKS.sub("", unicodedata.normalize("NFD", text)))


def normalize(text: str) -> str:
    """Lower-cased, NFD accents stripped, punctuation/symbols -> spaces, whitespace collapsed and trimmed.

    >>> normalize("  Crème   Brûlée, s'il vous plaît!\\n")
    'creme brulee s il vous plait'
    """
    return " ".join(words(text))


def hash64(data: str | bytes) -> int:
    """A stable 64-bit hash (blake2b, 8 bytes, little-endian) of a string's UTF-8 bytes or of bytes."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _constants(tag: str, n: int) -> np.ndarray:
    """``n`` odd 64-bit constants derived from ``tag`` by blake2b (the same on every machine and numpy)."""
    return np.array([hash64(f"{tag}:{i}") | 1 for i in range(n)], dtype=np.uint64)


def mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser (Steele, Lea, Flood 2014, "Fast splittable pseudorandom number generators"),
    elementwise on uint64: spreads every input bit over every output bit. Returns a new array."""
    x = x ^ (x >> np.uint64(30))
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


class WordHasher:
    """Stable 63-bit hashes of words (uint64 arrays), cached (a corpus repeats its words; the cache is cleared
    when it holds ``max_cache`` words, so its memory is bounded whatever the corpus size)."""

    def __init__(self, max_cache: int = 1 << 19):
        self.cache: dict[str, int] = {}
        self.max_cache = max_cache

    def __call__(self, ws: list[str]) -> np.ndarray:
        """(W,) uint64: the top 63 bits of each word's :func:`hash64`."""
        cache = self.cache
        vals = list(map(cache.get, ws))
        if None in vals:  # hash the new words once each, then look everything up again
            missing = set(ws).difference(cache)
            if len(cache) + len(missing) > self.max_cache:
                cache.clear()
                missing = set(ws)
            for w in missing:
                cache[w] = hash64(w) >> 1  # 63 bits: numpy converts ints below 2^63 fastest
            vals = list(map(cache.__getitem__, ws))
        return np.fromiter(vals, dtype=np.int64, count=len(vals)).view(np.uint64)


@functools.cache
def _ngram_constants(n: int) -> np.ndarray:
    return _constants("ngram", n)


def ngram_hashes(word_hashes: np.ndarray, n: int, short: bool = True) -> np.ndarray:
    """(max(W - n + 1, 0),) uint64 hashes of the word n-grams, in order (not deduplicated).

    The n-gram at i hashes to ``mix64(sum_j C_j * w[i + j] mod 2^64)``, C_j fixed odd constants: order
    matters, and two n-grams that differ in any word differ before the mixing. With ``short`` a text of
    1..n-1 words gives one n-gram of all its words (so a short document still has a shingle)."""
    W = len(word_hashes)
    if W < n:
        if not short or W == 0:
            return np.empty(0, dtype=np.uint64)
        n = W
    c = _ngram_constants(n)
    G = W - n + 1
    acc = word_hashes[:G] * c[0]
    for j in range(1, n):
        acc += word_hashes[j : j + G] * c[j]
    return mix64(acc)


def sorted_unique(x: np.ndarray) -> np.ndarray:
    """``np.unique`` of a 1-d array by one sort (numpy 2's hash-based unique is slower on these sizes)."""
    x = np.sort(x)
    if len(x) > 1:
        x = x[np.concatenate(([True], x[1:] != x[:-1]))]
    return x


def text_hash(text: str) -> int:
    """The hash of a text's normalised form: two texts that normalise alike hash alike."""
    return hash64(normalize(text))
