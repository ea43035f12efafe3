"""Sampling: turn one step's logits into the next token (Book of LLMs §2.6 “sampling”, CS336 notes "推理流程").

The order follows the industrial samplers the seed describes (and HF / vLLM):

1. repetition penalty on the raw logits (CTRL): for every token already in the prompt or
   the output, a positive logit is divided by the penalty and a negative one multiplied;
2. temperature: logits / τ (τ = 0 means greedy: the distribution is one-hot on the argmax; so
   does any τ < 1e-5, where the division would only overflow);
3. top-k: keep the k largest logits;
4. top-p (nucleus): keep the smallest set of most likely tokens whose probability reaches p
   (a token is dropped when the tokens ranked above it already sum to ≥ p, so the first
   token is always kept — the seed's ``sorted_mask[..., 1:] = sorted_mask[..., :-1]`` shift);
5. min-p: keep tokens whose probability is at least min_p · p_max.

``SamplingParams`` also carries the stopping rules (max_tokens, stop token ids, stop strings)
and the per-request seed. ``target_probs`` returns the filtered distribution itself because
speculative decoding (Book of LLMs §2.3 “speculative decoding”) needs p and q, not only a sample.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

GREEDY_BELOW = (
    1e-5  # temperatures below this are greedy (as in vLLM): logits / τ would only overflow
)


class NonFiniteLogitsError(ValueError):
    """The model produced NaN or +inf logits (bad weights, an overflow in the forward pass)."""


def as_real(name: str, value) -> float:
    """``value`` as a float, or a ValueError naming the field (bools and strings are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r:.40} must be a number, got {type(value).__name__}")
    return float(value)


def as_integer(name: str, value, minimum: int | None = None) -> int:
    """``value`` as an int (anything with ``__index__`` but bool), or a ValueError naming the field."""
    try:
        if isinstance(value, bool):
            raise TypeError
        out = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name}={value!r:.40} must be an integer, got {type(value).__name__}"
        ) from None
    if minimum is not None and out < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return out


