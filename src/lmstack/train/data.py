"""Training data: random windows, evaluation batches, packing, token budgets over a token array.

Book of LLMs §5.3 “memmap loading and bf16/int8 weights”: ``np.memmap`` maps the token file written by ``lmstack tokenizer encode`` instead
of loading it (:func:`lmstack.tokenizer.token_file.open_tokens`, the one reader), so a corpus larger
than RAM costs nothing until a window is read. A training
example is a window of S + 1 consecutive tokens: x = tokens[i : i+S] and y = tokens[i+1 : i+S+1]
(y is x shifted by one: position s predicts token s+1). Any i in [0, n - S - 1] is valid.

Packing (CS336 notes "细节问答", Book of LLMs §2.2 “batching and packing”): a window may span several documents separated by
a separator token (``<|endoftext|>``). With ``sep_id`` set, each window also gets document ids
and positions that restart at 0 in every document; the model's attention mask then never lets a
token see another document, and targets that cross a boundary are ignored (-100).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lmstack.train.losses import IGNORE_INDEX


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` -> cuda if available else cpu; anything else must name a device that exists here."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device={device!r} is not a valid torch device (expected 'cpu', 'cuda', 'cuda:0', "
            f"'mps' or 'auto'): {e}"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r}: CUDA is not available on this machine (use 'cpu' or 'auto')"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r}: MPS is not available on this machine")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device={device!r}: unsupported device type {dev.type!r}")
    return dev


@dataclass
class Batch:
    """x (B, S) inputs; y (B, S) targets (-100 = ignore); packing adds positions and document_ids (B, S)."""

    x: Tensor
    y: Tensor
    positions: Tensor | None = None
    document_ids: Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.x.numel())

    def to(self, device: torch.device) -> Batch:
        nb = device.type == "cuda"
        mv = lambda t: (
            None if t is None else (t.pin_memory() if nb else t).to(device, non_blocking=nb)
        )  # noqa: E731
        return Batch(mv(self.x), mv(self.y), mv(self.positions), mv(self.document_ids))


def document_layout(window: np.ndarray, sep_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Document ids and in-document positions for each row of ``window`` (B, S+1) of token ids.

    A separator closes its document (it belongs to the text before it), so the token after a
    separator starts a new document at position 0. Returns doc_ids (B, S+1), positions (B, S+1).
    """
    is_sep = window == sep_id  # (B, S+1)
    starts = np.zeros_like(is_sep)
    starts[:, 1:] = is_sep[:, :-1]  # a new document begins right after a separator
    doc = np.cumsum(starts, axis=1)  # (B, S+1)
    idx = np.broadcast_to(np.arange(window.shape[1]), window.shape)
    first = np.where(starts, idx, 0)
    first[:, 0] = 0
    first = np.maximum.accumulate(first, axis=1)  # index where the current document began
    return doc, idx - first


def make_batch(window: np.ndarray, sep_id: int | None = None) -> Batch:
    """(B, S+1) token windows -> Batch with x = w[:, :-1], y = w[:, 1:] (int64)."""
    w = torch.from_numpy(window.astype(np.int64))
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
    if sep_id is None:
        return Batch(x, y)
    doc, pos = document_layout(window, sep_id)
    doc_t = torch.from_numpy(doc)
    # the target of position s is token s+1: ignore it when s+1 lies in the next document
    y = y.masked_fill(doc_t[:, 1:] != doc_t[:, :-1], IGNORE_INDEX)
    return Batch(x, y, torch.from_numpy(pos[:, :-1].copy()), doc_t[:, :-1].contiguous())


