"""Autoregressive generation: prefill the prompt once, then decode one token per step with the KV cache.

Seed 000 §2.4 (KV cache), §2.6 (sampling: temperature, top-k, top-p); seed 001 "推理流程"
(prefill vs decode). The full engine (paged cache, continuous batching, speculation) builds on this.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from lmstack.inference.kv_cache import KVCache
from lmstack.inference.sampling import apply_repetition_penalty, filter_logits


def sample_next(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None, min_p: float = 0.0) -> Tensor:
    """logits (B, V) -> next ids (B,). temperature 0 is greedy (argmax); filters as in ``sampling``."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits, temperature, top_k, 1.0 if top_p is None else top_p, min_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, stop_ids: Sequence[int] = (),
             seed: int = 0, use_cache: bool = True, min_p: float = 0.0,
             repetition_penalty: float = 1.0, decoder=None) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` new token ids for one prompt, stopping after a stop id.

    Batch 1 with the contiguous cache: the path for one interactive stream. ``decoder``: a
    ``StaticDecoder`` of this model (static cache, optionally a compiled decode step) to use
    instead; it is reset first and can be reused across calls. The ``LLMEngine`` serves many
    requests over the paged cache.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; generation needs at least one token")
    if decoder is not None:
        yield from _generate_static(decoder, prompt_ids, max_new_tokens, temperature, top_k, top_p, stop_ids,
                                    seed, min_p, repetition_penalty)
        return
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    total = len(prompt_ids) + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_seq_len={model.config.max_seq_len}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.tensor([list(prompt_ids)], device=device)  # (1, S)
    cache = KVCache(model.config, 1, total, dtype=dtype, device=device) if use_cache else None
    positions = torch.arange(ids.shape[1], device=device)
    step_ids = ids
    for _ in range(max_new_tokens):
        if cache is not None:
            logits = model(step_ids, positions, kv_cache=cache, last_n=1)[:, -1]  # (1, V)
        else:
            logits = model(ids, last_n=1)[:, -1]
        if repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, ids[0], repetition_penalty)
        nxt = sample_next(logits.cpu(), temperature, top_k, top_p, gen, min_p)  # (1,)
        token = int(nxt)
        yield token
        if token in stop_ids:
            return
        step_ids = nxt.view(1, 1).to(device)
        ids = torch.cat([ids, step_ids], dim=1)
        positions = positions[-1:] + 1


def _generate_static(decoder, prompt_ids, max_new_tokens, temperature, top_k, top_p, stop_ids, seed, min_p,
                     repetition_penalty) -> Iterator[int]:
    total = len(prompt_ids) + max_new_tokens
    if total > decoder.cache.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the decoder's "
                         f"max_seq_len={decoder.cache.max_seq_len}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    decoder.reset()
    logits = decoder.prefill(ids)[None]  # (1, V)
    for i in range(max_new_tokens):
        if repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, torch.tensor(ids, device=logits.device), repetition_penalty)
        nxt = sample_next(logits.cpu(), temperature, top_k, top_p, gen, min_p)  # (1,)
        token = int(nxt)
        yield token
        if token in stop_ids or i + 1 == max_new_tokens:
            return
        ids.append(token)
        position = torch.tensor([len(ids) - 1], device=decoder.device)
        logits = decoder.decode(nxt.view(1, 1).to(decoder.device), position)[None]