@dataclass
class SamplingParams:
    """How one request samples and when it stops — the one validation every decode path uses
    (``LLMEngine``, ``generate``, the static decoder, speculative decoding, the CLI flags).

    temperature 0 is greedy, and so is any temperature below ``GREEDY_BELOW`` (1e-5). ``top_k``
    0 or None, ``top_p`` 1 (None is read as 1) and ``min_p`` 0 switch those filters off;
    ``repetition_penalty`` 1 is off. ``logprobs``: None returns none; n ≥ 0 returns the sampled
    token's log-probability and the n most likely alternatives, under the model's own
    distribution (raw logits, before penalties, temperature and filters). ``prompt_logprobs``: None
    returns none; n ≥ 0 returns, for every prompt token after the first, its log-probability given
    the tokens before it and the n most likely tokens there (vLLM's ``prompt_logprobs``; computed in
    the prefill, and such a request never takes a prefix-cache hit). ``seed`` makes this
    request's samples reproducible whatever else runs in the batch. ``logits_processors``:
    callables ``(output token ids so far, logits (V,)) -> logits (V,)`` applied in order before
    the sampler (a server's presence/frequency penalties, a grammar's mask); a request with any
    is sampled row by row and never speculates. Logprobs stay those of the raw logits.
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
    logits_processors: Sequence[Callable] = field(default_factory=tuple)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self.temperature = as_real("temperature", self.temperature)
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)"
            )
        if self.top_k is not None:
            self.top_k = as_integer("top_k", self.top_k, 0)
        self.top_p = 1.0 if self.top_p is None else as_real("top_p", self.top_p)
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] (1 = off)")
        self.min_p = as_real("min_p", self.min_p)
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1] (0 = off)")
        self.repetition_penalty = as_real("repetition_penalty", self.repetition_penalty)
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty!r} must be a finite number > 0 (1 = off)"
            )
        self.max_tokens = as_integer("max_tokens", self.max_tokens, 1)
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(
            self.stop_token_ids, Iterable
        ):
            raise ValueError(
                f"stop_token_ids={self.stop_token_ids!r} must be a sequence of token ids"
            )
        self.stop_token_ids = tuple(as_integer("stop_token_ids", t, 0) for t in self.stop_token_ids)
        if self.seed is not None:
            self.seed = as_integer("seed", self.seed)
            if not -(2**63) <= self.seed < 2**64:
                raise ValueError(f"seed={self.seed} must fit in 64 bits: [-2**63, 2**64)")
        if self.logprobs is not None:
            self.logprobs = as_integer("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = as_integer("prompt_logprobs", self.prompt_logprobs, 0)
        self.logits_processors = tuple(self.logits_processors)
        if any(not callable(p) for p in self.logits_processors):
            raise ValueError(
                f"logits_processors={self.logits_processors!r:.80} must be callables "
                "(output token ids, logits (V,)) -> logits (V,)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def check_logits(logits: Tensor) -> None:
    """Raise ``NonFiniteLogitsError`` when a row of logits (..., V) has a NaN or +inf, or no finite
    value at all: nothing can be sampled from it, and argmax would silently pick garbage."""
    bad = bad_logit_rows(logits)
    if bool(bad.any()):
        row = logits[bad][0] if logits.dim() > 1 else logits
        n_nan, n_inf = int(row.isnan().sum()), int((row == math.inf).sum())
        raise NonFiniteLogitsError(
            f"the model's logits contain {n_nan} NaN and {n_inf} +inf of {row.shape[-1]} values"
            + ("" if n_nan or n_inf else " (every token is -inf)")
            + ": the model produced non-finite values (bad weights or an overflow in the forward pass)"
        )


def bad_logit_rows(logits: Tensor) -> Tensor:
    """logits (..., V) -> (...) bool: rows with a NaN or +inf, or with every value -inf."""
    # the row maximum is NaN when the row holds a NaN (amax propagates it), +inf when it holds +inf,
    # -inf when every value is -inf: one reduction instead of an elementwise test and three passes
    return ~torch.isfinite(logits.amax(dim=-1))


def apply_repetition_penalty(
    logits: Tensor, history: Tensor | Sequence[int], penalty: float
) -> Tensor:
    """logits (V,) or (B, V); history: token ids seen so far (prompt and output). Returns a float64
    copy: x / penalty and x · penalty stay finite there for any penalty down to 1e-300 (an
    overflow beyond that gives +inf, which ``filter_logits`` takes to its limit)."""
    if penalty == 1.0:
        return logits
    history = torch.as_tensor(history, dtype=torch.long, device=logits.device)
    if history.numel() == 0:
        return logits
    out = logits.double()
    seen = out[..., history]
    out[..., history] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return out


def filter_logits(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    min_p: float = 0.0,
    row_max: Tensor | None = None,
) -> Tensor:
    """Temperature, top-k, top-p and min-p on logits (..., V) > 0-temperature; dropped tokens get -inf.

    Returns new float32 logits (never a view of the input) whose softmax is the distribution to sample from,
    each row's maximum 0. ``row_max``: ``logits.amax(dim=-1, keepdim=True)`` when the caller has it already.
    Numerically safe: the row maximum is subtracted before dividing by τ (in the input's dtype:
    float32, or float64 after a repetition penalty), so a small τ can only underflow unlikely
    tokens to probability 0, never overflow; a row holding +inf (an
    overflowed repetition penalty) becomes its limit, uniform over the +inf tokens.
    """
    if temperature <= 0:
        raise ValueError(
            f"temperature={temperature} must be > 0 here; greedy is handled by the caller"
        )
    m = logits.amax(dim=-1, keepdim=True) if row_max is None else row_max  # (..., 1)
    overflowed = m == math.inf  # rows holding +inf: their limit, uniform over the +inf tokens
    if bool(overflowed.any()):
        logits = torch.where(overflowed, torch.where(logits == math.inf, 0.0, -math.inf), logits)
        m = torch.where(overflowed, 0.0, m)
    # max 0: exp never overflows (in the input's dtype: float64 after a penalty); a new tensor, so the
    # division below and a caller's exp_ work in place (a fresh 64 x 49152 buffer costs more than the exp)
    logits = logits - m
    if temperature != 1.0:
        logits.div_(temperature)
    logits = logits.float()
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


def target_probs(
    logits: Tensor, params: SamplingParams, history: Tensor | Sequence[int] | None = None
) -> Tensor:
    """The distribution a request samples from: logits (..., V) -> probabilities (..., V), float32.

    Greedy (temperature 0) is the one-hot distribution on the argmax, so speculative decoding's
    accept/reject rule needs no special case for it. Raises ``NonFiniteLogitsError`` for a row
    of logits with NaN or +inf.
    """
    check_logits(logits)
    if history is not None and params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    if params.greedy:
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    probs = filter_logits(
        logits, params.temperature, params.top_k, params.top_p, params.min_p
    ).softmax(dim=-1)
    if not bool(
        torch.isfinite(probs).all()
    ):  # only an all -inf row after an astronomically large penalty
        raise ValueError(
            f"repetition_penalty={params.repetition_penalty!r} left no token with a finite logit"
        )
    return probs


def sample_token(
    logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    history: Tensor | Sequence[int] | None = None,
    output_ids: Sequence[int] = (),
) -> int:
    """logits (V,) -> one token id under ``params`` (the distribution of ``target_probs``), after the
    request's ``logits_processors`` (each given ``output_ids``, the tokens generated so far, and a copy)."""
    if not params.logits_processors and params.repetition_penalty == 1.0:
        return sample_rows(logits[None], [params], [generator])[0]  # the engine's batched path
    for process in params.logits_processors:  # (V,) -> (V,)
        logits = process(output_ids, logits.clone())
    probs = target_probs(logits, params, history)
    if params.greedy:
        return int(probs.argmax())
    return int(draw(probs.cpu()[None], uniform(generator))[0])


