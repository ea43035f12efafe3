"""The last stage of every cross-corpus dedup: a task drops the documents an earlier stage listed for it.

The earlier stages name documents by node (task, index in the task's stream, see ``runs.node``), so this
step must see the same stream the first stage saw: the same shard read by the same reader, in order.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import numpy as np

from lmstack.data.dedup.runs import load_removed
from lmstack.data.document import Document
from lmstack.data.step import Step, StepStats


class DropListed(Step):
    """Drops document ``i`` of task ``task``'s stream when ``folder/removed/*.npy`` lists it, with ``reason``."""

    def __init__(self, folder: str | os.PathLike, task: int, reason: str):
        self.folder, self.task, self.reason = folder, task, reason
        self._removed: np.ndarray | None = None

    def removed(self) -> np.ndarray:
        """The sorted stream indices this task drops (read once, on first use)."""
        if self._removed is None:
            self._removed = load_removed(self.folder, self.task)
        return self._removed

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        removed = self.removed()
        j = 0
        for i, doc in enumerate(docs):
            stats.seen(doc)
            while j < len(removed) and removed[j] < i:
                j += 1
            if j < len(removed) and removed[j] == i:
                stats.drop(doc, self.reason)
                continue
            stats.kept(doc)
            yield doc
