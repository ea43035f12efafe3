"""The one record every data step reads and writes.

A document is its text, a stable id and free metadata (url, source, language, scores, ...). The id is
derived from where the document came from, never from a counter or the clock, so the same input gives
the same ids on every run and on every executor (dolma's rule: ids survive re-runs, so attributes and
exclusions written beside a shard can be joined back to it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


def stable_id(source: str, key: str | int) -> str:
    """A 16-hex-digit id from the source (a file path or URL) and a key inside it (record id or offset).

    blake2b over ``source + NUL + key``: the same (source, key) gives the same id on every machine.
    """
    h = hashlib.blake2b(f"{source}\0{key}".encode("utf-8", "surrogatepass"), digest_size=8)
    return h.hexdigest()


@dataclass
class Document:
    """``text`` (str), ``id`` (stable, see :func:`stable_id`), ``metadata`` (JSON-serialisable dict)."""

    text: str
    id: str
    metadata: dict[str, Any] = field(default_factory=dict)
