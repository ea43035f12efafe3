"""Train–test contamination (CS336 notes "基准测试": overlap between training and evaluation data).

- **Exchangeability test** (Oren et al. 2023, "Proving Test Set Contamination in Black Box Language
  Models"): if a model never saw a benchmark, the benchmark's examples are exchangeable, so the
  log-likelihood of their concatenation in the published (canonical) order is just one draw among the
  permuted orders. A model trained on the file in that order prefers it. Permutation test: one-sided
  p = (1 + #{permutations with log-likelihood >= canonical}) / (1 + m), exact under exchangeability.
  Sharded test (the paper's scalable variant): the examples are cut into ``r`` contiguous shards; in each,
  canonical log-likelihood minus the mean over ``m`` permutations of that shard; a one-sided t-test
  on those ``r`` differences.
- **n-gram overlap** (as the GPT-3 report: 13-grams of lower-cased words without punctuation): an
  evaluation item is flagged when any of its n-grams occurs in the training corpus; flags per item and a
  re-score of a task's results on the clean subset.

A concatenation longer than the model's context is scored in strided windows (``perplexity.windows``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from lmstack.eval.perplexity import windows
from lmstack.eval.scoring import score_rows
from lmstack.tokenizer import open_tokens

# ---- exchangeability ---------------------------------------------------------------------------


def sequence_loglik_batch(
    model, seqs: list[list[int]], max_length: int | None = None
) -> list[float]:
    """Total log-likelihood of each token sequence (tokens 1.. given the ones before; strided windows
    with stride max_length/2 when a sequence is longer than the context), batched."""
    L = int(max_length or model.config.max_seq_len)
    rows, starts, owner = [], [], []
    for k, ids in enumerate(seqs):
        for b, e, s in windows(len(ids), min(L, len(ids)), max(1, min(L, len(ids)) // 2)):
            rows.append(ids[b:e])
            starts.append(s)
            owner.append(k)
    scores = score_rows(model, rows, starts)
    out = [0.0] * len(seqs)
    for k, sc in zip(owner, scores):
        out[k] += float(sc.logprobs.sum())
    return out


def _concat(examples: list[list[int]], order, sep: list[int]) -> list[int]:
    out: list[int] = []
    for i in order:
        out += examples[i] + sep
    return out


@dataclass
class ExchangeabilityResult:
    p_value: float  # permutation test
    canonical_loglik: float
    permuted_logliks: list[float]
    n_examples: int
    sharded_p_value: float | None = None  # t-test over shards
    shard_differences: list[float] | None = None

    def to_dict(self) -> dict:
        return {
            "p_value": self.p_value,
            "canonical_loglik": self.canonical_loglik,
            "permuted_mean": float(np.mean(self.permuted_logliks)),
            "n_permutations": len(self.permuted_logliks),
            "n_examples": self.n_examples,
            "sharded_p_value": self.sharded_p_value,
            "shard_differences": self.shard_differences,
        }


def permutation_test(
    model,
    examples: list[list[int]],
    n_permutations: int = 99,
    seed: int = 0,
    sep: Iterable[int] = (),
    max_length: int | None = None,
    batch: int = 8,
    progress: bool = False,
) -> ExchangeabilityResult:
    """One-sided permutation test of the canonical order (``examples`` as token ids, in file order)."""
    from tqdm import tqdm

    if len(examples) < 2:
        raise ValueError(f"{len(examples)} examples: the exchangeability test needs at least 2")
    sep = list(sep)
    rng = np.random.default_rng(seed)
    canon = sequence_loglik_batch(
        model, [_concat(examples, range(len(examples)), sep)], max_length
    )[0]
    perms = [rng.permutation(len(examples)) for _ in range(n_permutations)]
    logliks: list[float] = []
    for i in tqdm(range(0, len(perms), batch), desc="permutations", disable=not progress):
        logliks += sequence_loglik_batch(
            model, [_concat(examples, p, sep) for p in perms[i : i + batch]], max_length
        )
    p = (1 + sum(x >= canon for x in logliks)) / (1 + len(logliks))
    return ExchangeabilityResult(p, canon, logliks, len(examples))


def sharded_test(
    model,
    examples: list[list[int]],
    n_shards: int,
    n_permutations: int = 10,
    seed: int = 0,
    sep: Iterable[int] = (),
    max_length: int | None = None,
    progress: bool = False,
) -> tuple[float, list[float]]:
    """The sharded likelihood comparison: (one-sided t-test p-value, per-shard canonical - mean permuted)."""
    from tqdm import tqdm

    try:
        from scipy import stats
    except ImportError:
        raise ValueError(
            "the sharded test's t-test needs scipy: pip install 'lmstack[eval]'"
        ) from None
    if not (2 <= n_shards <= len(examples) // 2):
        raise ValueError(
            f"n_shards={n_shards} must be in 2..{len(examples) // 2} (each shard needs >= 2 examples)"
        )
    sep = list(sep)
    rng = np.random.default_rng(seed)
    diffs = []
    for shard in tqdm(
        np.array_split(np.arange(len(examples)), n_shards), desc="shards", disable=not progress
    ):
        ex = [examples[i] for i in shard]
        seqs = [_concat(ex, range(len(ex)), sep)] + [
            _concat(ex, rng.permutation(len(ex)), sep) for _ in range(n_permutations)
        ]
        ll = sequence_loglik_batch(model, seqs, max_length)
        diffs.append(ll[0] - float(np.mean(ll[1:])))
    if np.allclose(diffs, diffs[0]):
        return (0.5 if diffs[0] == 0 else float(diffs[0] < 0)), diffs
    return float(stats.ttest_1samp(diffs, 0.0, alternative="greater").pvalue), diffs


# ---- n-gram overlap ----------------------------------------------------------------------------

_WORD = re.compile(r"[^\W_]+", re.UNICODE)


def normalize_words(text: str) -> list[str]:
    """Lower-cased words, punctuation and whitespace dropped (GPT-3's normalisation for the overlap test)."""
    return _WORD.findall(text.lower())


def ngrams(seq, n: int) -> Iterator[tuple]:
    for i in range(len(seq) - n + 1):
        yield tuple(seq[i : i + n])


@dataclass
class OverlapResult:
    n: int
    flags: list[bool | None]  # per item: an n-gram of it occurs in the corpus; None: shorter than n
    overlap_fraction: list[float]  # per item: fraction of its n-grams found in the corpus

    @property
    def contaminated(self) -> int:
        return sum(f is True for f in self.flags)

    def to_dict(self) -> dict:
        return {
            "n": self.n,
            "items": len(self.flags),
            "contaminated": self.contaminated,
            "too_short": sum(f is None for f in self.flags),
            "flags": self.flags,
            "overlap_fraction": self.overlap_fraction,
        }


def ngram_overlap(items: list[list], corpus_chunks: Iterable[list], n: int = 13) -> OverlapResult:
    """Flag each item (a sequence of words or token ids) whose n-grams occur in the corpus.

    The corpus comes as chunks (lists of the same kind of unit) in order; n-grams spanning two chunks
    are seen (the last n-1 units are carried over). Memory: the items' n-grams only."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    wanted: set[tuple] = set()
    for it in items:
        wanted.update(ngrams(list(it), n))
    found: set[tuple] = set()
    tail: list = []
    for chunk in corpus_chunks:
        seq = tail + list(chunk)
        for g in ngrams(seq, n):
            if g in wanted:
                found.add(g)
        tail = seq[-(n - 1) :] if n > 1 else []
    flags: list[bool | None] = []
    frac = []
    for it in items:
        gs = list(ngrams(list(it), n))
        if not gs:
            flags.append(None)
            frac.append(0.0)
            continue
        hit = sum(g in found for g in gs)
        flags.append(hit > 0)
        frac.append(hit / len(gs))
    return OverlapResult(n, flags, frac)


def text_chunks(path, chunk_chars: int = 1 << 20) -> Iterator[list[str]]:
    """A text corpus as lists of normalised words, read a chunk at a time (a word cut at a chunk's
    end is carried to the next)."""
    carry = ""
    with open(path, encoding="utf-8", errors="replace") as f:
        while True:
            block = f.read(chunk_chars)
            if not block:
                break
            text = carry + block
            cut = max(text.rfind(" "), text.rfind("\n"))
            if cut <= 0:
                carry = text
                continue
            carry = text[cut:]
            yield normalize_words(text[:cut])
    if carry:
        yield normalize_words(carry)


def token_chunks(path, chunk: int = 1 << 22) -> Iterator[list[int]]:

    toks = open_tokens(path)
    for i in range(0, len(toks), chunk):
        yield np.asarray(toks[i : i + chunk]).tolist()


def clean_rescore(samples: list[dict], metric_of, flags: list[bool | None]) -> dict:
    """Mean of ``metric_of(sample)`` over all items, the clean ones (flag False) and the flagged ones."""
    vals = np.array([metric_of(s) for s in samples], dtype=np.float64)
    f = np.array([x is True for x in flags])
    clean = np.array([x is False for x in flags])

    def mean(mask):
        return float(vals[mask].mean()) if mask.any() else math.nan

    return {
        "all": float(vals.mean()),
        "clean": mean(clean),
        "contaminated": mean(f),
        "n_clean": int(clean.sum()),
        "n_contaminated": int(f.sum()),
    }
