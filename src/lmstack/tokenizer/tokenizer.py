"""The byte-level BPE tokenizer: encode, decode, encode_iterable (CS336 notes "分词器", "细节问答").

Text -> special-token split (longest first) -> pre-tokens (regex, :class:`.pretokenize.PreTokenizer`) -> UTF-8 bytes -> BPE merges
applied by rank (lowest first, like HF ``tokenizers``) -> ids. Decoding concatenates token bytes
and decodes UTF-8 with invalid sequences replaced by U+FFFD. Each distinct pre-token is merged
once and cached, because natural text repeats its words (CS336 notes "细节问答": hash maps).

Encoding runs in the native core (:mod:`.native`, ``csrc/bpe.cpp``: the same algorithm in C++, GIL released)
when it builds; otherwise, or with ``LMSTACK_TOKENIZER=python``, in the Python code below. ``backend`` says which.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Iterable, Iterator
from itertools import chain, repeat

import numpy as np
import regex

from . import native
from .byte_unicode import str_to_token
from .chat import render_chat_template
from .pretokenize import PreTokenizer, resolve_pattern, special_splitter

_NO_RANK = 1 << 62  # rank of a pair that is not a merge
_NATIVE_LOCK = threading.Lock()
#: Largest token id a vocabulary may use: real vocabularies stay below 300k; ids beyond this are a
#: corrupt file, and V = max id + 1 sizes the model's embedding.
MAX_TOKEN_ID = (1 << 24) - 1


class TokenizerFileError(ValueError):
    """A tokenizer file (lmstack JSON, HF tokenizer.json, GPT-2 vocab/merges, GGUF) that is malformed;
    the message names the file and what was expected."""


def printable_token(s, where: str, what: str) -> bytes:
    """A GPT-2 printable token string from a file -> bytes; anything else is a TokenizerFileError naming it."""
    if not isinstance(s, str):
        raise TokenizerFileError(f"{where}: {what} is {s!r:.60}; expected a token string")
    try:
        return str_to_token(s)
    except ValueError as e:
        raise TokenizerFileError(f"{where}: {what}: {e}") from None


def _checked_vocab(vocab: dict[int, bytes]) -> dict[int, bytes]:
    """id -> bytes with every id an integer in [0, MAX_TOKEN_ID] and every token bytes."""
    out: dict[int, bytes] = {}
    for i, b in vocab.items():
        if isinstance(i, bool) or not hasattr(i, "__index__") or not 0 <= int(i) <= MAX_TOKEN_ID:
            raise ValueError(f"token id {i!r} must be an integer in [0, {MAX_TOKEN_ID}]")
        if not isinstance(b, (bytes, bytearray)):
            raise ValueError(f"token {int(i)} is {b!r:.40}; expected bytes")
        out[int(i)] = bytes(b)
    return out


class Tokenizer:
    """Byte-level BPE from a vocabulary and an ordered merge list.

    ``vocab`` maps id -> token bytes and should hold all 256 single bytes (text containing a
    missing byte loses it, see ``missing_bytes``); ``merges`` are pairs of
    token bytes in priority order (earlier merges apply first); ``special_tokens`` are strings that
    are never split (an id is appended for each one the vocabulary lacks). ``pattern`` is a regex or
    a name from :data:`lmstack.tokenizer.pretokenize.PATTERNS` (``"gpt2"``, ``"gpt4"``,
    ``"llama3"``, ``"smollm"``).
    """

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: list[tuple[bytes, bytes]],
        special_tokens: Iterable[str] | None = None,
        pattern: str | None = None,
        cache_size: int = 1 << 18,
    ) -> None:
        self.vocab: dict[int, bytes] = _checked_vocab(vocab)
        self.merges: list[tuple[bytes, bytes]] = [(bytes(a), bytes(b)) for a, b in merges]
        self.pattern: str = resolve_pattern(pattern)
        self.pattern_name: str | None = (
            pattern if pattern is not None and pattern != self.pattern else None
        )
        self._pat = regex.compile(self.pattern)
        self._pre = PreTokenizer(
            self.pattern
        )  # same pieces as self._pat, faster on ASCII stretches
        self.cache_size = int(cache_size)
        # Optional metadata a file format may carry (GGUF, tokenizer.json).
        self.bos_token_id: int | None = None
        self.eos_token_id: int | None = None
        self.pad_token_id: int | None = None
        self.chat_template: str | None = None

        # bytes -> id; when the same bytes appear twice the lower id wins (as HF does).
        self._encoder: dict[bytes, int] = {}
        for i in sorted(self.vocab):
            self._encoder.setdefault(self.vocab[i], i)

        self.special_tokens: dict[str, int] = {}
        for s in special_tokens or ():
            if not isinstance(s, str) or not s:
                raise ValueError(f"special token {s!r} must be a non-empty str")
            b = s.encode("utf-8")
            if b not in self._encoder:
                new_id = max(self.vocab, default=-1) + 1
                self.vocab[new_id] = b
                self._encoder[b] = new_id
            self.special_tokens[s] = self._encoder[b]
        self._splitter = special_splitter(self.special_tokens)
        # Every proper prefix of every special token: encode_iterable holds these back at a chunk's end.
        self._special_prefixes = {s[:k] for s in self.special_tokens for k in range(1, len(s))}
        self._max_special_len = max((len(s) for s in self.special_tokens), default=0)

        # Bytes without a single-byte token (real vocabs such as SmolLM2's lack a few control bytes
        # and 0xC0/0xC1, which valid UTF-8 never contains) are dropped before merging, as HF BPE does
        # without an unk token; such text cannot round-trip.
        self.missing_bytes: list[int] = [b for b in range(256) if bytes([b]) not in self._encoder]
        self._byte_ids: list[int] = [self._encoder.get(bytes([b]), -1) for b in range(256)]

        # (left id, right id) -> (rank, merged id); the first occurrence of a pair keeps its rank.
        self._merge_table: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, (a, b) in enumerate(self.merges):
            for part in (a, b, a + b):
                if part not in self._encoder:
                    raise ValueError(
                        f"merge #{rank} ({a!r}, {b!r}) refers to {part!r}, which is not in the vocab"
                    )
            key = (self._encoder[a], self._encoder[b])
            if key not in self._merge_table:
                self._merge_table[key] = (rank, self._encoder[a + b])
        # The same table split for _bpe: (left id, right id) -> rank, and -> merged id.
        self._pair_rank = {pair: r for pair, (r, _) in self._merge_table.items()}
        self._pair_merged = {pair: m for pair, (_, m) in self._merge_table.items()}
        # byte value (as a latin-1 char) -> chr(its token id); missing bytes are deleted
        self._byte_chars = {b: (chr(i) if i >= 0 else None) for b, i in enumerate(self._byte_ids)}
        self._cache: dict[str, list[int]] = {}
        #: False: always the Python path (tests and benchmarks compare the two)
        self.use_native = True
        self._native_enc = None  # the native encoder, built at the first encode (see _core)
        self._native_tried = False

    # ------------------------------------------------------------------ sizes and lookups
    @property
    def vocab_size(self) -> int:
        """V: one more than the largest id (ids are dense in every format lmstack reads). Cached while the
        vocabulary keeps its size: per-token callers (a grammar's vocabulary, a sampler) pay O(1), not O(V)."""
        cached = self.__dict__.get("_vocab_size")
        if cached is None or cached[0] != len(self.vocab):
            cached = self.__dict__["_vocab_size"] = (len(self.vocab), max(self.vocab) + 1)
        return cached[1]

    def token_to_id(self, token: bytes | str) -> int | None:
        if isinstance(token, str):
            if token in self.special_tokens:
                return self.special_tokens[token]
            token = token.encode("utf-8")
        return self._encoder.get(token)

    # ------------------------------------------------------------------ native core
    def _core(self):
        """The native encoder (built once, at the first use), or None: the Python path runs."""
        if not self.use_native:
            return None
        if not self._native_tried:
            with _NATIVE_LOCK:  # two threads' first encodes build one encoder
                if not self._native_tried:
                    self._native_enc = native.new_encoder(self)
                    self._native_tried = True
        return self._native_enc

    @property
    def backend(self) -> str:
        """``"native"``, ``"native BPE, regex pre-tokenizer"`` (a custom pattern), or ``"python (<reason>)"``."""
        if self._core() is None:
            return f"python ({native.status() or 'use_native=False'})"
        return "native" if self.pattern in native.KINDS else "native BPE, regex pre-tokenizer"

    def _native_splits(self) -> bool:
        return self._core() is not None and self.pattern in native.KINDS

    def clear_cache(self) -> None:
        """Forget every merged pre-token (both paths' caches): the next encode starts cold."""
        self._cache.clear()
        if self._core() is not None:
            native.module().clear_cache(self._native_enc)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_native_enc"], state["_native_tried"] = None, False  # a process rebuilds its own
        state["_cache"] = {}
        return state

    # ------------------------------------------------------------------ BPE core
    def _bpe(self, piece: bytes) -> list[int]:
        """Merge one pre-token: repeatedly merge the adjacent pair of lowest merge rank (leftmost
        first, as HF ``tokenizers`` does), keeping a list of pair ranks that is updated only next to
        each merge, so every step is one C-level ``min`` and ``index`` plus two dict lookups.
        """
        ids = list(
            map(ord, piece.decode("latin-1").translate(self._byte_chars))
        )  # missing bytes dropped
        if len(ids) < 2:
            return ids
        rank_get = self._pair_rank.get
        ranks = list(map(rank_get, zip(ids, ids[1:]), repeat(_NO_RANK)))
        merged = self._pair_merged
        while ranks:
            best = min(ranks)
            if best == _NO_RANK:
                break
            i = ranks.index(best)
            new = merged[ids[i], ids[i + 1]]
            ids[i] = new
            del ids[i + 1]
            del ranks[i]
            if i > 0:
                ranks[i - 1] = rank_get((ids[i - 1], new), _NO_RANK)
            if i < len(ranks):
                ranks[i] = rank_get((new, ids[i + 1]), _NO_RANK)
        return ids

    def _split(self, text: str) -> list[str]:
        """Pre-tokens of text that contains no special token (ASCII fast path when possible)."""
        return self._pre.split(text)

    def _encode_pieces(self, pieces: list[str], out: list[int]) -> None:
        if self._core() is not None:
            out.extend(native.module().encode_pieces(self._native_enc, pieces))
            return
        cache = self._cache
        got = list(map(cache.get, pieces))  # C-level lookups; misses are None
        if None in got:
            for i, ids in enumerate(got):
                if ids is None:
                    piece = pieces[i]
                    ids = cache.get(piece)  # an earlier miss in this text may have filled it
                    if ids is None:
                        ids = self._bpe(piece.encode("utf-8"))
                        if len(cache) >= self.cache_size:
                            cache.clear()  # bounded memory; the common pieces come straight back
                        cache[piece] = ids
                    got[i] = ids
        out.extend(chain.from_iterable(got))

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        self._encode_pieces(self._split(text), out)

    # ------------------------------------------------------------------ public API
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Text -> ids. With ``allow_special=False`` special-token strings are encoded as plain text."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        if self._native_splits():
            return native.module().encode(self._native_enc, text, allow_special)
        out: list[int] = []
        if self._splitter is None or not allow_special:
            self._encode_ordinary(text, out)
            return out
        specials = self.special_tokens
        for i, part in enumerate(self._splitter.split(text)):
            if i % 2:
                out.append(specials[part])
            elif part:
                self._encode_ordinary(part, out)
        return out

    def encode_batch(
        self, texts: Iterable[str], allow_special: bool = True, num_workers: int = 1
    ) -> list[list[int]]:
        """Encode many texts; ``num_workers > 1`` spreads them over that many threads (native core) or
        processes (fork; the Python path)."""
        texts = list(texts)
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        if self._native_splits():
            return native.module().encode_batch(self._native_enc, texts, allow_special, num_workers)
        if num_workers == 1 or len(texts) < 2:
            return [self.encode(t, allow_special) for t in texts]
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        chunksize = max(1, len(texts) // (4 * num_workers))
        with ctx.Pool(num_workers, initializer=set_worker_tokenizer, initargs=(self,)) as pool:
            return pool.map(
                _worker_encode, [(t, allow_special) for t in texts], chunksize=chunksize
            )

    def encode_concat(
        self,
        texts: Iterable[str],
        dtype,
        sep_id: int | None = None,
        allow_special: bool = True,
        num_threads: int = 1,
    ) -> np.ndarray:
        """The ids of every text back to back, each text followed by ``sep_id`` (e.g. EOS) when given, as one
        ``dtype`` (uint16 / uint32) array: a token file's contents, without a Python int per token."""
        texts = list(texts)
        dtype = np.dtype(dtype)
        if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
            raise ValueError(f"dtype={dtype} must be uint16 or uint32")
        if self.vocab_size > np.iinfo(dtype).max + 1:
            raise ValueError(f"dtype={dtype} cannot hold ids of a vocabulary of {self.vocab_size}")
        if sep_id is not None and not 0 <= sep_id < self.vocab_size:
            raise ValueError(f"sep_id={sep_id} is not a token id (V={self.vocab_size})")
        if self._native_splits():
            data = native.module().encode_join(
                self._native_enc,
                texts,
                allow_special,
                max(1, num_threads),
                dtype.itemsize,
                -1 if sep_id is None else sep_id,
            )
            return np.frombuffer(data, dtype=dtype.newbyteorder("=")).astype(
                dtype, copy=False
            )  # native order
        tail = [] if sep_id is None else [sep_id]
        parts = [np.asarray(self.encode(t, allow_special) + tail, dtype=dtype) for t in texts]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        vocab = self.vocab
        try:
            return b"".join([vocab[i] for i in ids])
        except KeyError as e:
            raise ValueError(
                f"token id {e.args[0]!r} is not in the vocabulary (V={self.vocab_size})"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def _settle(self, buf: str, out: list[int]) -> str:
        """Encode the prefix of ``buf`` whose ids cannot change whatever text follows; return the rest.

        Held back: any suffix that more text could complete into a special token, and the last
        pre-token before it (a later chunk may extend it, e.g. a run of spaces or newlines).
        """
        end = len(buf)
        # 1. the longest suffix that more text could complete into a special token
        for k in range(min(self._max_special_len - 1, end), 0, -1):
            if buf[end - k :] in self._special_prefixes:
                end -= k
                break
        # 2. never cut inside a special token; text after the last one before `end` is one segment
        seg_start = 0
        if self._splitter is not None:
            for m in self._splitter.finditer(buf):
                if m.start() >= end:
                    break
                if (
                    m.end() > end
                ):  # a definite special straddles `end`: everything before it is settled
                    out.extend(self.encode(buf[: m.start()]))
                    return buf[m.start() :]
                seg_start = m.end()
        if seg_start:
            out.extend(self.encode(buf[:seg_start]))
        seg = buf[seg_start:end]
        if self._native_splits():  # the same cut, in C++: every pre-token but the last
            ids, keep = native.module().encode_prefix(self._native_enc, seg)
            out.extend(ids)
            return seg[len(seg) - keep :] + buf[end:]
        pieces = self._split(seg)
        if pieces and sum(map(len, pieces)) == len(
            seg
        ):  # pre-tokens tile the segment (built-in patterns)
            keep = pieces.pop()
            self._encode_pieces(pieces, out)
            return keep + buf[end:]
        last = None  # a custom pattern that skips characters: find the last pre-token's start
        for m in self._pat.finditer(seg):
            last = m
        cut = seg_start + (last.start() if last is not None else len(seg))
        self._encode_ordinary(buf[seg_start:cut], out)
        return buf[cut:]

    def encode_iterable(self, iterable: Iterable[str], chunk_chars: int = 1 << 16) -> Iterator[int]:
        """Yield ids for the concatenation of ``iterable`` lazily (e.g. an open text file).

        Memory is bounded by ``chunk_chars`` plus the longest pre-token, not by the input's size;
        the ids equal ``encode("".join(iterable))``.
        """
        buf = ""
        for chunk in iterable:
            buf += chunk
            if len(buf) < chunk_chars:
                continue
            out: list[int] = []
            buf = self._settle(buf, out)
            yield from out
        if buf:
            yield from self.encode(buf)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        **extra,
    ) -> str | list[int]:
        """Render ``messages`` with ``chat_template`` (:mod:`.chat`, as HF does); ids when ``tokenize``."""
        for name, tid in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)):
            extra.setdefault(
                name, self.vocab[tid].decode("utf-8", "replace") if tid is not None else ""
            )
        text = render_chat_template(self.chat_template, messages, add_generation_prompt, **extra)
        return self.encode(text) if tokenize else text

    def __len__(self) -> int:
        return len(self.vocab)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(V={self.vocab_size}, merges={len(self.merges)}, "
            f"special_tokens={len(self.special_tokens)}, pattern={self.pattern_name or self.pattern[:24] + '...'})"
        )


# Worker-process state for Tokenizer.encode_batch / dataset encoding: each pool worker holds the
# tokenizer it was started with (set by the pool initializer; never touched in the parent).
_WORKER_TOKENIZER: list[Tokenizer] = []


def set_worker_tokenizer(tok: Tokenizer) -> None:
    """A process pool's initializer: this worker encodes with ``tok``."""
    _WORKER_TOKENIZER[:] = [tok]


def worker_tokenizer() -> Tokenizer:
    """The tokenizer this pool worker was started with."""
    return _WORKER_TOKENIZER[0]


def _worker_encode(task: tuple[str, bool]) -> list[int]:
    text, allow_special = task
    return worker_tokenizer().encode(text, allow_special)
