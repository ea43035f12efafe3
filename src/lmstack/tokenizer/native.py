"""The encoder's native core: ``csrc/bpe.cpp`` compiled on first use (CS336 notes "分词器", "细节问答").

The C++ file does what :class:`~lmstack.tokenizer.Tokenizer`'s Python path does, with the same ids:
special tokens cut out longest first, the built-in pre-tokenizer patterns as hand-written state machines
(any other pattern: Python's ``regex`` splits and C++ merges), BPE by merge rank with a cache of merged
pieces shared by threads, and the GIL released while it works, so threads scale (``encode_batch``).

Character classes are not compiled in: :func:`char_classes` asks the ``regex`` module which code points
are ``\\p{L}``, ``\\p{N}`` and ``\\s`` (and which fold to the contraction letters under ``(?i)``), so the two
paths cannot disagree on a Unicode version. ``status()`` is None when the core is loaded, else why not
(no compiler, a failed build, ``LMSTACK_TOKENIZER=python``); the tokenizer then runs its Python path.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from array import array
from pathlib import Path

import numpy as np
import regex

from lmstack.utils import build_extension

from .pretokenize import GPT2_PATTERN, GPT4_PATTERN, LLAMA3_PATTERN, SMOLLM_PATTERN

_log = logging.getLogger(__name__)
_BUILD_LOCK = threading.Lock()
SOURCE = Path(__file__).with_name("csrc") / "bpe.cpp"
#: pattern -> the state machine in bpe.cpp that reproduces it (``enum Kind``); other patterns: -1
KINDS = {GPT2_PATTERN: 0, GPT4_PATTERN: 1, LLAMA3_PATTERN: 2, SMOLLM_PATTERN: 3}
_CONTRACTION_LETTERS = "stremvld"


@functools.cache
def _module():
    with _BUILD_LOCK:
        if os.environ.get("LMSTACK_TOKENIZER", "").lower() == "python":
            return None, "LMSTACK_TOKENIZER=python"
        module, reason = build_extension("lmstack_bpe", SOURCE, ["-O3"], python_module=True)
    if reason is not None:
        _log.warning("native BPE encoder off: %s; the tokenizer uses its Python path", reason)
    return module, reason


def status() -> str | None:
    """None when the native core is built and loaded, else the reason the Python path is used."""
    return _module()[1]


def module():
    """The loaded extension module, or None (see :func:`status`)."""
    return _module()[0]


@functools.cache
def char_classes() -> bytes:
    """One byte per code point 0..0x10FFFF: 1 = ``\\p{L}``, 2 = ``\\p{N}``, 4 = ``\\s``, as ``regex`` sees them."""
    every = "".join(map(chr, range(0x110000)))
    cats = np.zeros(0x110000, dtype=np.uint8)
    for bit, cls in ((1, r"\p{L}+"), (2, r"\p{N}+"), (4, r"\s+")):
        for m in regex.finditer(cls, every):
            cats[m.start() : m.end()] |= bit
    return cats.tobytes()


@functools.cache
def case_folds(pattern: str) -> bytes:
    """(code point, letter) uint32 pairs: the characters each contraction letter matches in ``pattern``'s
    contractions (GPT-4's ``(?i:...)`` also takes U+017F LONG S for ``s``; Llama-3's ``[sS]`` only ASCII)."""
    if KINDS.get(pattern) not in (1, 2):
        return b""
    every = "".join(map(chr, range(0x110000)))
    pairs = array("I")
    for letter in _CONTRACTION_LETTERS:
        cls = "(?i:" + letter + ")" if pattern == GPT4_PATTERN else f"[{letter}{letter.upper()}]"
        for m in regex.finditer(cls, every):
            pairs.extend((m.start(), ord(letter)))
    return pairs.tobytes()


def new_encoder(tok, pattern_kind: int | None = None):
    """The native encoder for Tokenizer ``tok`` (its byte ids, merge table, specials, pattern), or None when
    the core is off. ``pattern_kind`` overrides the state machine (tests)."""
    mod = module()
    if mod is None:
        return None
    kind = KINDS.get(tok.pattern, -1) if pattern_kind is None else pattern_kind
    quads = np.array(
        [(a, b, r, m) for (a, b), (r, m) in tok._merge_table.items()], dtype=np.uint32
    ).reshape(-1, 4)
    byte_ids = np.asarray(tok._byte_ids, dtype=np.int32)
    specials = [(s.encode("utf-8"), i) for s, i in tok.special_tokens.items()]
    return mod.new(
        byte_ids.tobytes(),
        quads.tobytes(),
        len(tok.merges),
        char_classes(),
        kind,
        case_folds(tok.pattern),
        specials,
        tok.cache_size,
        max(tok.vocab),
    )
