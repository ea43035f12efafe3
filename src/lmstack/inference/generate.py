"""Batch-1 generation: prefill the prompt once, then decode with the KV cache — one loop, step strategies.

Book of LLMs §2.4 (KV cache), §2.3 (speculative decoding), §2.6 (sampling); CS336 notes "推理流程"
(prefill vs decode; text is shown as soon as it forms complete UTF-8, TTFT and decode tokens/s).
The contiguous cache, the static (compiled) decoder, full recomputation and speculation are
strategies of ``_decode``; the ``LLMEngine`` is the batched loop over the paged cache.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from lmstack.inference.kv_cache import KVCache, LatentKVCache, MixerCache
from lmstack.inference.prompts import prompt_token_ids
from lmstack.inference.sampling import SamplingParams, sample_token
from lmstack.inference.speculative import verify_drafts
from lmstack.inference.stops import StopStrings, token_stop
from lmstack.model.cache import Ability, has
from lmstack.model.mixer_spec import layer_kinds


@torch.inference_mode()
def generate(
    model,
    prompt_ids: Sequence[int],
    params: SamplingParams | None = None,
    *,
    decoder=None,
    use_cache: bool = True,
    speculation=None,
) -> Iterator[int]:
    """Yield up to ``params.max_tokens`` new token ids for one prompt, stopping by ``params``' rules.

    Batch 1, one loop (``_decode``) over a step strategy: the contiguous ``KVCache`` (default), a
    ``StaticDecoder`` of this model (``decoder``: static cache, optionally a compiled decode step;
    reset first, reusable across calls) or full recomputation (``use_cache=False``). ``speculation``:
    a ``PromptLookup`` or ``DraftModel`` (``lmstack.inference.speculative``) proposes drafts that the
    same loop verifies with the one accept/reject rule; its ``stats`` count forwards and acceptances.
    The ``LLMEngine`` serves many requests over the paged cache with the same sampler, stop rules
    and prompt lookup. ``params`` default: greedy, 16 tokens; seed None means 0.
    """
    params = params if params is not None else SamplingParams(temperature=0.0)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    prompt_ids = prompt_token_ids(prompt_ids, model.config.vocab_size, name="prompt_ids")
    if speculation is not None and params.logits_processors:
        raise ValueError(
            "logits_processors with speculation: drafts are verified against the raw distribution, "
            "which the processors would change; pass speculation=None"
        )
    extra = (
        speculation.k + 1 if speculation is not None else 0
    )  # drafts are fed past the last kept token
    total = len(prompt_ids) + params.max_tokens + extra
    limit, where = (
        (decoder.cache.max_seq_len, "the decoder's ")
        if decoder is not None
        else (model.config.max_seq_len, "")
    )
    if total > limit:
        spec = f" + k+1 ({extra})" if extra else ""
        raise ValueError(
            f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}){spec} exceeds {where}"
            f"max_seq_len={limit}"
        )
    if speculation is not None:
        speculation.start(model, total)
    step: StaticStep | CachedStep | RecomputeStep
    if decoder is not None:
        decoder.reset()
        step = StaticStep(decoder)
    else:
        step = CachedStep(model, total) if use_cache else RecomputeStep(model)
    yield from _decode(step, prompt_ids, params, speculation)


def _decode(step, prompt_ids: list[int], params: SamplingParams, speculation=None) -> Iterator[int]:
    """The batch-1 loop. Each iteration: the proposer (if any) drafts ≤ k tokens; ``step(ids, done,
    drafts)`` feeds the uncached ids[done:] and the drafts in one forward and returns the logits
    (k + 1, V) at the last token and at each draft; one token is sampled (``sample_token``) or the
    drafts are checked (``verify_drafts``); the caches roll back to what was kept; the emitted
    tokens are yielded until a stop rule (``token_stop``) fires."""
    gen = torch.Generator(device="cpu").manual_seed(params.seed if params.seed is not None else 0)
    ids = list(prompt_ids)
    done = 0  # tokens whose K/V the target has cached
    while True:
        drafts, q = [], None
        if speculation is not None:
            room = (
                params.max_tokens - (len(ids) - len(prompt_ids)) - 1
            )  # the last token is never a draft
            drafts, q = speculation.draft(ids, room, params, gen)
        logits = step(ids, done, drafts)  # (k+1, V)
        if speculation is None:
            emitted, kept = (
                [sample_token(logits[-1].cpu(), params, gen, ids, ids[len(prompt_ids) :])],
                0,
            )
        else:
            emitted, kept = verify_drafts(logits, drafts, params, ids, gen, q)
            speculation.stats.record(len(drafts), kept)
            speculation.rollback(len(ids) + kept)
            step.truncate(len(ids) + kept)
        done = len(ids) + kept
        for token in emitted:
            yield token
            ids.append(token)
            if speculation is not None:
                speculation.stats.emitted += 1
            if token_stop(token, len(ids) - len(prompt_ids), params) is not None:
                return


def contiguous_cache(config, total: int, dtype: torch.dtype, device):
    """The batch-1 cache a model's layers need: K/V per head (``KVCache``), MLA's latent
    (``LatentKVCache``), or a hybrid's K/V and recurrent states (``MixerCache``)."""
    kinds = set(layer_kinds(config))  # each layer's mixer kind (model.mixer_spec)
    if kinds == {"attention"}:
        return KVCache(config, 1, total, dtype=dtype, device=device)
    if kinds == {"mla"}:
        return LatentKVCache(config, 1, total, device=device, dtype=dtype)
    return MixerCache()


