"""Autoregressive generation: prefill the prompt once, then decode one token per step with the KV cache.

Seed 000 §2.4 (KV cache), §2.6 (sampling: temperature, top-k, top-p); seed 001 "推理流程"
(prefill vs decode; text is shown as soon as it forms complete UTF-8, TTFT and decode tokens/s).
The full engine (paged cache, continuous batching, speculation) builds on this.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from lmstack.inference.kv_cache import KVCache
from lmstack.inference.prompts import prompt_token_ids
from lmstack.inference.sampling import SamplingParams, sample_token
from lmstack.inference.stops import StopStrings, token_stop


@torch.inference_mode()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = 1.0, stop_ids: Sequence[int] = (),
             seed: int = 0, use_cache: bool = True, min_p: float = 0.0,
             repetition_penalty: float = 1.0, decoder=None) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` new token ids for one prompt, stopping after a stop id.

    Batch 1 with the contiguous cache: the path for one interactive stream. ``decoder``: a
    ``StaticDecoder`` of this model (static cache, optionally a compiled decode step) to use
    instead; it is reset first and can be reused across calls. ``use_cache=False`` recomputes the
    whole sequence every step. The ``LLMEngine`` serves many requests over the paged cache. The
    sampling arguments are checked by ``SamplingParams`` and the prompt by ``prompt_token_ids``,
    as in the engine, before anything runs.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty, max_tokens=max_new_tokens,
                            stop_token_ids=stop_ids, seed=seed)
    prompt_ids = prompt_token_ids(prompt_ids, model.config.vocab_size, name="prompt_ids")
    total = len(prompt_ids) + max_new_tokens
    limit, where = (decoder.cache.max_seq_len, "the decoder's ") if decoder is not None else (model.config.max_seq_len, "")
    if total > limit:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds {where}"
                         f"max_seq_len={limit}")
    if decoder is not None:
        decoder.reset()
        step = _static_step(decoder)
    else:
        step = _cached_step(model, total) if use_cache else _recompute_step(model)
    yield from _decode(step, prompt_ids, params)


def _decode(step, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
    """The batch-1 loop: ``step(ids, start)`` feeds ids[start:] and returns the last logits (V,);
    sample (``sample_token``), yield, stop by the token rules (``token_stop``)."""
    gen = torch.Generator(device="cpu").manual_seed(params.seed)
    ids = list(prompt_ids)
    logits = step(ids, 0)
    while True:
        token = sample_token(logits.cpu(), params, gen, ids)
        yield token
        ids.append(token)
        if token_stop(token, len(ids) - len(prompt_ids), params) is not None:
            return
        logits = step(ids, len(ids) - 1)


def _cached_step(model, total: int):
    p = next(model.parameters())
    cache = KVCache(model.config, 1, total, dtype=p.dtype, device=p.device)

    def step(ids: list[int], start: int) -> Tensor:
        new = torch.tensor([ids[start:]], device=p.device)  # (1, T)
        return model(new, torch.arange(start, len(ids), device=p.device), kv_cache=cache, last_n=1)[0, -1]
    return step


def _recompute_step(model):
    device = next(model.parameters()).device
    return lambda ids, start: model(torch.tensor([ids], device=device), last_n=1)[0, -1]


def _static_step(decoder):
    def step(ids: list[int], start: int) -> Tensor:
        if start == 0:
            return decoder.prefill(ids)  # (V,)
        position = torch.tensor([start], device=decoder.device)  # (1,)
        return decoder.decode(torch.tensor([[ids[start]]], device=decoder.device), position)  # (V,)
    return step


def stream_generate(model, tokenizer, prompt: str, max_tokens: int, out=None, stop: tuple[str, ...] = (),
                    decoder=None, **sampling) -> dict:
    """Generate, writing text to ``out`` (stdout) as it is decoded; returns counts and timings.

    ``stop`` strings end generation; the text from the stop string on is not written (``StopStrings``
    holds back what may be the start of one, as the engine does).
    """
    out = out or sys.stdout
    ids = tokenizer.encode(prompt)
    stop_ids = [t for t in (model.config.eos_token_id,) if t is not None]
    new: list[int] = []
    text = StopStrings(tokenizer, stop)
    t0 = time.perf_counter()
    first = None
    for token in generate(model, ids, max_tokens, stop_ids=stop_ids, decoder=decoder, **sampling):
        if first is None:
            first = time.perf_counter()
        new.append(token)
        if token in stop_ids or text.update(new):
            break
        out.write(text.emit(finished=False)[1])
        out.flush()
    t1 = time.perf_counter()
    if new and new[-1] in stop_ids:
        text.update(new[:-1])
    out.write(text.emit(finished=True)[1] + "\n")
    out.flush()
    decode_s = t1 - first if first is not None and len(new) > 1 else float("nan")
    return {"prompt_tokens": len(ids), "new_tokens": len(new), "ttft_s": (first or t1) - t0, "text": text.text,
            "total_s": t1 - t0, "decode_tokens_per_s": (len(new) - 1) / decode_s if len(new) > 1 else float("nan")}
