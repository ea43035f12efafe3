"""The serving engine: iteration-level scheduling over a paged KV cache, in named parts.

Book of LLMs §2.1 (latency vs throughput), §2.2 (continuous and selective batching, token-budget
batching), §2.3 (speculation); CS336 notes "推理流程", "性能指标分析" (TTFT, latency, throughput)
and "动态负载" (Orca, vLLM PagedAttention). Every ``step()`` is one iteration:

1. the ``Scheduler`` picks (sequence, tokens) pairs under the token budget — decodes, prefill
   chunks, admissions, preemption, speculative drafts (``PromptLookup``);
2. the ``ModelRunner`` runs the model once over all of them (one flattened row, the cache's
   blocks behind the attention seam) and samples or verifies drafts;
3. the scheduler commits the stored K/V (``BlockManager``) and appends the tokens, applying the
   stop rules (``StopStrings`` for stop strings); finished sequences free their blocks.

A failure stays with its request (as in vLLM: the request is aborted, the engine lives on): each
sequence's commit, sampling, verification and stop rules run isolated, and an exception there
stops that request through the same path as an abort (blocks freed, ``finish_reason="error"``, the
message in ``error``); a forward that raises is rerun one sequence at a time, so only the
sequence that provokes it fails. Requests are checked when added (``check_request``).

Two drivers step an engine: ``LLM`` (``inference/llm.py``), the offline API
(``generate(prompts, sampling_params)``), and ``AsyncLLM`` (``inference/async_llm.py``), the
streaming API a server sits on; each uses only the public methods below. docs/inference.md
relates this loop to the batch-1 ``generate`` loop and its step strategies.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from lmstack.inference.decode_step import DecodeStep, compile_policy
from lmstack.inference.draft_runner import DraftRunner
from lmstack.inference.model_runner import ModelRunner
from lmstack.inference.paged import KV_CACHE_DTYPES, PagedKVCache, kv_pool_bytes
from lmstack.inference.prompts import prompt_token_ids
from lmstack.inference.sampling import SamplingParams, as_integer, as_real
from lmstack.inference.scheduler import Scheduler
from lmstack.inference.sequence import FINISHED, RUNNING, RequestOutput
from lmstack.inference.sequence import Sequence as Seq
from lmstack.inference.speculative import PromptLookup, truncated_draft
from lmstack.inference.state_pool import StatePool, recurrent_layers
from lmstack.inference.stops import StopStrings
from lmstack.model.mixer_spec import refuse, unsupported
from lmstack.model.transformer import Transformer
from lmstack.quant.kv_codec import KV_FORMATS


class PromptTooLongError(ValueError):
    """A request that cannot fit: its prompt leaves no room within max_model_len, or prompt +
    max_tokens exceed the whole KV pool."""


KV_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
)  # what the paged cache may store
BLOCK_SIZE = 16  # tokens per KV block (LLMEngine's default)


def _blocks_in(
    nbytes: int, c, block_size: int, dtype: torch.dtype | str, seats: int, max_len: int
) -> int:
    """Blocks that fit in ``nbytes``: each holds K and V of bs tokens, 2·bs·L·K·H elements (MLA: the latent,
    bs·L·(d_c + d_R)); a quantised pool ("int8"/"fp8") 1 byte each plus its scales (``kv_pool_bytes``).
    A model without softmax-attention layers stores nothing in its blocks: enough for every seat at full length."""
    per_block = kv_pool_bytes(c, 1, block_size, dtype)
    if per_block == 0:
        return max(2, seats * -(-max_len // block_size))
    return max(2, nbytes // per_block)


def _state_pool(model, num_speculative_tokens: int, num_slots: int) -> StatePool | None:
    """The recurrent-state pool of a hybrid model (None: no recurrent layer); refuses what the engine cannot serve."""
    refuse(
        model.config, "paged", "the paged engine"
    )  # each layer's spec says what it supports (model.mixer_spec)
    if not recurrent_layers(model):
        return None
    no_rollback = sorted({kind for _, kind, _ in unsupported(model.config, "speculation")})
    if num_speculative_tokens and no_rollback:
        raise ValueError(
            f"num_speculative_tokens={num_speculative_tokens}: the model has recurrent layers "
            f"({no_rollback}), whose state cannot be rolled back past rejected drafts; use 0"
        )
    return StatePool(model, num_slots)


class Driver(Protocol):
    """What steps an engine (``LLM``, ``AsyncLLM``): ``busy()`` while it has requests in flight."""

    def busy(self) -> bool: ...


class LLMEngine:
    """Continuous batching over a ``PagedKVCache``; see the module docstring.

    ``selective=False`` runs the same one-forward iteration with the reference attention (one
    masked attention over every gathered key, mask from (sequence id, position)) instead of the
    per-sequence grouping; ``free_outside_window=False`` keeps a sliding-window model's old blocks;
    ``num_speculative_tokens`` > 0 turns on speculation: prompt lookup (n-gram sizes ``ngram`` =
    (largest, smallest)), or with ``draft_model`` (a smaller model with the target's vocabulary, or an int
    n: the target's first n layers, ``truncated_draft``) draft-model speculation, the draft batched over
    the decoding sequences from its own paged cache (``DraftRunner``). A model with recurrent layers (linear attention, Mamba-2, Gated DeltaNet) keeps
    their states in a ``StatePool`` of ``num_state_slots`` sequences (default ``max_num_seqs``; ``self.states``);
    for it prefix caching is off and speculation is refused (a recurrent state cannot be rolled back).
    Iterations in which every sequence feeds just its next token run as a ``DecodeStep`` (fixed shapes,
    the blocks read through the block tables); ``compile=True`` (or "on") compiles that step: one graph of
    one block per (batch, table) bucket, shared by every layer (``decode_step``; seconds per bucket on a CPU,
    less in a later process from inductor's on-disk caches: ``warm_up``); a dict compiles with those
    inductor options over the static decoder's; "auto" compiles on a CPU with a C++ compiler and where the
    model has a decode step, else runs eagerly (``decode_step.compile_policy``; ``compile_reason`` says which). ``fuse_projections`` (default) makes the
    model compute q/k/v and gate/up with one GEMM each (``Transformer.fuse_projections``: its parameters become
    views of the fused weights, checkpoints unchanged). ``admission_batch`` k (default 1: admit as soon as a seat
    frees, as vLLM does): while sequences run, waiting requests are admitted only when k seats are free (or
    fewer than k wait). Each step with a prefill pays a fixed cost whatever its length — the int4 weights
    dequantised once, an eager step's per-layer Python: ~50-70 ms of a 113 ms 88-token prefill on SmolLM2-135M
    Q4_1, one thread — which k prompts then share, for a few steps at k−1 fewer rows. For offline throughput
    (``benchmarks/inference_serving.py --admission-batch``); a server keeps 1 (time to first token).
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        block_size: int = BLOCK_SIZE,
        num_blocks: int | None = None,
        kv_cache_bytes: int = 512 * 2**20,
        kv_dtype: torch.dtype | str | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        eos_token_id: int | None = None,
        seed: int = 0,
        watermark: float = 0.01,
        selective: bool = True,
        free_outside_window: bool = True,
        num_speculative_tokens: int = 0,
        ngram: tuple[int, int] = (3, 1),
        num_state_slots: int | None = None,
        compile: bool | dict | str = False,
        fuse_projections: bool = True,
        draft_model: Transformer | int | None = None,
        admission_batch: int = 1,
    ):
        p = next(model.parameters())
        c = model.config
        self.model, self.tokenizer, self.config = model, tokenizer, c
        auto = compile == "auto"
        compile, self.compile_reason = compile_policy(compile, p.device)
        max_num_seqs = as_integer("max_num_seqs", max_num_seqs, 1)
        max_num_batched_tokens = as_integer("max_num_batched_tokens", max_num_batched_tokens, 1)
        admission_batch = as_integer("admission_batch", admission_batch, 1)
        if admission_batch > max_num_seqs:
            raise ValueError(
                f"admission_batch={admission_batch} exceeds max_num_seqs={max_num_seqs}: it counts "
                "free seats, at most max_num_seqs"
            )
        num_speculative_tokens = as_integer("num_speculative_tokens", num_speculative_tokens, 0)
        speculator: PromptLookup | DraftRunner = PromptLookup(
            num_speculative_tokens, ngram
        )  # checks ngram even when off
        max_model_len = (
            c.max_seq_len
            if max_model_len is None
            else as_integer("max_model_len", max_model_len, 2)
        )
        self.max_model_len = min(c.max_seq_len, max_model_len)
        block_size = as_integer("block_size", block_size, 1)
        kv_dtype = kv_dtype or p.dtype
        if isinstance(kv_dtype, str):  # a --kv-cache-dtype name ("fp16", "int8", ...)
            kv_dtype = KV_CACHE_DTYPES.get(kv_dtype, kv_dtype)
        if kv_dtype not in KV_DTYPES and kv_dtype not in KV_FORMATS:
            raise ValueError(
                f"kv_dtype={kv_dtype!r} must be one of {', '.join(map(str, KV_DTYPES))} (K/V stored "
                "as computed; a raw integer dtype would silently truncate them) or a quantised "
                f"format {', '.join(map(repr, KV_FORMATS))} (codes with per-block scales), or a name "
                f"{', '.join(map(repr, KV_CACHE_DTYPES))}"
            )
        watermark = as_real("watermark", watermark)
        if not 0 <= watermark < 1:
            raise ValueError(
                f"watermark={watermark!r} must be in [0, 1): the fraction of the blocks kept free "
                "when admitting a request while others run"
            )
        self.states = _state_pool(
            model,
            num_speculative_tokens,
            max_num_seqs
            if num_state_slots is None
            else as_integer("num_state_slots", num_state_slots, 1),
        )
        if self.states is not None:
            enable_prefix_caching = (
                False  # a cached block has no recurrent state for its prefix (docs/inference.md)
            )
        if num_blocks is None:
            num_blocks = _blocks_in(
                as_integer("kv_cache_bytes", kv_cache_bytes, 1),
                c,
                block_size,
                kv_dtype,
                max_num_seqs,
                self.max_model_len,
            )
        num_blocks = as_integer("num_blocks", num_blocks, 2)
        self.cache = PagedKVCache(
            c, num_blocks, block_size, kv_dtype, p.device, enable_prefix_caching
        )
        if eos_token_id is None:
            eos_token_id = (
                c.eos_token_id
                if c.eos_token_id is not None
                else getattr(tokenizer, "eos_token_id", None)
            )
        self.generator = torch.Generator().manual_seed(seed)
        if draft_model is not None:
            if not num_speculative_tokens:
                raise ValueError(
                    "draft_model given with num_speculative_tokens=0: set how many tokens it drafts"
                )
            if isinstance(draft_model, int):
                draft_model = truncated_draft(model, draft_model)
            elif fuse_projections and hasattr(draft_model, "fuse_projections"):
                draft_model.fuse_projections()
            k = num_speculative_tokens
            speculator = DraftRunner(
                draft_model,
                c,
                k,
                num_blocks + max_num_seqs * (1 + -(-k // block_size)),  # + room for the drafts
                block_size,
                self.generator,
                self.max_model_len,
                compile=bool(compile),
                compile_options=compile if isinstance(compile, dict) else None,
            )
        self.speculator = speculator if num_speculative_tokens else None
        self.driver: Driver | None = (
            None  # the one LLM or AsyncLLM that steps this engine (``attach``)
        )
        self.stats = {
            "steps": 0,
            "forwards": 0,
            "preemptions": 0,
            "prompt_tokens": 0,
            "cached_prompt_tokens": 0,
            "computed_tokens": 0,
            "generated_tokens": 0,
            "window_released_blocks": 0,
            "spec_proposed": 0,
            "spec_accepted": 0,
        }
        self.scheduler = Scheduler(
            self.cache.blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len,
            watermark_blocks=int(watermark * num_blocks),
            eos_token_id=eos_token_id,
            sliding_window=c.sliding_window if free_outside_window else None,
            speculator=self.speculator,
            stats=self.stats,
            states=self.states,
            admission_batch=admission_batch,
        )
        if fuse_projections and hasattr(model, "fuse_projections"):
            model.fuse_projections()  # QKV and gate/up as one GEMM each (the weights become views; docs/inference.md)
        # decode-only iterations in fixed shapes (compiled per bucket with ``compile``); not for recurrent
        # states or an MLA latent cache, whose steps stay on the packed batch
        decode = None
        decodable = selective and self.states is None and not self.cache.stores_latent
        if auto and not decodable:
            compile, self.compile_reason = False, "auto: eager (no decode step for this model)"
        if decodable:
            decode = DecodeStep(
                model,
                self.cache,
                self.max_model_len,
                compile=bool(compile),
                compile_options=compile if isinstance(compile, dict) else None,
            )
        elif compile:
            raise ValueError(
                "compile=True: the compiled decode step serves dense softmax-attention models "
                "(no recurrent layers, no MLA latent cache) with selective=True"
            )
        self.runner = ModelRunner(
            model, self.cache, self.generator, selective, states=self.states, decode=decode
        )
        self.requests: dict[str, Seq] = {}
        self._ids = itertools.count()

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Check the request and queue it; a bad one raises ``ValueError`` and queues nothing."""
        seq = self.check_request(request_id, prompt, params, arrival_time)
        self.enqueue(seq)
        return seq.request_id

    def enqueue(self, seq: Seq) -> None:
        """Queue a sequence made by ``check_request``."""
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in the engine")
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def check_request(
        self,
        request_id: str | None,
        prompt,
        params: SamplingParams | None,
        arrival_time: float | None = None,
    ) -> Seq:
        """Everything ``add_request`` checks, without queueing: the prompt, the parameters, the fit."""
        params = SamplingParams() if params is None else params
        if request_id is None:
            request_id = self.new_request_id()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params={params!r} must be a SamplingParams")
        ids = prompt_token_ids(
            prompt, self.config.vocab_size, self.tokenizer, f"request {request_id!r}"
        )
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"request {request_id!r}: prompt of {len(ids)} tokens leaves no room to "
                f"generate within max_model_len={self.max_model_len}"
            )
        need = min(len(ids) + params.max_tokens, self.max_model_len)
        capacity = self.cache.blocks.capacity_tokens
        if need > capacity:
            raise PromptTooLongError(
                f"request {request_id!r}: prompt + max_tokens = {need} tokens cannot fit in the "
                f"KV pool of {capacity} tokens even alone; lower max_tokens "
                "or give the engine more blocks"
            )
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        stops = StopStrings(self.tokenizer, params.stop) if self.tokenizer is not None else None
        return Seq(
            request_id,
            list(ids),
            len(ids),
            params,
            arrival,
            gen,
            stops,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] * len(ids) if params.prompt_logprobs is not None else None,
        )

    def new_request_id(self, prefix: str = "req") -> str:
        """A request id not used by this engine before (``prefix-N``)."""
        return f"{prefix}-{next(self._ids)}"

    def abort_all(self) -> list[str]:
        """Abort every request in the engine (blocks freed); returns their ids."""
        ids = list(self.requests)
        for rid in ids:
            self.abort_request(rid)
        return ids

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False when it is unknown or already finished."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self._stop(seq, "abort")
        return True

    def _stop(self, seq: Seq, reason: str, error: BaseException | None = None) -> None:
        """The one early exit (abort, error): out of the queues and the engine, blocks freed (after
        an error, cleaned first when they hold NaN/inf: ``BlockManager.scrub``)."""
        if error is not None:
            seq.error = f"request {seq.request_id!r} failed: {type(error).__name__}: {error}"
        self.scheduler.remove(seq, scrub=error is not None)
        self.requests.pop(seq.request_id, None)
        seq.finish(reason, time.perf_counter())

    @contextlib.contextmanager
    def _isolated(self, seq: Seq, failed: list[Seq]):
        """Run one sequence's share of a step; an exception fails that sequence only."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 — any failure of one request must not reach the others
            self._stop(seq, "error", e)
            failed.append(seq)

    def warm_up(self, batch_sizes: Iterable[int] | None = None) -> None:
        """Compile the decode step's batch buckets for ``batch_sizes`` (default every bucket up to
        ``max_num_seqs``) at every table bucket up to max_model_len (one where the C++ kernel reads the
        table), before serving — the draft model's too; nothing to do without ``compile``."""
        sizes = range(1, self.scheduler.max_num_seqs + 1) if batch_sizes is None else batch_sizes
        sizes = [as_integer("batch size", b, 1) for b in sizes]
        for decode in (self.runner.decode, getattr(self.speculator, "decode", None)):
            if decode is not None and decode.compiled:  # the engine's step, the draft model's
                decode.warm_up(sizes)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache — call after the model's weights change (an RL learner updating the shared
        parameters in place), so no request is served K/V computed with the old weights. Refused while requests
        are running (their blocks hold old K/V too). Returns how many cached blocks were forgotten."""
        if self.has_unfinished_requests():
            raise RuntimeError(
                "reset_prefix_cache() with requests still running: finish or abort them first"
            )
        return self.cache.blocks.reset_prefix_cache()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.stats["cached_prompt_tokens"] / max(1, self.stats["prompt_tokens"])

    # ---- one iteration -------------------------------------------------------------------
    def attach(self, driver: Driver) -> None:
        """Make ``driver`` (an ``LLM`` or ``AsyncLLM``) the one that steps this engine; each driver claims the
        engine when it starts work. The engine is not thread-safe and a driver takes every request in it for
        its own, so while another driver has work in flight (its ``busy()``) the claim is refused by name —
        instead of two loops stepping one engine (which lost requests or hung). An idle driver is replaced."""
        current = self.driver
        if current is not None and current is not driver and current.busy():
            raise RuntimeError(
                f"this LLMEngine is already driven by a {type(current).__name__} with requests in "
                f"flight; one engine has one driver at a time (use that {type(current).__name__}, "
                f"or build another engine for the {type(driver).__name__})"
            )
        self.driver = driver

    def step(self) -> list[RequestOutput]:
        """Schedule, run one iteration, sample; returns outputs of the requests that progressed."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        self.stats["steps"] += 1
        progressed = self._run(scheduled)
        outputs = [s.output() for s in progressed]
        self.scheduler.end_step()
        for s in progressed:
            if s.status == FINISHED:
                self.requests.pop(s.request_id, None)
        return outputs

    def _run(self, scheduled: list[tuple[Seq, int]]) -> list[Seq]:
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

    def _execute(self, scheduled: list[tuple[Seq, int]]) -> list[Seq]:
        """One forward (``ModelRunner``), then each sequence's commit, verification or sampling and
        stop rules, isolated; returns the sequences that progressed or failed."""
        order = sorted(scheduled, key=lambda r: r[1] > 1)  # decode rows first (stable)
        logits, first_row = self.runner.forward(order)
        self.stats["forwards"] += 1
        failed: list[Seq] = []
        ready, ready_rows, spec = [], [], []
        for (s, n), at in zip(order, first_row):
            self.stats["computed_tokens"] += n
            if s.drafts:  # committed after verification, when it is known how many drafts stay
                assert logits is not None  # a speculating row needs its logits
                spec.append(s)
                with self._isolated(s, failed):
                    self._verify(s, logits[at : at + n])  # (k + 1, V)
                continue
            with self._isolated(s, failed):
                self.scheduler.commit(s, n)
            if s.status == RUNNING and s.num_computed == len(s.all_ids):
                ready.append(s)
                ready_rows.append(at)
        if ready:
            assert logits is not None  # a ready row needs its logits
            if ready_rows != list(range(logits.shape[0])):  # (R, V); every row ready: no copy
                logits = logits[ready_rows]
            for s, result in zip(ready, self.runner.sample(ready, logits)):
                with self._isolated(s, failed):
                    if isinstance(result, Exception):
                        raise result
                    self.scheduler.append(s, *result)
        return list(dict.fromkeys(ready + spec + failed))

    def _verify(self, s: Seq, logits: torch.Tensor) -> None:
        """Emit the kept drafts and one more token; logits (k + 1, V) at the last token and each draft."""
        emitted = self.runner.verify(s, logits)
        kept = len(emitted) - 1
        self.stats["spec_proposed"] += len(s.drafts)
        self.stats["spec_accepted"] += kept
        drafts, s.drafts, s.draft_probs = s.drafts, [], None
        # the cache holds K/V of the last token and all k drafts: keep the last token's and the kept ones'
        self.scheduler.commit(s, 1 + kept, s.all_ids + drafts[:kept])
        for token, logprobs in emitted:
            self.scheduler.append(s, token, logprobs)
            if s.status == FINISHED:
                break


class GenerationError(RuntimeError):
    """Requests that failed while running (e.g. NaN logits): each was aborted and its blocks freed,
    the others finished. ``outputs`` holds every output of the call, failed ones with
    ``finish_reason == "error"`` and ``error`` set."""

    def __init__(self, message: str, outputs: list[RequestOutput]):
        super().__init__(message)
        self.outputs = outputs
