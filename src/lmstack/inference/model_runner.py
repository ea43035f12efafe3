"""The model runner: one forward for one iteration, then the tokens it yields.

Book of LLMs §2.2 (Orca's selective batching), §2.3 (speculative verification), §2.6 (sampling);
CS336 notes "推理流程". The scheduled sequences' new tokens — decode tokens first, then prefill
chunks and speculative drafts — are flattened into one (1, T) row without padding, with
per-token positions and sequence ids; the cache's batch object gives the attention seam its
slots and key metadata from the block tables. Only the rows that need a next token go through
the unembedding — and the prompt positions of a request that asked for prompt logprobs
(``prompt_logprobs``). ``sample`` draws one token per ready row, ``verify`` checks a row's drafts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmstack.inference.decode_step import DecodeStep
from lmstack.inference.paged import PackedPagedBatch, PagedKVCache
from lmstack.inference.sampling import (
    NonFiniteLogitsError,
    bad_logit_rows,
    check_logits,
    rows_logprobs,
    sample_rows,
    sample_token,
    token_logprobs,
)
from lmstack.inference.sequence import Sequence
from lmstack.inference.speculative import verify_drafts
from lmstack.inference.state_pool import RecurrentBatch, StatePool


class ModelRunner:
    """Runs ``model`` over ``cache``; ``selective=False`` uses the reference packed attention
    (one masked attention over every gathered key) instead of the per-sequence grouping. ``decode``: the
    ``DecodeStep`` that runs iterations in which every row feeds just its next token (eager or compiled),
    or None (every iteration goes through the packed batch)."""

    def __init__(
        self,
        model,
        cache: PagedKVCache,
        generator: torch.Generator,
        selective: bool = True,
        states: StatePool | None = None,
        decode: DecodeStep | None = None,
    ):
        self.model, self.cache, self.generator, self.selective = model, cache, generator, selective
        self.states = states  # recurrent-state slots of a hybrid model (``state_pool``), or None
        self.decode = decode
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def forward(self, order: list[tuple[Sequence, int]]) -> tuple[Tensor | None, list[int]]:
        """One forward over (sequence, n tokens) rows, in this order. Returns logits (R, V) of the
        rows that need them — the last token of a sequence whose prompt is then complete, every
        fed position of a speculating one (its last token and its k drafts) — and each
        sequence's first row in them."""
        if self.decode is not None and all(
            n == 1 and not s.drafts and s.num_computed + 1 == len(s.all_ids) for s, n in order
        ):
            blocks = self.cache.blocks
            logits: Tensor | None = self.decode.forward(
                [s.all_ids[-1] for s, _ in order],
                [s.num_computed for s, _ in order],
                [
                    blocks.tables[s.request_id][: blocks.blocks_for(s.num_computed + 1)]
                    for s, _ in order
                ],
            )
            return logits, list(range(len(order)))
        rows = [(s.request_id, s.num_computed, n) for s, n in order]
        batch: PackedPagedBatch | RecurrentBatch
        batch, positions, seq_ids = self.cache.packed_batch(rows, selective=self.selective)
        if self.states is not None:  # recurrent layers read their sequences' states from the pool
            batch = self.states.batch(batch, rows)
        ids: list[int] = []
        for s, n in order:
            ids.extend(s.all_ids[s.num_computed : s.num_computed + n - len(s.drafts)] + s.drafts)
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)[None]  # (1, T)
        hidden = self.model(
            tokens, positions, kv_cache=batch, document_ids=seq_ids, return_hidden=True
        )[0]  # (T, D)
        need: list[int] = []
        first_row: list[int] = []
        t = 0
        for s, n in order:
            t += n
            first_row.append(len(need))
            if s.drafts:
                need.extend(range(t - n, t))
            elif s.num_computed + n == len(s.all_ids):
                need.append(t - 1)
        logits = self.model.unembed(hidden[need]) if need else None  # (R, V)
        if (
            not self.selective
            and len(order) > 1
            and logits is not None
            and bool(bad_logit_rows(logits).any())
        ):
            # the reference attention sees every sequence's keys, masked, and 0 · NaN = NaN: one
            # sequence's NaN K/V reach all rows, so the caller reruns them one at a time (nothing committed yet)
            raise NonFiniteLogitsError("non-finite logits in a step over several sequences")
        t = 0
        for s, n in order:
            if s.prompt_logprobs is not None and s.num_computed + 1 < s.num_prompt:
                self.prompt_logprobs(s, hidden[t : t + n])
            t += n
        return logits, first_row

    def prompt_logprobs(self, s: Sequence, hidden: Tensor, chunk: int = 512) -> None:
        """Fill ``s.prompt_logprobs[j + 1]`` = (log p(prompt[j + 1] | prompt[:j + 1]), top n) from the hidden
        states (n, D) of the chunk fed at positions ``num_computed ..``; by index, so a recomputation (after
        preemption, or a forward rerun one sequence at a time) writes the same values again."""
        assert s.prompt_logprobs is not None and s.params.prompt_logprobs is not None  # asked for
        j0 = s.num_computed
        m = min(
            len(hidden), s.num_prompt - 1 - j0
        )  # positions whose next token is still in the prompt
        for c0 in range(0, m, chunk):
            c1 = min(m, c0 + chunk)
            rows = rows_logprobs(
                self.model.unembed(hidden[c0:c1]),
                s.all_ids[j0 + c0 + 1 : j0 + c1 + 1],
                s.params.prompt_logprobs,
            )  # (c, V) logits -> c entries
            s.prompt_logprobs[j0 + c0 + 1 : j0 + c1 + 1] = rows

    def sample(
        self, seqs: list[Sequence], logits: Tensor
    ) -> list[tuple[int, tuple | None] | Exception]:
        """logits (R, V) of R ready sequences -> per row (token, logprobs or None), or the exception
        that fails that row only (NaN/+inf logits: ``check_logits`` names what was found).
        Rows without repetition penalty or logits processors are sampled together (``sample_rows``:
        batched filters, one uniform per row from its own generator); the others go through
        ``sample_token``; the logprobs of the rows that asked are one batched ``rows_logprobs``."""
        top: list[int] = []
        if any(s.params.greedy for s in seqs):
            # one pass for both: the row maxima show the bad rows (``bad_logit_rows``' rule: NaN, +inf, all
            # -inf) and their first indices are the greedy tokens (as argmax's; measured 0.4 ms against
            # argmax's 1.1 at 16 rows of 49152 logits, one thread)
            values, indices = logits.max(dim=-1)  # (R,), (R,)
            bad = (~torch.isfinite(values)).tolist()
            top = indices.tolist()
        else:
            bad = bad_logit_rows(logits).tolist()
        plain = [
            i
            for i, s in enumerate(seqs)
            if s.params.repetition_penalty == 1.0 and not s.params.logits_processors and not bad[i]
        ]
        greedy = [i for i in plain if seqs[i].params.greedy]
        plain = [i for i in plain if not seqs[i].params.greedy]
        out: list = [None] * len(seqs)
        tokens: list[int] = [0] * len(seqs)
        for i in greedy:  # the row maxima's indices, where the logits are (no copy to the CPU)
            tokens[i] = top[i]
        every_greedy = len(greedy) == len(seqs) and all(s.logprobs is None for s in seqs)
        # (R, V) on the CPU for the sampled rows and logprobs; no copy for fp32 logits on the CPU
        logits_cpu = logits if every_greedy else logits.float().cpu()
        if plain:
            x = logits_cpu[plain] if len(plain) < len(seqs) else logits_cpu
            try:
                drawn = sample_rows(
                    x,
                    [seqs[i].params for i in plain],
                    [seqs[i].generator or self.generator for i in plain],
                )
                for i, t in zip(plain, drawn):
                    tokens[i] = t
            except Exception as e:  # noqa: BLE001 — fails these rows only
                for i in plain:
                    out[i] = e
        plain_set = set(plain) | set(greedy)
        for i, s in enumerate(seqs):
            if i in plain_set:
                continue
            try:
                if bad[i]:
                    check_logits(logits[i])  # raises NonFiniteLogitsError
                tokens[i] = sample_token(
                    logits_cpu[i], s.params, s.generator or self.generator, s.all_ids, s.output_ids
                )
            except Exception as e:  # noqa: BLE001 — one row's failure is that request's alone
                out[i] = e
        by_n: dict[int, list[int]] = {}  # rows asking logprobs, by their number of alternatives
        for i, s in enumerate(seqs):
            if out[i] is None and s.logprobs is not None:
                assert s.params.logprobs is not None  # asked for
                by_n.setdefault(s.params.logprobs, []).append(i)
        lps: dict[int, tuple] = {}
        for n, idx in by_n.items():
            lps.update(zip(idx, rows_logprobs(logits_cpu[idx], [tokens[i] for i in idx], n)))
        return [o if o is not None else (tokens[i], lps.get(i)) for i, o in enumerate(out)]

    def verify(self, seq: Sequence, logits: Tensor) -> list[tuple[int, tuple | None]]:
        """logits (k + 1, V) at the sequence's last token and at each draft -> the kept drafts and
        one more token, each with its logprobs (or None). Speculation's one accept/reject rule."""
        check_logits(logits)
        logits_cpu = logits.float().cpu()
        emitted, _ = verify_drafts(
            logits_cpu,
            seq.drafts,
            seq.params,
            seq.all_ids,
            seq.generator or self.generator,
            seq.draft_probs,
        )
        if seq.logprobs is None:
            return [(t, None) for t in emitted]
        assert seq.params.logprobs is not None  # seq.logprobs is a list when they were asked for
        return [
            (t, token_logprobs(logits_cpu[i], t, seq.params.logprobs))
            for i, t in enumerate(emitted)
        ]
