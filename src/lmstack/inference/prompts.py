"""A prompt as the model will see it: text or token ids -> checked token ids.

The one check every decode path runs before touching the model (``LLMEngine.add_request``,
``generate``): a prompt is a string (which needs a tokenizer) or a sequence of integer token
ids, is not empty, and every id is in the model's vocabulary [0, V). Anything else is a
``ValueError`` naming the request and the bad value, never an IndexError from the embedding.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set

import torch

from lmstack.inference.sampling import as_integer


def prompt_token_ids(prompt, vocab_size: int, tokenizer=None, name: str = "prompt") -> list[int]:
    """``prompt`` (str, or an iterable / 1-D tensor of ints) -> a non-empty list of ids in [0, V)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                f"{name}: a text prompt needs a tokenizer; pass token ids or give the engine one"
            )
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not prompt.is_floating_point():
        ids = prompt.tolist()
    elif isinstance(prompt, Iterable) and not isinstance(prompt, (bytes, bytearray, Mapping, Set)):
        ids = list(prompt)  # a list, tuple, range, numpy array ... of ids
    else:
        raise ValueError(
            f"{name}: a prompt is a string or a sequence of token ids, got {type(prompt).__name__} "
            f"({prompt!r:.40})"
        )
    ids = [as_integer(f"{name}: token {i}", t) for i, t in enumerate(ids)]
    if not ids:
        raise ValueError(f"{name}: the prompt is empty; generation needs at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{name}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}) of the model"
            + (" — is the tokenizer larger than the model?" if tokenizer is not None else "")
        )
    return ids
