"""The serving engine: iteration-level scheduling over a paged KV cache.

Seed 000 §2.1 (latency vs throughput), §2.2 (traditional vs continuous vs selective batching,
token-budget batching); seed 001 "推理流程" (prefill vs decode), "性能指标分析" (TTFT, token
latency, throughput) and "动态负载" (Orca iteration-level scheduling, vLLM PagedAttention).

Every ``step()`` is one iteration:

1. schedule under a token budget (``max_num_batched_tokens``): running sequences first (a
   decode costs 1 token, an unfinished prompt continues with a chunk — chunked prefill), then
   waiting requests are admitted while blocks and the budget allow (continuous batching: a
   finished request's slot is refilled at the next iteration, never at the end of a batch);
2. when a running sequence needs a block and none is free, the most recently admitted
   running sequence is preempted by recomputation: its blocks are freed and it goes back to
   the front of the waiting queue with prompt + generated tokens as its new prompt (prefix
   caching usually gives the blocks back for free). The engine never crashes for lack of
   blocks; a request that could not fit even alone is refused when it is added;
3. run the model ONCE (Orca's selective batching): the decode tokens and the prefill chunks of
   the iteration are flattened into one (1, T) row without padding, with per-token positions
   and sequence ids; the linears run over all T tokens, attention per sequence
   (``SelectivePagedBatch``); only the last token of each sequence that needs its next token
   goes through the unembedding;
4. sample a token for every sequence whose prompt is complete, check the stop rules, free the
   blocks of finished sequences (and, for a sliding-window model, the blocks that fell behind
   the window).

Speculative decoding (``num_speculative_tokens=k``, seed 000 §2.3, seed 001 "无损提速"): a
decoding sequence whose history repeats itself gets up to k draft tokens from prompt lookup
(``ngram_propose``); they ride in the same single forward as a short chunk after its last token,
the target's distributions at those k + 1 positions verify them (greedy: kept while they are
the argmax; sampling: kept with probability p(x), else a draw from p without x — the one-hot
case of the accept/reject rule, so the output distribution is exactly the target's), and the
K/V of rejected drafts are dropped from the cache (``PagedKVCache.truncate``). One iteration then
emits up to k + 1 tokens for that sequence.

A failure stays with its request (as in vLLM: the request is aborted, the engine lives on). After
the forward, each sequence's commit, sampling, draft verification and stop rules run isolated: an
exception there (NaN/inf logits from bad weights, a token the tokenizer cannot decode) stops that
request through the same path as an abort (blocks freed, ``finish_reason="error"``, the message in
``error``) and the others continue; a forward that raises is rerun one sequence at a time, so only
the sequence that provokes it fails. Requests are checked when added (``check_request``).

``LLM`` is the offline API (``generate(prompts, sampling_params)``); ``AsyncLLM`` is the
streaming API a server sits on (``generate`` yields deltas, ``abort``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from lmstack.inference.loader import load_for_inference
from lmstack.inference.paged import PagedKVCache
from lmstack.inference.prompts import prompt_token_ids
from lmstack.inference.sampling import (
    NonFiniteLogitsError,
    SamplingParams,
    as_integer,
    as_real,
    bad_logit_rows,
    check_logits,
    find_stop_string,
    sample_token,
    token_logprobs,
)
from lmstack.inference.speculative import ngram_propose, verify_drafts
from lmstack.kernels.runtime import RuntimeConfig, configure

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class PromptTooLongError(ValueError):
    """A request that cannot fit: its prompt leaves no room within max_model_len, or prompt +
    max_tokens exceed the whole KV pool."""


KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what the paged cache may store


@dataclass
class RequestOutput:
    """What a request has produced so far; ``new_*`` hold the delta since its previous output."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list, repr=False)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    error: str | None = None  # finish_reason "error": what failed (the request was aborted, the engine goes on)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class _Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float,
                 generator: torch.Generator | None):
        self.request_id, self.params, self.arrival = request_id, params, arrival
        self.all_ids = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.status = WAITING
        self.generator = generator
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.text = ""
        self.sent_tokens = 0
        self.sent_text = 0
        self.finish_reason: str | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.token_times: list[float] = []
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.drafts: list[int] = []  # speculative tokens fed after the last token this iteration
        self.error: str | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.all_ids[self.num_prompt:]


