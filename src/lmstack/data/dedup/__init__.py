"""Deduplication and decontamination (docs/data.md, "Deduplication").

- ``normalize``: the one text normalisation and the stable hashes every step below shares;
- ``exact``: exact document dedup and corpus-wide exact line dedup (hash runs on disk, a k-way merge);
- ``minhash``: fuzzy dedup, MinHash + LSH in stages (signatures -> buckets -> confirm -> clusters -> filter);
- ``bloom``: one-pass paragraph dedup in fixed memory (a Bloom filter);
- ``decontam``: drop documents sharing a 13-gram with ``lmstack.eval`` task data;
- ``runs``: sorted runs and their streaming merge, ``drop``: the step that drops what a stage listed;
- ``steps``: every stage above as a registered pipeline step (``[[stage]]`` tables in a pipeline TOML).

A stage that sees documents is a function ``(docs, folder, task, ...)``; a stage that only reads earlier
stages' files is ``(folder, task, n_tasks, ...)``; the last stage is a pipeline step.
"""

from lmstack.data.dedup.bloom import BloomFilter, BloomParagraphDedup, bloom_size
from lmstack.data.dedup.decontam import Decontaminate, EvalNgrams
from lmstack.data.dedup.exact import (
    ExactDedupFilter,
    LineDedup,
    duplicate_lines,
    exact_dedup,
    exact_duplicates,
    exact_hashes,
    line_counts,
    line_dedup,
)
from lmstack.data.dedup.minhash import (
    MinHashConfig,
    MinHasher,
    MinHashFilter,
    jaccard,
    minhash_buckets,
    minhash_clusters,
    minhash_confirm,
    minhash_dedup,
    minhash_signatures,
)
from lmstack.data.dedup.normalize import normalize, words
from lmstack.data.dedup.steps import (
    STEPS,
)  # the pipeline's step names (exact_hashes, ..., minhash_filter)

__all__ = [
    "BloomFilter",
    "BloomParagraphDedup",
    "bloom_size",
    "Decontaminate",
    "EvalNgrams",
    "ExactDedupFilter",
    "LineDedup",
    "duplicate_lines",
    "exact_dedup",
    "exact_duplicates",
    "exact_hashes",
    "line_counts",
    "line_dedup",
    "MinHashConfig",
    "MinHasher",
    "MinHashFilter",
    "jaccard",
    "minhash_buckets",
    "minhash_clusters",
    "minhash_confirm",
    "minhash_dedup",
    "minhash_signatures",
    "normalize",
    "words",
    "STEPS",
]
