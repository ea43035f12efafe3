"""Encode text files into one flat token file readable with ``np.memmap`` (seed 000 §5.3; seed 001 "细节问答").

The output is the raw ids back to back, ``uint16`` when V <= 65536 and ``uint32`` otherwise, plus a
small JSON sidecar (``<out>.json``: dtype, n_tokens, vocab_size, bytes/token) so a reader never guesses.
Inputs are cut at special-token boundaries (or before ``" <letter>"``, which always starts a
pre-token), worker processes encode chunks in parallel, and the parent appends their ids in order;
memory stays bounded by the chunk size whatever the corpus size ("流式懒加载": read -> encode -> write).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmstack.utils import atomic_path, atomic_write_text, is_json_file

from . import tokenizer as _tokmod
from .tokenizer import Tokenizer
from .pretokenize import PATTERNS
from .train import plan_chunks

_CHUNK_BYTES = 4 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (V <= 65536), else uint32."""
    if vocab_size <= 0 or vocab_size > 1 << 32:
        raise ValueError(f"vocab_size={vocab_size} must be in 1..2**32")
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclass
class EncodeStats:
    n_tokens: int
    n_bytes: int
    seconds: float
    dtype: str
    vocab_size: int

    @property
    def bytes_per_token(self) -> float:
        return self.n_bytes / max(self.n_tokens, 1)

    @property
    def mb_per_s(self) -> float:
        return self.n_bytes / 1e6 / max(self.seconds, 1e-9)


def _encode_range(task: tuple[str, int, int, str], tok: Tokenizer | None = None) -> bytes:
    path, start, end, dtype = task
    tok = tok or _tokmod._WORKER_TOKENIZER[0]
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read(end - start).decode("utf-8", errors="replace")
    return np.asarray(tok.encode(text), dtype=dtype).tobytes()


def encode_files(
    tok: Tokenizer,
    inputs: str | os.PathLike | Sequence[str | os.PathLike],
    output: str | os.PathLike,
    num_workers: int | None = None,
    progress: bool | None = None,
    chunk_bytes: int = _CHUNK_BYTES,
) -> EncodeStats:
    """Encode ``inputs`` (files, concatenated in order) into the flat token file ``output``."""
    paths = [Path(inputs)] if isinstance(inputs, (str, os.PathLike)) else [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"input {str(p)!r} does not exist or is not a file")
    dtype = token_dtype(tok.vocab_size)
    split = [s.encode("utf-8") for s in tok.special_tokens]
    workers, total, ranges = plan_chunks(paths, split, num_workers, chunk_bytes,
                                         safe_cuts=tok.pattern in PATTERNS.values())
    tasks = [(p, s, e, dtype.str) for p, s, e in ranges]

    t0 = time.perf_counter()
    n_tokens = 0
    disable = (not progress) if progress is not None else (None if total >= 8 << 20 else True)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="encode", disable=disable)
    with atomic_path(output) as tmp, open(tmp, "wb") as out:
        if workers == 1:
            results = (_encode_range(t, tok) for t in tasks)
            pool = None
        else:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            pool = ctx.Pool(min(workers, len(tasks)), initializer=_tokmod._set_worker_tokenizer, initargs=(tok,))
            results = pool.imap(_encode_range, tasks)
        try:
            for t, data in zip(tasks, results):
                out.write(data)
                n_tokens += len(data) // dtype.itemsize
                bar.update(t[2] - t[1])
                bar.set_postfix(tokens=n_tokens, refresh=False)
        finally:
            if pool is not None:
                pool.terminate()
        out.flush()
    bar.close()
    stats = EncodeStats(n_tokens, total, time.perf_counter() - t0, dtype.name, tok.vocab_size)
    meta = {**asdict(stats), "bytes_per_token": stats.bytes_per_token, "inputs": [str(p) for p in paths]}
    atomic_write_text(str(output) + ".json", json.dumps(meta, indent=1))
    return stats


def is_token_file(path: str | os.PathLike) -> bool:
    """A token file as ``encode_files`` writes it: its ``<path>.json`` sidecar names the dtype."""
    side = Path(str(path) + ".json")
    return Path(path).is_file() and is_json_file(side) and "dtype" in json.loads(side.read_text(encoding="utf-8"))


def open_tokens(path: str | os.PathLike, dtype: str | np.dtype | None = None) -> np.memmap:
    """Memory-map a token file; ``dtype=None`` reads it from the ``.json`` sidecar."""
    if dtype is None:
        side = Path(str(path) + ".json")
        if not side.is_file():
            raise ValueError(f"{path}: no sidecar {side.name}; pass dtype='uint16' or 'uint32'")
        dtype = json.loads(side.read_text())["dtype"]
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")