def get_batch(
    data: np.ndarray,
    batch_size: int,
    seq_len: int,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    sep_id: int | None = None,
) -> Batch:
    """B random windows of S + 1 tokens: x (B, S), y (B, S) = x shifted by one, on ``device``.

    Start indices are uniform over all n - S valid starts [0, n - S - 1] (torch.randint with
    ``generator``, so a seeded generator gives the same batches and its state can be checkpointed).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    n = len(data)
    if n < seq_len + 1:
        raise ValueError(
            f"the token data has {n} tokens; a window of seq_len={seq_len} needs at least {seq_len + 1}"
        )
    device = resolve_device(device)
    starts = torch.randint(0, n - seq_len, (batch_size,), generator=generator).numpy()  # (B,)
    window = np.stack([np.asarray(data[i : i + seq_len + 1]) for i in starts])  # (B, S+1)
    return make_batch(window, sep_id).to(device)


def sequential_batches(
    data: np.ndarray,
    batch_size: int,
    seq_len: int,
    device: str | torch.device = "cpu",
    max_batches: int | None = None,
    sep_id: int | None = None,
) -> Iterator[Batch]:
    """Non-overlapping windows from the start of ``data`` (evaluation): starts 0, S, 2S, ...

    Every token except the first is a target exactly once (up to the last full window).
    The last batch may hold fewer than B rows.
    """
    n = len(data)
    if n < seq_len + 1:
        raise ValueError(
            f"the token data has {n} tokens; a window of seq_len={seq_len} needs at least {seq_len + 1}"
        )
    device = resolve_device(device)
    starts = list(range(0, n - seq_len, seq_len))
    for b, i0 in enumerate(range(0, len(starts), batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        window = np.stack(
            [np.asarray(data[i : i + seq_len + 1]) for i in starts[i0 : i0 + batch_size]]
        )
        yield make_batch(window, sep_id).to(device)


def split_documents(data: np.ndarray, sep_id: int) -> list[np.ndarray]:
    """Cut a token stream after each separator: each document keeps its closing separator."""
    ends = np.flatnonzero(np.asarray(data) == sep_id) + 1
    return [d for d in np.split(np.asarray(data), ends) if len(d)]


def pack_documents(docs: Sequence[Sequence[int]], seq_len: int, sep_id: int) -> Batch:
    """Pack whole documents (each ending with ``sep_id``; added if missing) into rows of S + 1 tokens.

    Rows are filled first-fit in the given order; a document longer than S + 1 is split into
    pieces of S + 1 that overlap by one token, so every token after a document's first is a
    target exactly once. Unused slots at a row's end hold ``sep_id`` with ignored targets. Returns a Batch of
    R rows with positions/document_ids set (the packing mask), on the CPU.
    """
    width = seq_len + 1
    rows: list[list[int]] = []
    free: list[int] = []
    for d in docs:
        d = list(d)
        if not d or d[-1] != sep_id:
            d.append(sep_id)
        for k in range(0, max(len(d) - 1, 1), seq_len):
            piece = d[k : k + width]
            for r, space in enumerate(free):
                if space >= len(piece):
                    rows[r] += piece
                    free[r] -= len(piece)
                    break
            else:
                rows.append(piece)
                free.append(width - len(piece))
    lengths = [len(r) for r in rows]
    window = np.full((len(rows), width), sep_id, dtype=np.int64)
    for r, row in enumerate(rows):
        window[r, : len(row)] = row
    batch = make_batch(window, sep_id)
    for r, n in enumerate(lengths):
        # no loss on padding; pad tokens are separators, so each one is its own document and
        # causal attention keeps real tokens from ever seeing them
        batch.y[r, max(n - 1, 0) :] = IGNORE_INDEX
    return batch


def token_budget_batches(
    lengths: Sequence[int], max_tokens: int, shuffle: bool = True, seed: int = 0
) -> list[list[int]]:
    """Group variable-length sequences so each padded batch holds at most ``max_tokens`` tokens.

    Sequences are sorted by length (little padding), cut greedily into batches with
    len(batch) · max(length in batch) <= max_tokens, then the batch order is shuffled (seeded).
    Returns lists of indices into ``lengths``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    too_long = [i for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        raise ValueError(
            f"sequence {too_long[0]} has {lengths[too_long[0]]} tokens > max_tokens={max_tokens}"
        )
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    if shuffle:
        g = torch.Generator().manual_seed(seed)
        batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
    return batches


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int = 0) -> Batch:
    """Right-pad sequences to the longest: x (B, S) = seq[:-1], y = seq[1:], padding ignored (-100)."""
    if not seqs:
        raise ValueError("pad_batch needs at least one sequence")
    if min(len(s) for s in seqs) < 2:
        raise ValueError("every sequence needs >= 2 tokens (one input, one target)")
    width = max(len(s) for s in seqs)
    w = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    y_mask = torch.ones((len(seqs), width - 1), dtype=torch.bool)
    for r, s in enumerate(seqs):
        w[r, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        y_mask[r, : len(s) - 1] = False
    return Batch(w[:, :-1].contiguous(), w[:, 1:].masked_fill(y_mask, IGNORE_INDEX).contiguous())
