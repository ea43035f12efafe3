"""The scheduler: which sequences run in the next iteration, with how many tokens, and what
happens to them afterwards (Book of LLMs §2.2 “batching and packing” token-budget batching; CS336 notes "动态负载", Orca
iteration-level scheduling, vLLM preemption by recomputation).

``schedule`` fills a token budget (``max_num_batched_tokens``): running sequences first (a decode
costs 1 token plus its speculative drafts (proposed for all decoding sequences at once,
``_propose_all``: prompt lookup or a draft model's batch), an unfinished prompt continues with a chunk — chunked
prefill), then waiting requests while blocks, the budget and ``max_num_seqs`` allow — with
``admission_batch`` k > 1, while others run, only once k seats are free (or fewer than k requests wait),
so prompts that queue behind a full batch are prefilled together rather than one mixed step each. When a
running sequence needs a block and none is free, the most recently admitted one is preempted:
its blocks are freed and it goes back to the front of the queue (prefix caching usually gives
its blocks back). A waiting request whose next prompt block another sequence computes in this step
waits for the next one and reads that block from the prefix cache (the G samples of a GRPO prompt
prefill it once; SGLang's in-batch prefix sharing). After the forward, ``commit`` records stored K/V and ``append`` applies a new
token and the stop rules. A model with recurrent layers also needs a slot of the ``StatePool``
(``states``): taken on admission (no free slot: the request waits), given back with the blocks.
"""

from __future__ import annotations

import time
from collections import deque

