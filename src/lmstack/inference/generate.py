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

from lmstack.inference.kv_cache import KVCache
from lmstack.inference.prompts import prompt_token_ids
from lmstack.inference.sampling import SamplingParams, find_stop_string, sample_token


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


def stream_generate(model, tokenizer, prompt: str, max_tokens: int, out=None, stop: tuple[str, ...] = (),
                    decoder=None, **sampling) -> dict:
    """Generate, writing text to ``out`` (stdout) as it is decoded; returns counts and timings.

    ``stop`` strings end generation; the text from the stop string on is not written.
    """
    out = out or sys.stdout
    ids = tokenizer.encode(prompt)
    stop_ids = [t for t in (model.config.eos_token_id,) if t is not None]
    new: list[int] = []
    printed = ""
    t0 = time.perf_counter()
    first = None
    text = ""
    hold = max((len(s) for s in stop), default=1) - 1  # chars kept back while a stop string may be forming
    for token in generate(model, ids, max_tokens, stop_ids=stop_ids, decoder=decoder, **sampling):
        if first is None:
            first = time.perf_counter()
        new.append(token)
        if token in stop_ids:
            break
        text = tokenizer.decode(new)
        if stop and find_stop_string(text, stop) != -1:
            break
        if text.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
            continue
        ready = text[:len(text) - hold] if stop else text
        if len(ready) > len(printed):
            out.write(ready[len(printed):])
            out.flush()
            printed = ready
    t1 = time.perf_counter()
    text = tokenizer.decode([t for t in new if t not in stop_ids])
    if stop:
        at = find_stop_string(text, stop)
        text = text if at == -1 else text[:at]
    out.write(text[len(printed):] + "\n")
    out.flush()
    decode_s = t1 - first if first is not None and len(new) > 1 else float("nan")
    return {"prompt_tokens": len(ids), "new_tokens": len(new), "ttft_s": (first or t1) - t0, "text": text,
            "total_s": t1 - t0, "decode_tokens_per_s": (len(new) - 1) / decode_s if len(new) > 1 else float("nan")}