def uniform(generator: torch.Generator | None) -> Tensor:
    """One float64 uniform in [0, 1) from ``generator`` (a request's own stream: one scalar per token)."""
    return torch.rand(1, generator=generator, dtype=torch.float64)


def draw(probs: Tensor, u: Tensor, block: int = 256) -> Tensor:
    """Inverse-CDF sampling (inverse transform sampling, e.g. Devroye, "Non-Uniform Random Variate
    Generation" §2.1): probs (R, V) ≥ 0, not necessarily normalised, u (R,) uniforms in [0, 1) ->
    token ids (R,).

    Token i is returned when F(i-1) ≤ u·F(V-1) < F(i), F the running sum of the row, so a token
    of probability 0 is never drawn and each row needs one uniform, not one random number per vocabulary
    entry (``torch.multinomial`` draws V exponentials). F is built in two levels — the sums of ``block``
    consecutive entries (one vectorised float32 pass; their float64 running sum) pick the block, a
    float64 running sum inside that block alone picks the token — because a sequential running sum over the whole vocabulary costs more than
    everything else in the step. The rows are independent: row r's token depends only on probs[r]
    and u[r], whatever other rows share the batch.
    """
    R, V = probs.shape
    pad = -V % block
    w = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    w = w.reshape(R, -1, block)  # (R, C, block)
    sums = w.sum(dim=-1).double()  # (R, C); a float32 sum of 256 entries: relative error ≲ 5e-7
    cdf = sums.cumsum(dim=-1)  # (R, C) at the end of each block
    total = cdf[:, -1:]  # (R, 1)
    x = torch.minimum(u.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    c = torch.searchsorted(cdf, x, right=True)  # (R, 1): the block where F first exceeds x
    before = torch.nn.functional.pad(cdf[:, :-1], (1, 0))  # (R, C): F at the start of each block
    x = x - before.gather(-1, c)  # ≥ 0: the remainder inside the chosen block
    inner = (
        w.gather(1, c[:, :, None].expand(R, 1, block))[:, 0].double().cumsum(dim=-1)
    )  # (R, block)
    last = inner[:, -1:]  # > 0: a block of sum 0 is never picked
    x = torch.minimum(x, torch.nextafter(last, torch.zeros_like(last)))  # rounding of sum vs cumsum
    return (c[:, 0] * block + torch.searchsorted(inner, x, right=True)[:, 0]).clamp_(max=V - 1)


def sample_rows(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """logits (R, V) -> R token ids, the batched ``sample_token`` for rows without repetition penalty or
    logits processors: rows with the same temperature / top-k / top-p / min-p are filtered in one pass
    (``filter_logits``), each row draws one uniform from its own generator (in row order), and one
    ``draw`` inverts every row's CDF. Row r's token is the one ``sample_token`` gives for it alone."""
    if any(p.repetition_penalty != 1.0 or p.logits_processors for p in params):
        raise ValueError("sample_rows takes rows without repetition_penalty or logits_processors")
    row_max = logits.amax(
        dim=-1, keepdim=True
    )  # (R, 1): the finiteness check's and the filters' one pass
    if not bool(torch.isfinite(row_max).all()):
        check_logits(
            logits
        )  # NonFiniteLogitsError for a row with NaN / +inf (the engine drops those first)
    tokens = [0] * len(params)
    u = torch.zeros(len(params), dtype=torch.float64)  # (R,)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if not p.greedy:
            u[i] = uniform(generators[i])[0]  # row order, one scalar from the row's own stream
        groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p, p.greedy), []).append(i)
    for (temperature, top_k, top_p, min_p, greedy), rows in groups.items():
        every = len(rows) == len(params)
        x = logits if every else logits[rows]  # (R', V)
        if greedy:
            out = x.argmax(dim=-1)
        else:
            m = row_max if every else row_max[rows]
            w = filter_logits(
                x, temperature, top_k, top_p, min_p, m
            ).exp_()  # ∝ probabilities, max 1
            out = draw(w, u[rows])
        for i, t in zip(rows, out.tolist()):
            tokens[i] = t
    return tokens


def token_logprobs(logits: Tensor, token: int, n_top: int) -> tuple[float, dict[int, float]]:
    """log p(token) and the ``n_top`` most likely tokens' log-probabilities under softmax(logits (V,))."""
    return rows_logprobs(logits[None], [token], n_top)[0]


def rows_logprobs(
    logits: Tensor, tokens: Sequence[int] | Tensor, n_top: int
) -> list[tuple[float, dict[int, float]]]:
    """``token_logprobs`` for R rows at once: logits (R, V), tokens (R,) -> per row (log p(token), top n)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    target = torch.as_tensor(tokens, device=logp.device, dtype=torch.long)
    lp = logp.gather(-1, target[:, None])[:, 0].tolist()
    if n_top <= 0:
        return [(v, {}) for v in lp]
    values, ids = torch.topk(logp, min(n_top, logp.shape[-1]), dim=-1)
    return [(v, dict(zip(i, t))) for v, i, t in zip(lp, ids.tolist(), values.tolist())]
