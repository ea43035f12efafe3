"""Decontamination: drop training documents that share a 13-gram with evaluation data.

The GPT-3 report's rule (Brown et al. 2020, "Language Models are Few-Shot Learners", appendix C): a training
document that shares any 13 consecutive normalised words with an evaluation item is taken out. Here the
words are ``normalize.words`` (the dedup steps' one normalisation) and the 13-grams are compared by their
64-bit hashes (``ngram_hashes``), held as one sorted array: memory is 8 bytes per distinct evaluation 13-gram.

The evaluation texts come from ``lmstack.eval``: task files (``.yaml``/``.jsonl``, ``eval.tasks.load_task``),
each item's rendered prompt followed by its gold answer; and, with ``builtin``, the sets ``lmstack eval
make-data`` builds (``eval.datasets``: the docstring multiple-choice items with their answers and the
held-out standard-library text). An item shorter than 13 words has no 13-gram and cannot flag anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from lmstack.data.dedup.normalize import WordHasher, ngram_hashes, words
from lmstack.data.document import Document
from lmstack.data.step import Filter


def task_texts(paths: Sequence[str | os.PathLike]) -> Iterator[str]:
    """Each item of each task file as the text a model is shown: its prompt, the delimiter, its gold answer."""
    from lmstack.eval.tasks import (
        load_task,
    )  # here: lmstack.eval imports torch, which dedup's other steps do not need

    for path in paths:
        task = load_task(path)
        for item in task.items:
            yield item.context + task.target_delimiter + item.target()


def builtin_texts() -> Iterator[str]:
    """The texts of ``lmstack eval make-data``'s sets, generated here as that command generates them."""
    from lmstack.eval.datasets import stdlib_docstring_mc, stdlib_heldout_text

    for item in stdlib_docstring_mc():
        yield f"{item['docstring']} {item['choices'][item['answer']]}"
    yield stdlib_heldout_text()[0]


class EvalNgrams:
    """The sorted (G,) uint64 hashes of every n-gram of the evaluation texts."""

    def __init__(self, texts: Iterable[str], n: int = 13):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r} must be a positive integer")
        self.n = n
        self.word_hashes = WordHasher()
        parts = [self.ngrams(t) for t in texts]
        self.hashes = np.unique(np.concatenate(parts)) if parts else np.empty(0, np.uint64)
        self.texts = len(parts)

    @classmethod
    def from_eval(
        cls, tasks: Sequence[str | os.PathLike] = (), builtin: bool = True, n: int = 13
    ) -> EvalNgrams:
        """From task files and (``builtin``) the built-in evaluation sets."""
        texts = list(task_texts(tasks))
        if builtin:
            texts += list(builtin_texts())
        return cls(texts, n)

    def ngrams(self, text: str) -> np.ndarray:
        """The hashes of a text's normalised word n-grams (none when shorter than n words)."""
        return ngram_hashes(self.word_hashes(words(text)), self.n, short=False)

    def overlaps(self, text: str) -> int:
        """How many of the text's n-grams (with repeats) are evaluation n-grams."""
        g, h = self.ngrams(text), self.hashes
        if len(g) == 0 or len(h) == 0:
            return 0
        at = np.minimum(np.searchsorted(h, g), len(h) - 1)
        return int(np.count_nonzero(h[at] == g))


class Decontaminate(Filter):
    """Drops a document sharing any n-gram with the evaluation data ("eval_contamination")."""

    def __init__(
        self,
        ngrams: EvalNgrams | None = None,
        tasks: Sequence[str | os.PathLike] = (),
        builtin: bool = True,
        n: int = 13,
    ):
        self.ngrams = ngrams if ngrams is not None else EvalNgrams.from_eval(tasks, builtin, n)

    def reason(self, doc: Document) -> str | None:
        return "eval_contamination" if self.ngrams.overlaps(doc.text) else None
