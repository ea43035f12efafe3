"""Draft-model speculation inside the batching engine: a small model q proposes k tokens for every
decoding sequence at once, from its own paged KV cache.

Book of LLMs §2.3 “speculative decoding” and CS336 notes "无损提速" (speculative decoding, Leviathan et al. 2023 / Chen et al.
2023). Per iteration the scheduler asks ``propose_batch`` for the running sequences that decode; the
draft then runs 1 + (k − 1) batched forwards over them:

1. catch-up: each sequence feeds the tokens the draft has not stored yet (its whole prompt after
   admission or preemption, else the one to k + 1 tokens the last step emitted), all sequences in
   one flattened row (``PagedKVCache.packed_batch``), and draws draft 1 from the last position;
2. k − 1 single-token steps, each draws the next draft — through a ``DecodeStep`` over the draft's
   pool (fixed shapes; compiled per bucket when the engine compiles its own).

The draft's cache then holds the sequence plus its first k − 1 drafts. It is not rolled back when
the target rejects drafts: at the next proposal the stored tokens are compared with the sequence
(only the drafts part can differ, O(k)) and truncated to the common prefix. Greedy requests take
the draft's argmax (q one-hot); others sample q = the request's own distribution (``target_probs``)
over the draft's logits, and the target verifies with q (``verify_drafts``), so output keeps exactly
the target's distribution. A sequence whose draft blocks do not fit gets no drafts this step (its
draft blocks are given back), never another sequence's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lmstack.inference.decode_step import DecodeStep
from lmstack.inference.paged import PagedKVCache, kv_pool_bytes
from lmstack.inference.sampling import as_integer, target_probs
from lmstack.inference.sequence import Sequence as Seq
from lmstack.model.mixer_spec import refuse

if TYPE_CHECKING:
    from lmstack.model.transformer import Transformer


class DraftRunner:
    """The engine's draft-model proposer; ``k`` drafts per decoding sequence and step.

    ``num_blocks`` of ``block_size`` tokens in the draft's own pool (default: as many tokens as the
    target's pool, plus one block per sequence for the drafts). ``propose_batch`` fills ``seq.drafts`` and
    ``seq.draft_probs``; ``release`` gives a sequence's draft blocks back (finish, abort, preemption).
    """

    def __init__(
        self,
        draft: Transformer,
        target_config,
        k: int,
        num_blocks: int,
        block_size: int,
        generator: torch.Generator,
        max_model_len: int,
        compile: bool = False,
        compile_options: dict | None = None,
    ):
        self.k = as_integer("num_speculative_tokens", k, 1)
        c = draft.config
        if c.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"draft_model vocab_size={c.vocab_size} != target vocab_size="
                f"{target_config.vocab_size}: drafts must be the target's token ids"
            )
        refuse(c, "paged", "a draft model in the engine")
        if not kv_pool_bytes(c, 1, block_size, torch.float32):
            raise ValueError(
                "draft_model has no softmax-attention layer: its state could not be rolled back "
                "past rejected drafts; use a Transformer draft"
            )
        p = next(draft.parameters())
        self.model, self.generator, self.device = draft.eval(), generator, p.device
        self.cache = PagedKVCache(c, num_blocks, block_size, p.dtype, p.device, False)
        self.decode = (
            None
            if self.cache.stores_latent
            else DecodeStep(draft, self.cache, max_model_len, compile, compile_options)
        )
        # per sequence: (length of all_ids fed, the drafts fed after it) = what the draft cache holds
        self.fed: dict[str, tuple[int, list[int]]] = {}
        self.forwards = 0

    def release(self, rid: str) -> None:
        self.fed.pop(rid, None)
        self.cache.blocks.free(rid)

    def _sync(self, seq: Seq, need: int) -> int | None:
        """Truncate the draft cache of ``seq`` to its common prefix with ``all_ids`` and reserve room for
        ``need`` more tokens past it; returns the stored length, or None (no room: no drafts)."""
        rid, ids, blocks = seq.request_id, seq.all_ids, self.cache.blocks
        if rid not in self.fed:
            blocks.allocate(rid, ())
            self.fed[rid] = (0, [])
        base, drafts = self.fed[rid]
        common = base
        for d in drafts:
            if common >= len(ids) - 1 or ids[common] != d:
                break
            common += 1
        common = min(common, len(ids) - 1)  # the last token is always fed: its logits draw draft 1
        blocks.truncate(rid, common)
        self.fed[rid] = (common, [])
        if not blocks.can_append(rid, need + len(ids) - common):
            self.release(rid)
            return None
        blocks.reserve(rid, need + len(ids) - common)
        return common

    @torch.inference_mode()
    def _forward(self, rows: list[tuple[str, int, int]], ids: list[int]) -> Tensor:
        """Run the draft over rows (rid, start, n) of tokens ``ids``; logits (R, V) at each row's last."""
        batch, positions, seq_ids = self.cache.packed_batch(rows)
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)[None]  # (1, T)
        hidden = self.model(
            tokens, positions, kv_cache=batch, document_ids=seq_ids, return_hidden=True
        )[0]  # (T, D)
        last = torch.tensor(rows_ends(rows), device=self.device) - 1
        self.forwards += 1
        return self.model.unembed(hidden[last]).float().cpu()  # (R, V)

    @torch.inference_mode()
    def _decode(self, step: list[Seq]) -> Tensor:
        """Feed each sequence's newest draft (one token per row); logits (R, V)."""
        blocks = self.cache.blocks
        positions = [len(s.all_ids) + len(s.drafts) - 1 for s in step]
        tables = [
            blocks.tables[s.request_id][: blocks.blocks_for(p + 1)] for s, p in zip(step, positions)
        ]
        self.forwards += 1
        assert self.decode is not None  # _decode runs only with a DecodeStep
        return self.decode.forward([s.drafts[-1] for s in step], positions, tables).float().cpu()

    def _draw(self, seq: Seq, logits: Tensor, history: list[int]) -> tuple[int, Tensor | None]:
        """One draft token from the draft's logits (V,): argmax for plain greedy, else a sample of
        the request's distribution q (returned for verification)."""
        params = seq.params
        if params.greedy and params.repetition_penalty == 1.0:
            return int(logits.argmax()), None
        q = target_probs(logits, params, history)  # (V,)
        if params.greedy:
            return int(q.argmax()), q
        return int(torch.multinomial(q, 1, generator=seq.generator or self.generator)), q

    def propose_batch(self, items: Sequence[tuple[Seq, int]]) -> None:
        """items: (sequence, room) — at most min(k, room) drafts each, written to ``seq.drafts`` and
        ``seq.draft_probs`` ((n, V) or None when every draft is one-hot)."""
        want: dict[str, int] = {}
        starts: dict[str, int] = {}
        live: list[Seq] = []
        for seq, room in items:
            seq.drafts, seq.draft_probs = [], None
            k = min(self.k, room)
            if k <= 0:
                continue
            start = self._sync(seq, k - 1)
            if start is None:
                continue
            want[seq.request_id], starts[seq.request_id] = k, start
            live.append(seq)
        if not live:
            return
        q_rows: dict[str, list[Tensor | None]] = {s.request_id: [] for s in live}
        rows, ids = [], []
        for s in live:  # 1. catch up and draw draft 1
            rid = s.request_id
            rows.append((rid, starts[rid], len(s.all_ids) - starts[rid]))
            ids.extend(s.all_ids[starts[rid] :])
        step = live
        while step:
            if rows:
                logits = self._forward(rows, ids)
            elif self.decode is not None:
                logits = self._decode(step)
            else:
                rows = [(s.request_id, len(s.all_ids) + len(s.drafts) - 1, 1) for s in step]
                logits = self._forward(rows, [s.drafts[-1] for s in step])
            fed = [n for _, _, n in rows] if rows else [1] * len(step)
            for s, n, row in zip(step, fed, logits):
                rid = s.request_id
                self.cache.blocks.commit(rid, s.all_ids + s.drafts, n)
                token, q = self._draw(s, row, s.all_ids + s.drafts)
                s.drafts.append(token)
                q_rows[rid].append(q)
            # 2. then feed the newest draft of those that want more
            step = [s for s in step if len(s.drafts) < want[s.request_id]]
            rows, ids = [], []
        for s in live:
            rid = s.request_id
            self.fed[rid] = (len(s.all_ids), s.drafts[:-1])
            qs = q_rows[rid]
            if any(q is not None for q in qs):
                vocab = self.model.config.vocab_size
                s.draft_probs = torch.stack(
                    [q if q is not None else _one_hot(d, vocab) for q, d in zip(qs, s.drafts)]
                )  # (k, V)


def rows_ends(rows: Sequence[tuple[str, int, int]]) -> list[int]:
    """Flat index + 1 of each row's last token in the packed (1, T) row."""
    out, t = [], 0
    for _, _, n in rows:
        t += n
        out.append(t)
    return out


def _one_hot(token: int, vocab: int) -> Tensor:
    q = torch.zeros(vocab)
    q[token] = 1.0
    return q
