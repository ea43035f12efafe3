"""Autoregressive generation: prefill the prompt once, then decode one token per step with the KV cache.

Seed 000 §2.4 (KV cache), §2.6 (sampling: temperature, top-k, top-p); seed 001 "推理流程"
(prefill vs decode). The full engine (paged cache, continuous batching, speculation) builds on this.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from lmstack.inference.kv_cache import KVCache


def sample_next(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """logits (B, V) -> next ids (B,). temperature 0 is greedy (argmax)."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
        logits = torch.full_like(logits, -torch.inf).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, stop_ids: Sequence[int] = (),
             seed: int = 0, use_cache: bool = True) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` new token ids for one prompt, stopping after a stop id."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; generation needs at least one token")
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
        nxt = sample_next(logits.cpu(), temperature, top_k, top_p, gen)  # (1,)
        token = int(nxt)
        yield token
        if token in stop_ids:
            return
        step_ids = nxt.view(1, 1).to(device)
        ids = torch.cat([ids, step_ids], dim=1)
        positions = positions[-1:] + 1
