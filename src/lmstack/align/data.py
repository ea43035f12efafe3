"""Post-training data: prompt/response examples through the model's chat template, the response mask, padded
and packed batches, and preference pairs from JSONL.

An example is (prompt ids, response ids). Its training row is ``ids = prompt + response`` with inputs
x = ids[:-1] and targets y = ids[1:]; a target is kept only where it is a response token (the prompt and the
padding get −100, lmstack.train's ignore index), so the loss is the completion-only NLL of TRL's SFTTrainer.

The prompt is rendered with ``add_generation_prompt=True`` (what the engine sees when it generates), and the
response ids are the rest of the rendered conversation (the reply and the template's end-of-turn tokens), encoded
on its own: training sees exactly the prompt tokens the engine will be given.

Packing (``pack``) puts many examples in one row with per-document attention (``document_ids``, the model's
packing seam) and positions restarting at 0 in each, so a packed row computes what each example would alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lmstack import utils
from lmstack.train.data import Batch
from lmstack.train.losses import IGNORE_INDEX


@dataclass
class Example:
    """One prompt (ids) and one response (ids); ``truncated``: the response was cut to fit the context."""

    prompt: list[int]
    response: list[int]
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)


class DataError(ValueError):
    """A malformed data file or row (the message names the file and line)."""


def as_messages(prompt: str | list[dict], system: str | None = None) -> list[dict]:
    """A prompt string (one user turn, after an optional system turn) or a message list -> messages."""
    if isinstance(prompt, str):
        msgs = [{"role": "user", "content": prompt}]
        return ([{"role": "system", "content": system}] if system else []) + msgs
    return list(prompt)


def encode_prompt(
    tokenizer, prompt: str | list[dict], system: str | None = None, chat: bool = True
) -> list[int]:
    """Prompt ids as the engine will be given them: the chat template with the generation prompt (``chat``
    and the tokenizer has a template), else the plain text."""
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(
            tokenizer.apply_chat_template(as_messages(prompt, system), add_generation_prompt=True)
        )
    if not isinstance(prompt, str):
        raise DataError("a message-list prompt needs a tokenizer with a chat template")
    return tokenizer.encode(prompt)


def encode_example(
    tokenizer,
    prompt: str | list[dict],
    response: str,
    system: str | None = None,
    chat: bool = True,
    max_len: int | None = None,
) -> Example:
    """Tokenise one (prompt, response) pair through the chat template.

    The response ids are the rendered conversation after the rendered prompt (the reply plus the template's
    end-of-turn marker, e.g. ``<|im_end|>\\n``); without a template, the response text plus the EOS token.
    ``max_len``: a prompt of ``max_len`` tokens or more is refused (nothing would be left to learn); a longer
    response is cut to fit (``truncated``)."""
    if not isinstance(response, str):
        raise DataError(f"response={response!r:.40} must be a string")
    if not response.strip():
        raise DataError("the response is empty: there is no token to learn")
    prompt_ids = encode_prompt(tokenizer, prompt, system, chat)
    if chat and getattr(tokenizer, "chat_template", None):
        msgs = as_messages(prompt, system)
        head = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(msgs + [{"role": "assistant", "content": response}])
        if not full.startswith(head):
            raise DataError(
                "the chat template renders the prompt differently alone and inside the conversation; "
                "the response cannot be separated from it"
            )
        response_ids = tokenizer.encode(full[len(head) :])
    else:
        response_ids = tokenizer.encode(response)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            response_ids.append(tokenizer.eos_token_id)
    return fit_example(Example(prompt_ids, response_ids), max_len)


def fit_example(ex: Example, max_len: int | None) -> Example:
    """Refuse a prompt that leaves no room in ``max_len``; cut the response to fit."""
    if not ex.response:
        raise DataError("the response is empty: there is no token to learn")
    if max_len is None:
        return ex
    if len(ex.prompt) >= max_len:
        raise DataError(
            f"the prompt has {len(ex.prompt)} tokens, which leaves no room for a response within the "
            f"context of {max_len} tokens"
        )
    if len(ex) > max_len:
        return Example(ex.prompt, ex.response[: max_len - len(ex.prompt)], True)
    return ex


def _row(ex: Example) -> tuple[list[int], list[int]]:
    """(x, y) of one example: x = ids[:-1], y = ids[1:] with non-response targets ignored."""
    ids = ex.prompt + ex.response
    y = [t if i + 1 >= len(ex.prompt) else IGNORE_INDEX for i, t in enumerate(ids[1:])]
    return ids[:-1], y


def collate(examples: Sequence[Example], pad_id: int = 0) -> Batch:
    """Right-padded batch: x (B, S), y (B, S) (−100 on prompt and padding), S = the longest example − 1."""
    if not examples:
        raise DataError("collate needs at least one example")
    rows = [_row(ex) for ex in examples]
    S = max(len(x) for x, _ in rows)
    x = torch.full((len(rows), S), pad_id, dtype=torch.long)
    y = torch.full((len(rows), S), IGNORE_INDEX, dtype=torch.long)
    for r, (xs, ys) in enumerate(rows):
        x[r, : len(xs)] = torch.tensor(xs)
        y[r, : len(ys)] = torch.tensor(ys)
    return Batch(x, y)


def pack(
    examples: Sequence[Example], seq_len: int, pad_id: int = 0
) -> tuple[Batch, list[list[int]]]:
    """Pack examples into rows of S = ``seq_len`` positions, first fit in the given order.

    Each example keeps its own document id (attention never crosses into another) and positions 0..n−1; the
    unused tail of a row is padding with its own document id and ignored targets. Returns the Batch
    (x, y, positions, document_ids, all (R, S)) and, per row, the indices of the examples it holds."""
    rows: list[list[tuple[int, list[int], list[int]]]] = []
    free: list[int] = []
    for i, ex in enumerate(examples):
        x, y = _row(ex)
        if len(x) > seq_len:
            raise DataError(f"example {i} needs {len(x)} positions, more than seq_len={seq_len}")
        for r, space in enumerate(free):
            if space >= len(x):
                rows[r].append((i, x, y))
                free[r] -= len(x)
                break
        else:
            rows.append([(i, x, y)])
            free.append(seq_len - len(x))
    R = len(rows)
    x = torch.full((R, seq_len), pad_id, dtype=torch.long)
    y = torch.full((R, seq_len), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros((R, seq_len), dtype=torch.long)
    doc = torch.zeros((R, seq_len), dtype=torch.long)
    members = []
    for r, row in enumerate(rows):
        at = 0
        for d, (_, xs, ys) in enumerate(row):
            n = len(xs)
            x[r, at : at + n], y[r, at : at + n] = torch.tensor(xs), torch.tensor(ys)
            pos[r, at : at + n] = torch.arange(n)
            doc[r, at : at + n] = d
            at += n
        doc[r, at:] = len(row)  # the padding: a document of its own
        pos[r, at:] = torch.arange(seq_len - at)
        members.append([i for i, _, _ in row])
    return Batch(x, y, pos, doc), members


def response_mask(batch: Batch) -> torch.Tensor:
    """(B, S) 1 where the target is a response token."""
    return (batch.y != IGNORE_INDEX).long()


# ---- JSONL -----------------------------------------------------------------------------------------------


def read_jsonl(path: str | os.PathLike, fields: Sequence[str]) -> list[dict]:
    """Rows of a JSONL file, each an object with string ``fields`` (extra keys kept). A malformed row is a
    ``DataError`` naming the file and the line; blank lines are skipped."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such JSONL file")
    rows = []
    for n, row in utils.read_jsonl(p, DataError):
        missing = [k for k in fields if k not in row]
        if missing:
            raise DataError(f"{p}:{n}: missing {missing} (a row needs {list(fields)})")
        bad = [
            k
            for k in fields
            if not (isinstance(row[k], str) or (k == "prompt" and isinstance(row[k], list)))
        ]
        if bad:
            raise DataError(f"{p}:{n}: {bad[0]}={row[bad[0]]!r:.40} must be a string")
        empty = [k for k in fields if k != "prompt" and not row[k].strip()]
        if empty:
            raise DataError(f"{p}:{n}: {empty[0]} is empty")
        rows.append(row)
    if not rows:
        raise DataError(f"{p}: no rows")
    return rows


def read_preferences(path: str | os.PathLike) -> list[dict]:
    """Preference pairs: JSONL rows {"prompt", "chosen", "rejected"} (TRL's explicit-prompt format)."""
    return read_jsonl(path, ("prompt", "chosen", "rejected"))


def read_sft(path: str | os.PathLike) -> list[dict]:
    """SFT examples: JSONL rows {"prompt", "response"}."""
    return read_jsonl(path, ("prompt", "response"))


def write_jsonl(path: str | os.PathLike, rows: Sequence[dict]) -> None:
    """Rows as JSONL, written atomically."""
    utils.atomic_write_text(
        Path(path), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    )
