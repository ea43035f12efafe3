"""The flat token file: ids back to back, read with ``np.memmap`` (Book of LLMs §5.3 “memmap loading and bf16/int8 weights”), and its JSON sidecar.

``<path>`` holds the raw ids (``uint16`` when V <= 65536, else ``uint32``); ``<path>.json`` says
``dtype``, ``n_tokens`` and ``vocab_size`` so a reader never guesses. This module is the one place
that knows the format, both ways: the tokenizer writes token files (``dataset.encode_files``) and
training reads them (``train.trainer`` calls :func:`open_tokens` and :func:`check_token_ids`). It lives with the writer
because data flows one way, tokenizer -> token files -> train: the trainer may import the tokenizer,
never the reverse. Reading checks everything a bad file could get wrong (missing or malformed
sidecar, a dtype or count disagreeing with the file's size, ids outside the vocabulary).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmstack.utils import atomic_write_text

READ_DTYPES = tuple(np.dtype(t) for t in (np.uint16, np.uint32, np.int32, np.int64))


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (V <= 65536), else uint32."""
    if vocab_size <= 0 or vocab_size > 1 << 32:
        raise ValueError(f"vocab_size={vocab_size} must be in 1..2**32")
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(str(path) + ".json")


@dataclass(frozen=True)
class TokenFileInfo:
    """What a sidecar says; ``n_tokens`` / ``vocab_size`` are None when absent or not integers."""

    dtype: np.dtype
    n_tokens: int | None
    vocab_size: int | None


def write_sidecar(path: str | os.PathLike, meta: dict) -> None:
    """Write ``<path>.json`` (atomically); ``meta`` holds at least ``dtype``, ``n_tokens``, ``vocab_size``."""
    atomic_write_text(sidecar_path(path), json.dumps(meta, indent=1))


def _int_or_none(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _checked_dtype(dtype, path: Path) -> np.dtype:
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(
            f"{path}: token dtype {dtype!r} is not one of uint16, uint32, int32, int64"
        ) from None
    if dtype not in READ_DTYPES:
        raise ValueError(f"{path}: token dtype {dtype} is not one of uint16, uint32, int32, int64")
    return dtype


def read_sidecar(path: str | os.PathLike) -> TokenFileInfo:
    """The sidecar of token file ``path``; ValueError when it is missing or not a JSON object with ``dtype``."""
    path, side = Path(path), sidecar_path(path)
    if not side.is_file():
        raise ValueError(f"{path}: no sidecar {side.name}; pass dtype='uint16' or 'uint32'")
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
        dtype = meta["dtype"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{side}: not a token-file sidecar (a JSON object with 'dtype'): {e!r}"
        ) from None
    return TokenFileInfo(
        _checked_dtype(dtype, path),
        _int_or_none(meta.get("n_tokens")),
        _int_or_none(meta.get("vocab_size")),
    )


def is_token_file(path: str | os.PathLike, strict: bool = False) -> bool:
    """A token file as ``encode_files`` writes it: a file whose sidecar names its dtype.

    ``strict`` (readers that would otherwise take the file as text): a sidecar that is there but unreadable
    (not JSON, no ``dtype``, a bogus dtype) is a ValueError naming it, not False — read as text, the binary
    gives a wrong answer (``eval ppl tok.bin`` would report a perplexity over its bytes)."""
    if strict and sidecar_path(path).is_file():
        read_sidecar(path)
        return Path(path).is_file()
    try:
        read_sidecar(path)
    except (ValueError, OSError):
        return False
    return Path(path).is_file()


def open_tokens(path: str | os.PathLike, dtype: str | np.dtype | None = None) -> np.memmap:
    """Memory-map a token file; ``dtype=None`` reads it from the sidecar, whose count must match the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"token file {str(path)!r} does not exist (write one with `lmstack tokenizer encode`)"
        )
    info = (
        read_sidecar(path)
        if dtype is None
        else TokenFileInfo(_checked_dtype(dtype, path), None, None)
    )
    dtype, size = info.dtype, path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(
            f"{path}: size {size} bytes is not a multiple of {dtype} ({dtype.itemsize} bytes)"
        )
    n = info.n_tokens
    if n is not None and n * dtype.itemsize != size:
        raise ValueError(
            f"{path}: the sidecar says {n} tokens of {dtype} ({n * dtype.itemsize} bytes) "
            f"but the file has {size} bytes: the sidecar's dtype or count does not match the file"
        )
    if size == 0:
        raise ValueError(f"{path}: empty token file")
    return np.memmap(path, dtype=dtype, mode="r")


def check_token_ids(
    tokens: np.ndarray, vocab_size: int, name: str = "token file", chunk: int = 1 << 22
) -> None:
    """Every id in ``tokens`` must be in [0, vocab_size): scanned in chunks (a memmap is read once,
    ``chunk`` ids at a time); raises ValueError with the first bad value and its position."""
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start : start + chunk])
        if part.min() < 0 or part.max() >= vocab_size:
            i = int(np.flatnonzero((part < 0) | (part >= vocab_size))[0])
            raise ValueError(
                f"{name}: token id {int(part[i])} at position {start + i} is outside the model's "
                f"vocabulary 0..{vocab_size - 1} (vocab_size={vocab_size}); re-encode the data with "
                "the model's tokenizer or raise model.vocab_size"
            )