class LLMEngine:
    """Continuous batching over a ``PagedKVCache``; see the module docstring.

    ``selective=False`` runs the same one-forward iteration with the reference attention (one
    masked attention over every gathered key, mask from (sequence id, position)) instead of the
    per-sequence grouping; ``free_outside_window=False`` keeps a sliding-window model's old blocks;
    ``num_speculative_tokens`` > 0 turns on prompt-lookup speculation (n-gram sizes ``ngram`` =
    (largest, smallest)).
    """

    def __init__(self, model, tokenizer=None, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_bytes: int = 512 * 2**20, kv_dtype: torch.dtype | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, eos_token_id: int | None = None, seed: int = 0,
                 watermark: float = 0.01, selective: bool = True,
                 free_outside_window: bool = True, num_speculative_tokens: int = 0,
                 ngram: tuple[int, int] = (3, 1)):
        p = next(model.parameters())
        c = model.config
        self.model, self.tokenizer, self.config = model, tokenizer, c
        self.device = p.device
        self.max_num_seqs = as_integer("max_num_seqs", max_num_seqs, 1)
        self.max_num_batched_tokens = as_integer("max_num_batched_tokens", max_num_batched_tokens, 1)
        num_speculative_tokens = as_integer("num_speculative_tokens", num_speculative_tokens, 0)
        if not 1 <= ngram[1] <= ngram[0]:
            raise ValueError(f"ngram={ngram} must be (largest, smallest) n-gram sizes with 1 <= smallest <= largest")
        self.num_speculative_tokens, self.ngram = num_speculative_tokens, ngram
        max_model_len = c.max_seq_len if max_model_len is None else as_integer("max_model_len", max_model_len, 2)
        self.max_model_len = min(c.max_seq_len, max_model_len)
        block_size = as_integer("block_size", block_size, 1)
        kv_dtype = kv_dtype or p.dtype
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype={kv_dtype!r} must be one of {', '.join(map(str, KV_DTYPES))}: K/V are "
                             "stored as they are computed, an integer dtype would silently truncate them")
        watermark = as_real("watermark", watermark)
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark={watermark!r} must be in [0, 1): the fraction of the blocks kept free "
                             "when admitting a request while others run")
        if num_blocks is None:
            kv_cache_bytes = as_integer("kv_cache_bytes", kv_cache_bytes, 1)
            element = torch.empty(0, dtype=kv_dtype).element_size()
            per_block = 2 * block_size * c.n_layers * c.n_kv_heads * c.head_dim * element
            num_blocks = max(2, kv_cache_bytes // per_block)
        num_blocks = as_integer("num_blocks", num_blocks, 2)
        self.cache = PagedKVCache(c, num_blocks, block_size, kv_dtype, self.device, enable_prefix_caching)
        self.watermark_blocks = int(watermark * num_blocks)
        if eos_token_id is None:
            eos_token_id = c.eos_token_id if c.eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id = eos_token_id
        self.generator = torch.Generator().manual_seed(seed)
        self.selective = selective
        self.free_outside_window = free_outside_window
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.requests: dict[str, _Sequence] = {}
        self._ids = itertools.count()
        self.stats = {"steps": 0, "forwards": 0, "preemptions": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0,
                      "computed_tokens": 0, "generated_tokens": 0, "window_released_blocks": 0,
                      "spec_proposed": 0, "spec_accepted": 0}

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, arrival_time: float | None = None) -> str:
        """Check the request and queue it; a bad one raises ``ValueError`` and queues nothing."""
        seq = self.check_request(request_id, prompt, params, arrival_time)
        self._enqueue(seq)
        return seq.request_id

    def _enqueue(self, seq: _Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in the engine")
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def check_request(self, request_id: str | None, prompt, params: SamplingParams | None,
                      arrival_time: float | None = None) -> _Sequence:
        """Everything ``add_request`` checks, without queueing: the prompt, the parameters, the fit."""
        params = SamplingParams() if params is None else params
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params={params!r} must be a SamplingParams")
        ids = prompt_token_ids(prompt, self.config.vocab_size, self.tokenizer, f"request {request_id!r}")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"request {request_id!r}: prompt of {len(ids)} tokens leaves no room to "
                                     f"generate within max_model_len={self.max_model_len}")
        need = min(len(ids) + params.max_tokens, self.max_model_len)
        if need > self.cache.capacity_tokens:
            raise PromptTooLongError(f"request {request_id!r}: prompt + max_tokens = {need} tokens cannot fit in the "
                                     f"KV pool of {self.cache.capacity_tokens} tokens even alone; lower max_tokens "
                                     "or give the engine more blocks")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        return _Sequence(request_id, ids, params, time.perf_counter() if arrival_time is None else arrival_time, gen)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False when it is unknown or already finished."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self._stop(seq, "abort")
        return True

    def _stop(self, seq: _Sequence, reason: str, error: BaseException | None = None) -> None:
        """The one early exit (abort, error): out of the queues and the engine, blocks freed.

        After an error, blocks only this sequence held are cleaned first when they hold NaN/inf
        K/V: a masked-out slot still enters attention as 0 · value, and 0 · NaN is NaN, so a
        reused dirty block would poison whichever request gets it next.
        """
        if seq.status == WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status == RUNNING and seq in self.running:
            self.running.remove(seq)
        if error is not None:
            self._scrub_blocks(seq.request_id)
        self.cache.free(seq.request_id)
        self.requests.pop(seq.request_id, None)
        seq.status, seq.finish_reason, seq.finished_time = FINISHED, reason, time.perf_counter()
        seq.drafts = []
        if error is not None:
            seq.error = f"request {seq.request_id!r} failed: {type(error).__name__}: {error}"

    def _scrub_blocks(self, seq_id: str) -> None:
        table = self.cache.tables.get(seq_id, [])
        alloc = self.cache.allocator
        for block in table:
            if block and alloc.ref_count[block] == 1 and not bool(
                    torch.isfinite(self.cache.k[:, block]).all() and torch.isfinite(self.cache.v[:, block]).all()):
                alloc.forget(block)  # its prefix-cache name goes too: the content is about to change
                self.cache.k[:, block].zero_()
                self.cache.v[:, block].zero_()

    @contextlib.contextmanager
    def _isolated(self, seq: _Sequence, failed: list[_Sequence]):
        """Run one sequence's share of a step; an exception fails that sequence only."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 — any failure of one request must not reach the others
            self._stop(seq, "error", e)
            failed.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.stats["cached_prompt_tokens"] / max(1, self.stats["prompt_tokens"])

    # ---- one iteration -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one iteration, sample; returns outputs of the requests that progressed."""
        scheduled = self._schedule()
        if not scheduled:
            return []
        self.stats["steps"] += 1
        progressed = self._run(scheduled)
        outputs = [self._output(s) for s in progressed]
        self.running = [s for s in self.running if s.status == RUNNING]
        for s in progressed:
            if s.status == FINISHED:
                self.requests.pop(s.request_id, None)
        return outputs

    def _preempt(self, seq: _Sequence) -> None:
        self.cache.free(seq.request_id)
        seq.num_computed = 0
        seq.drafts = []
        seq.status = WAITING
        seq.num_preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(seq)

    def _schedule(self) -> list[tuple[_Sequence, int]]:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[_Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.all_ids) - seq.num_computed, budget)
            seq.drafts = self._propose(seq, budget - 1) if n == 1 else []
            n += len(seq.drafts)
            while not self.cache.can_append(seq.request_id, n):
                if seq.drafts:  # speculation never costs another sequence its blocks
                    n -= len(seq.drafts)
                    seq.drafts = []
                    continue
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != RUNNING:
                break
            self.cache.reserve(seq.request_id, n)
            scheduled.append((seq, n))
            budget -= n
            i += 1
        if preempted:
            return scheduled
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.cache.allocate(seq.request_id, seq.all_ids)
            n = min(len(seq.all_ids) - cached, budget)
            if not self.cache.can_append(seq.request_id, n, reserve=self.watermark_blocks if self.running else 0):
                self.cache.free(seq.request_id)
                break
            self.waiting.popleft()
            seq.num_computed = cached
            if seq.num_cached_tokens is None:  # first admission: prefix-cache statistics
                seq.num_cached_tokens = cached
                self.stats["prompt_tokens"] += seq.num_prompt
                self.stats["cached_prompt_tokens"] += cached
            seq.status = RUNNING
            self.running.append(seq)
            self.cache.reserve(seq.request_id, n)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def _propose(self, seq: _Sequence, budget: int) -> list[int]:
        """Prompt-lookup drafts for a decoding sequence: at most ``num_speculative_tokens``, the
        token budget left, and what max_tokens / max_model_len still allow after the next token."""
        if self.num_speculative_tokens == 0:
            return []
        k = min(self.num_speculative_tokens, budget, seq.params.max_tokens - len(seq.output_ids) - 1,
                self.max_model_len - len(seq.all_ids) - 1)
        if k <= 0:
            return []
        return ngram_propose(seq.all_ids, k, *self.ngram)

    def _run(self, scheduled: list[tuple[_Sequence, int]]) -> list[_Sequence]:
        """``_execute`` with failures kept to the sequence that causes them: a failure after the
        forward is already caught per sequence; a forward that raises is retried one sequence at
        a time (its K/V went only to slots reserved for these same tokens), so only a sequence
        that fails alone is failed, with that error."""
        try:
            return self._execute(scheduled)
        except Exception as e:  # noqa: BLE001 — reported to the request(s) concerned, the engine goes on
            if len(scheduled) > 1:
                return [s for item in scheduled for s in self._run([item])]
            seq = scheduled[0][0]
            self._stop(seq, "error", e)
            return [seq]

    @torch.inference_mode()
    def _execute(self, scheduled: list[tuple[_Sequence, int]]) -> list[_Sequence]:
        """One model forward for the whole iteration (Orca's selective batching): decode tokens
        first, then the prefill chunks, flattened into one (1, T) row without padding; the
        linears run once over all T tokens, attention per sequence (``SelectivePagedBatch``).
        After the forward, each sequence's commit and sampling is isolated (``_isolated``):
        returns the sequences that progressed or failed."""
        order = sorted(scheduled, key=lambda r: r[1] > 1)  # decode rows first (stable)
        rows = [(s.request_id, s.num_computed, n) for s, n in order]
        batch, positions, seq_ids = self.cache.packed_batch(rows, selective=self.selective)
        ids: list[int] = []
        for s, n in order:
            ids.extend(s.all_ids[s.num_computed:s.num_computed + n - len(s.drafts)] + s.drafts)
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)[None]  # (1, T)
        hidden = self.model(tokens, positions, kv_cache=batch, document_ids=seq_ids, return_hidden=True)[0]  # (T, D)
        self.stats["forwards"] += 1
        # the rows that need logits: the last token of every sequence whose prompt is then complete,
        # every position of a speculating sequence (its last token and its drafts)
        need: list[int] = []
        first_row: dict[str, int] = {}  # request id -> its first row in ``need``
        t = 0
        for s, n in order:
            t += n
            first_row[s.request_id] = len(need)
            if s.drafts:
                need.extend(range(t - n, t))
            elif s.num_computed + n == len(s.all_ids):
                need.append(t - 1)
        logits = self.model.unembed(hidden[need]) if need else None  # (R, V)
        if not self.selective and len(order) > 1 and logits is not None and bool(bad_logit_rows(logits).any()):
            # the reference attention sees every sequence's keys, masked, and 0 · NaN = NaN: one
            # sequence's NaN K/V reach all rows, so ``_run`` reruns them one at a time (nothing committed yet)
            raise NonFiniteLogitsError("non-finite logits in a step over several sequences")
        failed: list[_Sequence] = []
        ready, ready_rows, spec = [], [], []
        for s, n in order:
            self.stats["computed_tokens"] += n
            at = first_row[s.request_id]
            if s.drafts:  # committed after verification, when it is known how many drafts stay
                spec.append(s)
                with self._isolated(s, failed):
                    self._verify(s, logits[at:at + n])  # (k + 1, V)
                continue
            with self._isolated(s, failed):
                self._commit(s, n)
            if s.status == RUNNING and s.num_computed == len(s.all_ids):
                ready.append(s)
                ready_rows.append(at)
        if ready:
            self._sample(ready, logits[ready_rows], failed)  # (R, V)
        return list(dict.fromkeys(ready + spec + failed))

    def _commit(self, s: _Sequence, n: int, token_ids: list[int] | None = None) -> None:
        """``n`` more of the sequence's tokens have their K/V in the cache. ``token_ids``: the tokens
        up to them when these are not all in ``all_ids`` yet (kept drafts); the blocks reserved
        past them (for rejected drafts) are then given back."""
        self.cache.commit(s.request_id, s.all_ids if token_ids is None else token_ids, n)
        if token_ids is not None:
            self.cache.truncate(s.request_id, self.cache.num_tokens[s.request_id])
        if self.config.sliding_window is not None and self.free_outside_window:
            self.stats["window_released_blocks"] += self.cache.release_outside_window(
                s.request_id, self.config.sliding_window)
        s.num_computed += n

    def _verify(self, s: _Sequence, logits: torch.Tensor) -> None:
        """Check the drafts fed after the sequence's last token; logits (k + 1, V) are the target's
        at the last token and at each draft. Emits the kept drafts and one more token."""
        drafts = s.drafts
        s.drafts = []
        check_logits(logits)
        logits_cpu = logits.float().cpu()
        emitted = verify_drafts(logits_cpu, drafts, s.params, s.all_ids, s.generator or self.generator)
        kept = len(emitted) - 1
        self.stats["spec_proposed"] += len(drafts)
        self.stats["spec_accepted"] += kept
        # the cache holds K/V of the last token and all k drafts: keep the last token's and the kept ones'
        self._commit(s, 1 + kept, s.all_ids + emitted[:kept])
        for i, token in enumerate(emitted):
            self._append(s, token, logits_cpu[i] if s.logprobs is not None else None)
            if s.status == FINISHED:
                break

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor, failed: list[_Sequence]) -> None:
        """logits (R, V) of the R sequences that need their next token. A row with NaN/+inf fails
        its sequence only (``check_logits`` names what was found); greedy rows take one argmax."""
        bad = bad_logit_rows(logits).tolist()
        greedy = {i for i, s in enumerate(seqs) if s.params.greedy and s.params.repetition_penalty == 1.0
                  and not bad[i]}
        tokens: list[int] = [0] * len(seqs)
        if greedy:
            rows = sorted(greedy)
            for i, t in zip(rows, logits[rows].argmax(dim=-1).tolist()):
                tokens[i] = t
        logits_cpu = None
        for i, s in enumerate(seqs):
            with self._isolated(s, failed):
                if bad[i]:
                    check_logits(logits[i])  # raises NonFiniteLogitsError
                if logits_cpu is None and (i not in greedy or s.logprobs is not None):
                    logits_cpu = logits.float().cpu()
                if i not in greedy:
                    tokens[i] = sample_token(logits_cpu[i], s.params, s.generator or self.generator, s.all_ids)
                self._append(s, tokens[i], logits_cpu[i] if s.logprobs is not None else None)

    def _append(self, s: _Sequence, token: int, logits_row: torch.Tensor | None) -> None:
        now = time.perf_counter()
        s.all_ids.append(token)
        self.stats["generated_tokens"] += 1
        if s.first_token_time is None:
            s.first_token_time = now
        s.token_times.append(now)
        if logits_row is not None:
            s.logprobs.append(token_logprobs(logits_row, token, s.params.logprobs))
        p = s.params
        reason = None
        is_stop_token = (token == self.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids
        if is_stop_token:
            reason = "stop"
        elif len(s.all_ids) - s.num_prompt >= p.max_tokens or len(s.all_ids) >= self.max_model_len:
            reason = "length"
        if self.tokenizer is not None:
            out = s.output_ids[:-1] if is_stop_token else s.output_ids
            old_len = len(s.text)
            s.text = self.tokenizer.decode(out)
            if p.stop:
                start = max(0, old_len - max(len(x) for x in p.stop))
                at = find_stop_string(s.text, p.stop, start)
                if at != -1:
                    s.text = s.text[:at]
                    reason = "stop"
        if reason is not None:
            s.status, s.finish_reason, s.finished_time = FINISHED, reason, now
            self.cache.free(s.request_id)

    def _output(self, s: _Sequence) -> RequestOutput:
        finished = s.status == FINISHED
        text = s.text
        if not finished:
            while text.endswith("\ufffd"):  # hold back an incomplete UTF-8 character
                text = text[:-1]
            if s.params.stop:  # and what could be the start of a stop string
                text = text[:max(0, len(text) - max(len(x) for x in s.params.stop) + 1)]
        new_ids = s.output_ids[s.sent_tokens:]
        new_text = text[s.sent_text:] if len(text) >= s.sent_text else ""
        s.sent_tokens += len(new_ids)
        s.sent_text = max(s.sent_text, len(text))
        return RequestOutput(
            s.request_id, s.all_ids[:s.num_prompt], list(s.output_ids), text, new_ids, new_text, finished,
            s.finish_reason, list(s.logprobs) if s.logprobs is not None else None, s.arrival, s.first_token_time,
            s.finished_time, list(s.token_times) if finished else [], s.num_cached_tokens or 0, s.num_preemptions,
            s.error)


class GenerationError(RuntimeError):
    """Requests that failed while running (e.g. NaN logits): each was aborted and its blocks freed,
    the others finished. ``outputs`` holds every output of the call, failed ones with
    ``finish_reason == "error"`` and ``error`` set."""

    def __init__(self, message: str, outputs: list[RequestOutput]):
        super().__init__(message)
        self.outputs = outputs


def _as_prompt_list(prompts) -> tuple[list, bool]:
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        return [prompts], True
    if isinstance(prompts, torch.Tensor):
        return ([prompts.tolist()], True) if prompts.dim() == 1 else (prompts.tolist(), False)
    if not isinstance(prompts, Iterable) or isinstance(prompts, (bytes, bytearray, dict)):
        raise ValueError(f"prompts={prompts!r:.60} must be a prompt (a string or token ids) or a list of prompts")
    return list(prompts), False


class LLM:
    """Offline batch inference: ``LLM("smollm2-135m").generate(prompts, SamplingParams(...))``.

    ``model`` is a name (``smollm2-135m``), a .gguf file or checkpoint directory, or a
    Transformer; ``runtime`` a ``lmstack.kernels.RuntimeConfig`` (attention/RMSNorm backends); ``dtype`` a torch dtype or "fp32"/"bf16"/"int8"/"int4"; ``quant="int8"``/"int4"
    quantises the linears' weights (``lmstack.quant``, the model is changed in place); engine
    options (block_size, num_blocks, max_num_seqs, max_num_batched_tokens, enable_prefix_caching,
    ...) are passed through to ``LLMEngine``. ``generate`` checks every prompt before queueing
    any (``ValueError``), and raises ``GenerationError`` (holding every output) when some requests
    failed while running; the engine stays usable either way.
    """

    def __init__(self, model="smollm2-135m", tokenizer=None, dtype: torch.dtype | str = torch.float32,
                 device: torch.device | str = "cpu", quant: str | None = None, runtime: RuntimeConfig | None = None,
                 **engine_kwargs):
        model, tokenizer = load_for_inference(model, tokenizer, dtype, device, quant)
        # the attention/RMSNorm backends, resolved once here; without ``runtime`` the model keeps its own
        self.runtime = configure(model, runtime) if runtime is not None else None
        self.engine = LLMEngine(model, tokenizer, **engine_kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        prompt_list, _ = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"{len(params)} sampling_params for {len(prompt_list)} prompts")
        # every prompt is checked before any is queued: one bad prompt leaves nothing behind
        seqs = [self.engine.check_request(None, p, sp) for p, sp in zip(prompt_list, params)]
        for seq in seqs:
            self.engine._enqueue(seq)
        ids = [seq.request_id for seq in seqs]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:  # an interrupt (or an engine bug) leaves none of this call's requests behind
            for i in ids:
                self.engine.abort_request(i)
            if bar is not None:
                bar.close()
        outputs = [done[i] for i in ids]
        failed = [o for o in outputs if o.error is not None]
        if failed:
            raise GenerationError(f"{len(failed)} of {len(outputs)} requests failed (the others finished, see "
                                  f".outputs): " + "; ".join(o.error for o in failed[:3]), outputs)
        return outputs

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One chat turn: render the model's chat template (jinja2) and generate the reply."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.generate([self.tokenizer.encode(prompt)], sampling_params)[0]


class AsyncLLM:
    """Streaming API over one ``LLMEngine`` for an asyncio server.

    ``generate`` adds a request and yields ``RequestOutput`` deltas as tokens arrive; leaving
    the iterator early (a client disconnect) aborts the request and frees its blocks.
    The engine steps in a worker thread; requests added or aborted meanwhile are applied
    between steps, so the engine is never touched by two threads at once.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list[tuple] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> asyncio.Queue:
        params = params or SamplingParams()
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already streaming")
        self._ensure_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._pending.append(("add", request_id, prompt, params))
        self._wakeup.set()
        return q

    def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self._pending.append(("abort", request_id))
            if self._wakeup is not None:
                self._wakeup.set()

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        request_id = request_id or f"async-{next(self.engine._ids)}"
        q = self.add_request(request_id, prompt, params)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for op in pending:
            if op[0] == "add":
                _, rid, prompt, params = op
                try:
                    self.engine.add_request(rid, prompt, params)
                except Exception as e:  # noqa: BLE001 — whatever the bad request raises goes to its caller
                    q = self._queues.pop(rid, None)
                    if q is not None:
                        q.put_nowait(e)
            else:
                self.engine.abort_request(op[1])

    def _deliver(self, out: RequestOutput) -> None:
        q = self._queues.get(out.request_id)
        if q is None:
            return
        if out.error is not None:
            q.put_nowait(GenerationError(out.error, [out]))
        else:
            q.put_nowait(out)
        if out.finished:
            self._queues.pop(out.request_id, None)

    def _fail_all(self, error: Exception) -> None:
        """The engine loop itself failed: every waiter gets the error, every request is aborted
        (blocks freed), and the loop goes on serving new requests."""
        for q in self._queues.values():
            q.put_nowait(error)
        self._queues.clear()
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)

    async def _run(self) -> None:
        while True:
            try:
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    if self._pending:
                        continue
                    await self._wakeup.wait()
                    continue
                outputs = await asyncio.to_thread(self.engine.step)
                for out in outputs:
                    self._deliver(out)
            except Exception as e:  # noqa: BLE001 — never a dead loop with callers waiting on it
                self._fail_all(e)
