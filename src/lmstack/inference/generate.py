"""Autoregressive generation: prefill the prompt once, then decode one token per step with the KV cache.

Seed 000 §2.4 (KV cache), §2.6 (sampling: temperature, top-k, top-p); seed 001 "推理流程"
(prefill vs decode). The full engine (paged cache, continuous batching, speculation) builds on this.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from lmstack.inference.kv_cache import KVCache
from lmstack.inference.prompts import prompt_token_ids
from lmstack.inference.sampling import SamplingParams, sample_token


@torch.inference_mode()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = 1.0, stop_ids: Sequence[int] = (),
             seed: int = 0, use_cache: bool = True, min_p: float = 0.0,
             repetition_penalty: float = 1.0, decoder=None) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` new token ids for one prompt, stopping after a stop id.

    Batch 1 with the contiguous cache: the path for one interactive stream. ``decoder``: a
    ``StaticDecoder`` of this model (static cache, optionally a compiled decode step) to use
    instead; it is reset first and can be reused across calls. The ``LLMEngine`` serves many
    requests over the paged cache. The sampling arguments are checked by ``SamplingParams``
    and the prompt by ``prompt_token_ids``, as in the engine, before anything runs.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty, max_tokens=max_new_tokens,
                            stop_token_ids=stop_ids, seed=seed)
    prompt_ids = prompt_token_ids(prompt_ids, model.config.vocab_size, name="prompt_ids")
    if decoder is not None:
        yield from _generate_static(decoder, prompt_ids, params)
        return
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    total = len(prompt_ids) + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_seq_len={model.config.max_seq_len}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    cache = KVCache(model.config, 1, total, dtype=dtype, device=device) if use_cache else None
    positions = torch.arange(len(ids), device=device)
    step_ids = torch.tensor([ids], device=device)  # (1, S)
    for _ in range(max_new_tokens):
        if cache is not None:
            logits = model(step_ids, positions, kv_cache=cache, last_n=1)[0, -1]  # (V,)
        else:
            logits = model(torch.tensor([ids], device=device), last_n=1)[0, -1]
        token = sample_token(logits.cpu(), params, gen, ids)
        yield token
        if token in params.stop_token_ids:
            return
        ids.append(token)
        step_ids = torch.tensor([[token]], device=device)  # (1, 1)
        positions = positions[-1:] + 1


def _generate_static(decoder, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
    total = len(prompt_ids) + params.max_tokens
    if total > decoder.cache.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_tokens}) exceeds the decoder's "
                         f"max_seq_len={decoder.cache.max_seq_len}")
    gen = torch.Generator(device="cpu").manual_seed(params.seed)
    ids = list(prompt_ids)
    decoder.reset()
    logits = decoder.prefill(ids)  # (V,)
    for i in range(params.max_tokens):
        token = sample_token(logits.cpu(), params, gen, ids)
        yield token
        if token in params.stop_token_ids or i + 1 == params.max_tokens:
            return
        ids.append(token)
        position = torch.tensor([len(ids) - 1], device=decoder.device)
        logits = decoder.decode(torch.tensor([[token]], device=decoder.device), position)  # (V,)
