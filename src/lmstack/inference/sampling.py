"""Sampling: turn one step's logits into the next token (seed 000 §2.6, seed 001 "推理流程").

The order follows the industrial samplers the seed describes (and HF / vLLM):

1. repetition penalty on the raw logits (CTRL): for every token already in the prompt or
   the output, a positive logit is divided by the penalty and a negative one multiplied;
2. temperature: logits / τ (τ = 0 means greedy: the distribution is one-hot on the argmax);
3. top-k: keep the k largest logits;
4. top-p (nucleus): keep the smallest set of most likely tokens whose probability reaches p
   (a token is dropped when the tokens ranked above it already sum to ≥ p, so the first
   token is always kept — the seed's ``sorted_mask[..., 1:] = sorted_mask[..., :-1]`` shift);
5. min-p: keep tokens whose probability is at least min_p · p_max.

``SamplingParams`` also carries the stopping rules (max_tokens, stop token ids, stop strings)
and the per-request seed. ``target_probs`` returns the filtered distribution itself because
speculative decoding (seed 000 §2.3) needs p and q, not only a sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 is greedy. ``top_k`` 0 or None, ``top_p`` 1 and ``min_p`` 0 switch those
    filters off; ``repetition_penalty`` 1 is off. ``logprobs``: None returns none; n ≥ 0
    returns the sampled token's log-probability and the n most likely alternatives, under the
    model's own distribution (raw logits, before penalties, temperature and filters).
    ``seed`` makes this request's samples reproducible whatever else runs in the batch.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    stop: Sequence[str] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k={self.top_k!r} must be a non-negative integer (0 or None = off)")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] (1 = off)")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1] (0 = off)")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be > 0 (1 = off)")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be a positive integer")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs={self.logprobs!r} must be None or an integer >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0


def apply_repetition_penalty(logits: Tensor, history: Tensor | Sequence[int], penalty: float) -> Tensor:
    """logits (V,) or (B, V); history: token ids seen so far (prompt and output). Returns a copy."""
    if penalty == 1.0:
        return logits
    history = torch.as_tensor(history, dtype=torch.long, device=logits.device)
    if history.numel() == 0:
        return logits
    out = logits.clone()
    seen = out[..., history]
    out[..., history] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return out


def filter_logits(logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
                  min_p: float = 0.0) -> Tensor:
    """Temperature, top-k, top-p and min-p on logits (..., V) > 0-temperature; dropped tokens get -inf.

    Returns float32 logits whose softmax is the distribution to sample from.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 here; greedy is handled by the caller")
    logits = logits.float() / temperature
    V = logits.shape[-1]
    if top_k:
        kth = torch.topk(logits, min(top_k, V), dim=-1).values[..., -1:]  # the k-th largest logit
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # the tokens ranked above already reach p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -torch.inf)
    if min_p > 0.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), -torch.inf)
    return logits


def target_probs(logits: Tensor, params: SamplingParams, history: Tensor | Sequence[int] | None = None) -> Tensor:
    """The distribution a request samples from: logits (..., V) -> probabilities (..., V), float32.

    Greedy (temperature 0) is the one-hot distribution on the argmax, so speculative decoding's
    accept/reject rule needs no special case for it.
    """
    if history is not None and params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    if params.greedy:
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return filter_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p).softmax(dim=-1)


def sample_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                 history: Tensor | Sequence[int] | None = None) -> int:
    """logits (V,) -> one token id under ``params``."""
    if params.repetition_penalty != 1.0 and history is not None:
        logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    if params.greedy:
        return int(logits.argmax())
    probs = filter_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p).softmax(dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def token_logprobs(logits: Tensor, token: int, n_top: int) -> tuple[float, dict[int, float]]:
    """log p(token) and the ``n_top`` most likely tokens' log-probabilities under softmax(logits (V,))."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: dict[int, float] = {}
    if n_top > 0:
        values, ids = torch.topk(logp, min(n_top, logp.shape[-1]))
        top = {int(i): float(v) for i, v in zip(ids, values)}
    return float(logp[token]), top


def find_stop_string(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index in ``text`` where the earliest stop string begins (searching from ``start``), or -1."""
    best = -1
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best == -1 or i < best):
            best = i
    return best