from lmstack.inference.block_manager import BlockManager, chain_hash
from lmstack.inference.draft_runner import DraftRunner
from lmstack.inference.sequence import RUNNING, WAITING, Sequence
from lmstack.inference.speculative import PromptLookup
from lmstack.inference.state_pool import StatePool
from lmstack.inference.stops import token_stop


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        watermark_blocks: int,
        eos_token_id: int | None,
        sliding_window: int | None,
        speculator: PromptLookup | DraftRunner | None,
        stats: dict,
        states: StatePool | None = None,
        admission_batch: int = 1,
    ):
        self.blocks = blocks
        self.states = states  # recurrent-state slots (hybrid models), or None
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.admission_batch = admission_batch  # seats that must be free to admit while others run
        self.max_model_len, self.watermark_blocks = max_model_len, watermark_blocks
        self.eos_token_id, self.sliding_window = (
            eos_token_id,
            sliding_window,
        )  # window None: keep old blocks
        self.speculator, self.stats = speculator, stats
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence, scrub: bool = False) -> None:
        """Take a sequence out of the queues and give its blocks back (abort, error); ``scrub``
        (after an error) first zeroes its own blocks that hold NaN/inf (``BlockManager.scrub``)."""
        if seq.status == WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status == RUNNING and seq in self.running:
            self.running.remove(seq)
        if scrub:
            self.blocks.scrub(seq.request_id)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Give back a sequence's blocks, its state slot and its draft model's blocks."""
        self.blocks.free(seq.request_id)
        if self.speculator is not None:
            self.speculator.release(seq.request_id)
        if self.states is not None:
            self.states.free(seq.request_id)

    # ---- before the forward --------------------------------------------------------------
    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to feed) for the next forward; drafts are in ``seq.drafts``."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        self._propose_all(budget)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.all_ids) - seq.num_computed, budget)
            if n != 1 or len(seq.drafts) > budget - 1:  # the budget a preemption left
                self._drop_drafts(seq, budget - 1 if n == 1 else 0)
            n += len(seq.drafts)
            while not self.blocks.can_append(seq.request_id, n):
                if seq.drafts:  # speculation never costs another sequence its blocks
                    n -= len(seq.drafts)
                    self._drop_drafts(seq, 0)
                    continue
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != RUNNING:
                break
            self.blocks.reserve(seq.request_id, n)
            scheduled.append((seq, n))
            budget -= n
            i += 1
        if preempted:
            return scheduled
        # the next prompt block each prefilling sequence computes: a waiting request that needs the same block
        # waits one step and then reads it from the prefix cache (G samples of one prompt prefill it once)
        pending = {h for seq, _ in scheduled if (h := self._next_prompt_block(seq))}
        free = self.max_num_seqs - len(self.running)
        if self.running and free < min(self.admission_batch, len(self.waiting)):
            return scheduled  # wait for more seats: the prompts then share one prefill step
        i = 0  # waiting requests passed over (at most max_num_seqs looked at beyond the admitted ones)
        while (
            i < min(len(self.waiting), self.max_num_seqs)
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            if self.states is not None and not self.states.num_free:
                break  # no state slot: the request waits for a running one to finish
            seq = self.waiting[i]
            # prompt logprobs need the logits at every prompt position: such a request takes no prefix hit
            cached = self.blocks.allocate(
                seq.request_id, seq.all_ids if seq.prompt_logprobs is None else ()
            )
            h = self._next_prompt_block(seq) if seq.prompt_logprobs is None else None
            if h is not None and h in pending:
                self.blocks.free(seq.request_id)
                i += 1
                continue
            n = min(len(seq.all_ids) - cached, budget)
            if not self.blocks.can_append(
                seq.request_id, n, reserve=self.watermark_blocks if self.running else 0
            ):
                self.blocks.free(seq.request_id)
                break
            del self.waiting[i]
            if h is not None:
                pending.add(h)
            seq.num_computed = cached
            if seq.num_cached_tokens is None:  # first admission: prefix-cache statistics
                seq.num_cached_tokens = cached
                self.stats["prompt_tokens"] += seq.num_prompt
                self.stats["cached_prompt_tokens"] += cached
            seq.status = RUNNING
            if self.states is not None:
                self.states.allocate(seq.request_id)
            self.running.append(seq)
            self.blocks.reserve(seq.request_id, n)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def _next_prompt_block(self, seq: Sequence) -> bytes | None:
        """The chained hash of the first prompt block ``seq`` has not stored yet, when that block is full and
        could be served from the prefix cache (``BlockManager.allocate``'s limit), else None."""
        blocks = self.blocks
        if not blocks.enable_prefix_caching:
            return None
        hashes, bs = blocks.hashes[seq.request_id], blocks.block_size
        j = len(hashes)
        if j >= (seq.num_prompt - 1) // bs:
            return None
        return chain_hash(hashes[-1] if hashes else None, seq.all_ids[j * bs : (j + 1) * bs])

    def _propose_all(self, budget: int) -> None:
        """Drafts for every running sequence that decodes, proposed together (a draft model runs them
        as one batch): each gets the room its place in the token budget leaves, within what
        max_tokens / max_model_len still allow after the next token."""
        items = []
        for seq in self.running:
            seq.drafts, seq.draft_probs = [], None
            if budget <= 0:
                break
            n = min(len(seq.all_ids) - seq.num_computed, budget)
            budget -= n
            if n != 1 or self.speculator is None or seq.params.logits_processors:
                continue  # drafts would bypass the processors
            room = min(
                budget,
                self.speculator.k,
                seq.params.max_tokens - seq.num_output - 1,
                self.max_model_len - len(seq.all_ids) - 1,
            )
            if room > 0:
                items.append((seq, room))
                budget -= room
        if items:
            assert self.speculator is not None  # items are only gathered for a speculator
            self.speculator.propose_batch(items)

    @staticmethod
    def _drop_drafts(seq: Sequence, keep: int) -> None:
        keep = max(0, keep)
        seq.drafts = seq.drafts[:keep]
        if seq.draft_probs is not None:
            seq.draft_probs = seq.draft_probs[:keep] if keep else None

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)  # a recurrent state is dropped too: it is rebuilt by the recomputation
        seq.num_computed = 0
        seq.drafts, seq.draft_probs = [], None
        seq.status = WAITING
        seq.num_preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(seq)

    # ---- after the forward ---------------------------------------------------------------
    def commit(self, seq: Sequence, n: int, token_ids: list[int] | None = None) -> None:
        """``n`` more of the sequence's tokens have their K/V in the cache. ``token_ids``: the tokens
        up to them when these are not all in ``all_ids`` yet (kept drafts); the blocks reserved
        past them (for rejected drafts) are then given back."""
        rid = seq.request_id
        self.blocks.commit(rid, seq.all_ids if token_ids is None else token_ids, n)
        if self.states is not None:
            self.states.commit(rid)  # the states the forward staged for these tokens
        if token_ids is not None:
            self.blocks.truncate(rid, self.blocks.num_tokens[rid])
        if self.sliding_window is not None:
            self.stats["window_released_blocks"] += self.blocks.release_outside_window(
                rid, self.sliding_window
            )
        seq.num_computed += n

    def append(self, seq: Sequence, token: int, logprobs=None) -> None:
        """A new token for ``seq``; the stop rules (stop token, max_tokens, max_model_len, stop string)
        finish it and free its blocks. ``logprobs``: the (log p, top) pair to record."""
        now = time.perf_counter()
        seq.all_ids.append(token)
        self.stats["generated_tokens"] += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_times.append(now)
        if logprobs is not None:
            assert seq.logprobs is not None  # logprobs are computed for a request that asked
            seq.logprobs.append(logprobs)
        reason = token_stop(token, seq.num_output, seq.params, self.eos_token_id)
        if reason is None and len(seq.all_ids) >= self.max_model_len:
            reason = "length"
        # the text leaves a stop token out; a stop string cuts it and ends the request too
        if seq.stops is not None and seq.stops.update(
            seq.output_ids[:-1] if reason == "stop" else seq.output_ids
        ):
            reason = "stop"
        if reason is not None:
            seq.finish(reason, now)
            self._release(seq)

    def end_step(self) -> None:
        self.running = [s for s in self.running if s.status == RUNNING]
