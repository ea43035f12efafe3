"""Byte-level BPE training (CS336 notes "分词器"; "细节问答": pre-tokenization, mmap/streaming, heaps and hash maps).

1. Pre-token counting. Each input file is cut into chunks at special-token boundaries (so no
   chunk splits a document, and no merge ever crosses a special token); worker processes read
   their own byte range, split it on the special tokens, run the pre-tokenizer regex and count
   distinct pre-tokens. Memory is bounded by the chunk size, never the file size.
2. Merging. Each distinct pre-token is a word of byte ids with a count. Pair counts are built once;
   each step takes the most frequent pair from a heap (ties: the lexicographically greatest pair of
   byte strings, the GPT-2 convention), rewrites only the words that contain it (a pair -> words
   index) and updates the affected pair counts incrementally.
"""

from __future__ import annotations

import heapq
import multiprocessing as mp
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import regex
from tqdm import tqdm

from .pretokenize import PATTERNS, PreTokenizer, resolve_training_pattern, special_splitter

#: Fallback cut when no special token is near a nominal chunk boundary: before a space followed by
#: an ASCII letter, which starts a pre-token under every built-in pattern (GPT-2, GPT-4, Llama-3, SmolLM).
_SAFE_CUT = regex.compile(rb"(?<=\S) (?=[A-Za-z])")
_CHUNK_BYTES = 16 << 20  # at most this much text per worker task
_SERIAL_BYTES = 2 << 20  # below this total, counting in-process beats starting workers


