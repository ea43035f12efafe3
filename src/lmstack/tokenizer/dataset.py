"""Encode text files into one flat token file readable with ``np.memmap`` (Book of LLMs §5.3 “memmap loading and bf16/int8 weights”; CS336 notes "细节问答").

The output is a token file (:mod:`.token_file`: the raw ids back to back, ``uint16`` when V <= 65536 and
``uint32`` otherwise, plus a JSON sidecar with dtype, n_tokens, vocab_size, bytes/token).
Inputs are cut at special-token boundaries (or before ``" <letter>"``, which always starts a
pre-token), worker processes encode chunks in parallel, and the parent appends their ids in order;
memory stays bounded by the chunk size whatever the corpus size ("流式懒加载": read -> encode -> write).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from lmstack.utils import atomic_path

from .pretokenize import PATTERNS
from .token_file import token_dtype, write_sidecar
from .tokenizer import Tokenizer, set_worker_tokenizer, worker_tokenizer
from .train import plan_chunks

_CHUNK_BYTES = 4 << 20


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
    tok = tok or worker_tokenizer()
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read(end - start).decode("utf-8", errors="replace")
    return tok.encode_concat([text], dtype).tobytes()


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
    workers, total, ranges = plan_chunks(
        paths, split, num_workers, chunk_bytes, safe_cuts=tok.pattern in PATTERNS.values()
    )
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
            pool = ctx.Pool(
                min(workers, len(tasks)), initializer=set_worker_tokenizer, initargs=(tok,)
            )
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
    meta = {
        **asdict(stats),
        "bytes_per_token": stats.bytes_per_token,
        "inputs": [str(p) for p in paths],
    }
    write_sidecar(output, meta)
    return stats