class CachedStep:
    """The default step: a contiguous cache (``contiguous_cache``) for one sequence of up to ``total`` tokens."""

    def __init__(self, model, total: int):
        p = next(model.parameters())
        self.model, self.device = model, p.device
        self.cache = contiguous_cache(model.config, total, p.dtype, p.device)

    def __call__(self, ids: list[int], start: int, drafts: list[int]) -> Tensor:
        new = torch.tensor([ids[start:] + drafts], device=self.device)  # (1, T)
        pos = torch.arange(start, len(ids) + len(drafts), device=self.device)
        return self.model(new, pos, kv_cache=self.cache, last_n=len(drafts) + 1)[0]  # (k+1, V)

    def truncate(self, length: int) -> None:
        if not has(self.cache, Ability.ROLLBACK):  # a recurrent state cannot be rolled back
            raise ValueError(
                f"speculation needs a cache that rolls back rejected drafts; {type(self.cache).__name__} "
                "holds recurrent states (use_cache=False speculates by recomputing)"
            )
        self.cache.truncate(length)


class RecomputeStep:
    """No cache: the whole sequence every step (the reference the cached paths are checked against)."""

    def __init__(self, model):
        self.model, self.device = model, next(model.parameters()).device

    def __call__(self, ids: list[int], start: int, drafts: list[int]) -> Tensor:
        return self.model(torch.tensor([ids + drafts], device=self.device), last_n=len(drafts) + 1)[
            0
        ]

    def truncate(self, length: int) -> None:
        pass


class StaticStep:
    """A ``StaticDecoder``: one token at a time through its (compiled) decode step; the prompt and
    speculative verification (several tokens) run eagerly over the same static cache."""

    def __init__(self, decoder):
        self.decoder = decoder

    def __call__(self, ids: list[int], start: int, drafts: list[int]) -> Tensor:
        d = self.decoder
        if start > 0 and len(ids) - start == 1 and not drafts:
            position = torch.tensor([start], device=d.device)  # (1,)
            return d.decode(torch.tensor([[ids[start]]], device=d.device), position)[None]  # (1, V)
        return d.forward(ids[start:] + drafts, start, last_n=len(drafts) + 1)  # (k+1, V)

    def truncate(self, length: int) -> None:
        self.decoder.cache.truncate(length)


def stream_generate(
    model, tokenizer, prompt: str, params: SamplingParams, out=None, decoder=None, speculation=None
) -> dict:
    """Generate, writing text to ``out`` (stdout) as it is decoded; returns counts and timings.

    The model's EOS id is added to ``params.stop_token_ids``; ``params.stop`` strings end generation
    and the text from the stop string on is not written (``StopStrings`` holds back what may be the
    start of one, as the engine does).
    """
    out = out or sys.stdout
    ids = tokenizer.encode(prompt)
    eos = model.config.eos_token_id
    if eos is not None and not params.ignore_eos and eos not in params.stop_token_ids:
        params = replace(params, stop_token_ids=(*params.stop_token_ids, eos))
    stop_ids = set(params.stop_token_ids)
    new: list[int] = []
    text = StopStrings(tokenizer, params.stop)
    t0 = time.perf_counter()
    first = None
    for token in generate(model, ids, params, decoder=decoder, speculation=speculation):
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
    return {
        "prompt_tokens": len(ids),
        "new_tokens": len(new),
        "ttft_s": (first or t1) - t0,
        "text": text.text,
        "total_s": t1 - t0,
        "decode_tokens_per_s": (len(new) - 1) / decode_s if len(new) > 1 else float("nan"),
    }