def _paths(input_path: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    items = [input_path] if isinstance(input_path, (str, os.PathLike)) else list(input_path)
    paths = []
    for p in items:
        p = Path(p)
        if p.is_dir():
            raise ValueError(
                f"input {str(p)!r} is a directory; pass files (e.g. sorted(dir.rglob('*.txt')))"
            )
        if not p.is_file():
            raise FileNotFoundError(f"training input {str(p)!r} does not exist")
        paths.append(p)
    if not paths:
        raise ValueError("train_bpe needs at least one input file, got none")
    return paths


def _inside_special(block: bytes, q: int, split_tokens: Sequence[bytes]) -> bool:
    """Whether some occurrence of a special token in ``block`` covers position ``q`` strictly inside."""
    for t in split_tokens:
        for j in range(1, len(t)):
            if q - j >= 0 and block.startswith(t, q - j):
                return True
    return False


def find_chunk_boundaries(
    path: str | os.PathLike,
    n_chunks: int,
    split_tokens: Sequence[bytes],
    window: int = 1 << 20,
    safe_cuts: bool = True,
) -> list[int]:
    """Byte offsets ``[0, ..., size]`` cutting ``path`` into about ``n_chunks`` pieces.

    Each inner boundary moves forward to the next start of a special token within ``window`` bytes,
    or failing that to the next safe cut (see ``_SAFE_CUT``), never to a position inside an
    occurrence of a special token (``<|endoftext|><|endoftext|>`` is not cut in the middle);
    failing both, the boundary is dropped. Either way the text on each side of a boundary
    pre-tokenizes exactly as it does in the whole file. ``safe_cuts=False`` (custom patterns, for
    which the safe-cut argument is not known to hold) cuts at special tokens only.
    """
    size = os.path.getsize(path)
    n_chunks = max(1, min(n_chunks, size // 4096 or 1))
    guesses = [size * i // n_chunks for i in range(1, n_chunks)]
    bounds = [0]
    finder = (
        regex.compile(b"|".join(regex.escape(t) for t in split_tokens)) if split_tokens else None
    )
    back = max((len(t) for t in split_tokens), default=0)  # look this far behind a candidate
    with open(path, "rb") as f:
        for g in guesses:
            if g <= bounds[-1]:
                continue
            start = max(bounds[-1], g - back)
            f.seek(start)
            block = f.read(window + (g - start))
            cut = None
            for searcher in ([finder] if finder is not None else []) + (
                [_SAFE_CUT] if safe_cuts else []
            ):
                for m in searcher.finditer(block, g - start, overlapped=searcher is finder):
                    if not _inside_special(block, m.start(), split_tokens):
                        cut = start + m.start()
                        break
                if cut is not None:
                    break
            if cut is not None and bounds[-1] < cut < size:
                bounds.append(cut)
    bounds.append(size)
    return bounds


def _count_text(text: str, pattern: str, splitter: regex.Pattern | None) -> Counter:
    pre = PreTokenizer(pattern)
    counts: Counter = Counter()
    parts = [text] if splitter is None else splitter.split(text)[::2]
    for part in parts:
        if part:
            counts.update(pre.split(part))
    return counts


def _count_chunk(task: tuple[str, int, int, str, tuple[str, ...]]) -> Counter:
    path, start, end, pattern, specials = task
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    # surrogateescape: invalid UTF-8 bytes survive as-is and come back as the same bytes later.
    text = data.decode("utf-8", errors="surrogateescape")
    del data
    return _count_text(text, pattern, special_splitter(specials))


def plan_chunks(
    paths: Sequence[Path],
    split_bytes: Sequence[bytes],
    num_workers: int | None,
    chunk_bytes: int,
    safe_cuts: bool,
    min_chunks_per_worker: bool = False,
) -> tuple[int, int, list[tuple[str, int, int]]]:
    """Split the input files into byte ranges for worker processes (CS336 notes "细节问答": bounded memory).

    Returns (workers, total bytes, [(path, start, end)]). Each file is cut into pieces of at most
    ``chunk_bytes`` (and, with ``min_chunks_per_worker``, at least one piece per worker) at
    special-token boundaries; inputs under ``_SERIAL_BYTES`` are processed in-process (workers = 1).
    """
    total = sum(p.stat().st_size for p in paths)
    workers = num_workers if num_workers is not None else (os.cpu_count() or 1)
    if workers < 1:
        raise ValueError(f"num_workers={workers} must be >= 1")
    if total < _SERIAL_BYTES:
        workers = 1
    ranges = []
    for p in paths:
        n = -(-p.stat().st_size // chunk_bytes)
        n = max(workers if min_chunks_per_worker else 1, n)
        b = find_chunk_boundaries(p, n, split_bytes, safe_cuts=safe_cuts)
        ranges += [(str(p), s, e) for s, e in zip(b, b[1:])]
    return workers, total, ranges


def count_pretokens(
    input_path: str | os.PathLike | Sequence[str | os.PathLike],
    special_tokens: Sequence[str] = (),
    pattern: str | None = None,
    num_workers: int | None = None,
    progress: bool | None = None,
) -> Counter:
    """Distinct pre-token (str) -> count over all input files, counted in parallel chunks."""
    paths = _paths(input_path)
    pattern = resolve_training_pattern(pattern)
    specials = tuple(special_tokens)
    split_bytes = [s.encode("utf-8") for s in specials]
    workers, total, ranges = plan_chunks(
        paths,
        split_bytes,
        num_workers,
        _CHUNK_BYTES,
        safe_cuts=pattern in PATTERNS.values(),
        min_chunks_per_worker=True,
    )
    tasks = [(p, s, e, pattern, specials) for p, s, e in ranges]
    counts: Counter = Counter()
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc="pre-tokens", disable=_disable(progress, total)
    )
    if workers == 1:
        for t in tasks:
            counts.update(_count_chunk(t))
            bar.update(t[2] - t[1])
    else:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(min(workers, len(tasks))) as pool:
            for t, c in zip(tasks, pool.imap(_count_chunk, tasks)):
                counts.update(c)
                bar.update(t[2] - t[1])
    bar.close()
    return counts


def _disable(progress: bool | None, total: int) -> bool | None:
    if progress is None:
        return (
            None if total >= (8 << 20) else True
        )  # auto: only on a terminal, only for large inputs
    return not progress


def _desc_key(token: bytes) -> bytes:
    """Sort key that orders byte strings greatest first under plain ``bytes`` comparison.

    Each byte x becomes the two bytes (0, 255 - x), and the string ends with (1, 0), which sorts
    after every byte; so for a pair, ``_desc_key(a) + _desc_key(b)`` puts the lexicographically
    greatest ``(a, b)`` first in a min-heap, compared in C (memcmp) rather than in Python.
    """
    return bytes(v for x in token for v in (0, 255 - x)) + b"\x01\x00"


def merge_counts(
    word_counts: dict[bytes, int] | Iterable[tuple[bytes, int]],
    vocab_size: int,
    special_tokens: Sequence[str] = (),
    progress: bool | None = None,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Learn merges from pre-token byte strings and their counts until ``vocab_size`` tokens exist.

    Ids: special tokens first (0..k-1), then the 256 byte values, then merged tokens in order.
    """
    specials = list(dict.fromkeys(special_tokens))
    vocab: dict[int, bytes] = {i: s.encode("utf-8") for i, s in enumerate(specials)}
    base = len(vocab)
    for b in range(256):
        vocab[base + b] = bytes([b])
    if vocab_size < len(vocab):
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the initial vocabulary "
            f"({len(specials)} special tokens + 256 bytes = {len(vocab)})"
        )
    items = word_counts.items() if isinstance(word_counts, dict) else word_counts
    # A word is a str whose characters are token ids (chr(id)): merging a pair everywhere in a word
    # is then one C-level str.replace (left to right, non-overlapping: exactly BPE's rule), and a
    # pair is the 2-character substring.
    words: list[str] = []
    freqs: list[int] = []
    for w, n in items:
        if len(w) >= 2 and n > 0:
            words.append("".join(chr(base + b) for b in w))
            freqs.append(n)

    pair_counts: dict[str, int] = defaultdict(int)
    where: dict[str, set[int]] = defaultdict(set)
    for idx, w in enumerate(words):
        f = freqs[idx]
        for p in map(str.__add__, w, w[1:]):
            pair_counts[p] += f
            where[p].add(idx)
    pair_counts = dict(pair_counts)
    keys = {i: _desc_key(b) for i, b in vocab.items()}  # per-token heap key fragments
    heap = [(-c, keys[ord(p[0])] + keys[ord(p[1])], p) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[bytes, bytes]] = []
    n_merges = vocab_size - len(vocab)
    bar = tqdm(
        total=n_merges, unit="merge", desc="merges", disable=_disable(progress, n_merges << 12)
    )
    while len(merges) < n_merges:
        while heap:
            negc, _, pair = heapq.heappop(heap)
            if pair_counts.get(pair, 0) == -negc > 0:
                break  # entries whose count changed since they were pushed are skipped (lazy deletion)
        else:
            break  # every word is a single token: nothing left to merge
        a, b = ord(pair[0]), ord(pair[1])
        new = len(vocab)
        newc = chr(new)
        vocab[new] = vocab[a] + vocab[b]
        keys[new] = _desc_key(vocab[new])
        merges.append((vocab[a], vocab[b]))
        delta: dict[str, int] = defaultdict(int)
        for idx in where.pop(pair):
            w = words[idx]
            if pair not in w:
                continue  # stale index entry: an earlier merge already consumed this pair here
            out = w.replace(pair, newc)
            f = freqs[idx]
            for p in map(str.__add__, w, w[1:]):
                delta[p] -= f
            for p in map(str.__add__, out, out[1:]):
                delta[p] += f
                if newc in p:
                    where[p].add(
                        idx
                    )  # other pairs of `out` were already adjacent in `w`, so indexed
            words[idx] = out
        for p, d in delta.items():
            if d == 0:
                continue
            c = pair_counts.get(p, 0) + d
            if c > 0:
                pair_counts[p] = c
                heapq.heappush(heap, (-c, keys[ord(p[0])] + keys[ord(p[1])], p))
            else:
                pair_counts.pop(p, None)
                where.pop(p, None)
        bar.update(1)
    bar.close()
    return vocab, merges


def train_bpe(
    input_path: str | os.PathLike | Sequence[str | os.PathLike],
    vocab_size: int,
    special_tokens: Sequence[str] = (),
    pattern: str | None = None,
    num_workers: int | None = None,
    progress: bool | None = None,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train byte-level BPE on one or more files -> ``(vocab, merges)``.

    ``vocab``: id -> bytes (special tokens, then the 256 bytes, then merged tokens);
    ``merges``: the learned pairs in order. ``pattern`` is a regex or a name (``"gpt2"`` default,
    ``"gpt4"``, ``"llama3"``, ``"smollm"``). ``progress=None`` shows bars only for large inputs on a terminal.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size={vocab_size} must be positive")
    counts = count_pretokens(input_path, special_tokens, pattern, num_workers, progress)
    word_counts = Counter()
    for piece, n in counts.items():
        word_counts[piece.encode("utf-8", errors="surrogateescape")] += n
    return merge_counts(word_counts, vocab_size, special_tokens, progress)
