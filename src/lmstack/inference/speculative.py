"""Speculative decoding: a cheap proposer guesses k tokens, the target checks them in one pass.

Book of LLMs §2.3 “speculative decoding” and CS336 notes "无损提速". The target p scores the k drafted tokens x_1..x_k in a
single forward (a prefill of k+1 tokens, about as cheap as one decode step when decoding is
memory-bound). Each x_i is accepted with probability min(1, p(x_i)/q(x_i)); at the first
rejection the remaining drafts are discarded and a token is drawn from
norm(max(0, p − q)); if all k are accepted the target's next distribution gives a bonus token
for free. The seed's proof: P(x) = min(q(x), p(x)) + max(0, p(x) − q(x)) = p(x), so the
output has exactly the target's distribution (lossless). Greedy decoding is the one-hot case:
a draft is kept iff it is the target's argmax.

Proposers:
- a draft model q (a smaller lmstack model, or ``truncated_draft``: the target's first layers
  sharing its weights);
- prompt lookup (n-gram): find the most recent earlier occurrence of the last n tokens and
  propose what followed it; q is one-hot on the proposal, so acceptance is p(x).

The expected acceptance rate is α = Σ_x min(p(x), q(x)) (CS336 notes); ``SpeculativeStats``
reports the measured rate and the tokens produced per target forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lmstack.inference.kv_cache import KVCache
from lmstack.inference.sampling import SamplingParams, as_integer, check_logits, target_probs
from lmstack.model.transformer import Transformer


def truncated_draft(model: Transformer, n_layers: int) -> Transformer:
    """A draft that is the target's first ``n_layers`` blocks + its final norm and unembedding.

    The weights are shared (no copy); the draft is a Transformer of its own config.
    """
    if not 1 <= n_layers <= model.config.n_layers:
        raise ValueError(f"n_layers={n_layers} must be in [1, {model.config.n_layers}]")
    with torch.device("meta"):
        draft = Transformer(model.config.replace(n_layers=n_layers))
    draft.embed = model.embed
    draft.rope = model.rope
    draft.blocks = nn.ModuleList(model.blocks[:n_layers])
    draft.norm = model.norm
    draft.lm_head = model.lm_head
    return draft.eval()


def ngram_propose(tokens: Sequence[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup: the ≤ k tokens that followed the latest earlier match of the last n tokens
    (trying n = max_n down to min_n); [] when nothing matches."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = list(tokens[L - n :])
        for start in range(L - n - 1, -1, -1):  # latest earlier occurrence first
            if list(tokens[start : start + n]) == suffix:
                follow = list(tokens[start + n : start + n + k])
                if follow:
                    return follow
    return []


def rejection_sample(
    p: Tensor, q: Tensor, draft: Sequence[int], generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Book of LLMs §2.3 “speculative decoding” accept/reject. p (k+1, V) target, q (k, V) proposer, draft: k token ids.

    Returns (emitted tokens, number of accepted drafts): the accepted drafts followed by one
    token — the residual sample at the first rejection, or the bonus token from p[k].
    """
    k = len(draft)
    if p.shape[0] != k + 1 or q.shape[0] != k:
        raise ValueError(
            f"need p with k+1={k + 1} rows and q with k={k} rows, got {tuple(p.shape)} and {tuple(q.shape)}"
        )
    out: list[int] = []
    for i, x in enumerate(draft):
        r = float(torch.rand((), generator=generator))
        if r * float(q[i, x]) < float(p[i, x]):  # r < min(1, p/q), written without dividing
            out.append(int(x))
            continue
        residual = (p[i] - q[i]).clamp_min(0)  # max(0, p − q)
        if float(residual.sum()) <= 0:  # p == q numerically: any p-sample is exact
            residual = p[i]
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out, i
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))  # the free bonus token
    return out, k


def verify_drafts(
    logits: Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    history: Sequence[int],
    generator: torch.Generator | None = None,
    q: Tensor | None = None,
) -> tuple[list[int], int]:
    """Speculation's one accept/reject rule, for every path (the engine's runner and ``generate``).

    logits (k + 1, V): the target at the last token and at each of the k drafts; q (k, V): the
    proposer's distributions, or None for one-hot drafts (prompt lookup; a greedy draft model).
    Returns (the kept drafts followed by one more token, the number kept).

    Greedy: a draft is kept while it is the argmax; the extra token is the argmax after them.
    Sampling: ``rejection_sample`` with p from ``target_probs`` per row — the history grows by the
    drafts before each row (it feeds the repetition penalty; rows past a rejection are not read).
    The tokens have exactly the target's distribution.
    """
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"need k+1={k + 1} rows of logits for {k} drafts, got {logits.shape[0]}")
    logits = logits.float().cpu()
    if params.greedy and params.repetition_penalty == 1.0:
        check_logits(logits)
        best = logits.argmax(dim=-1).tolist()
        emitted: list[int] = []
        for i, d in enumerate(drafts):
            if best[i] != d:
                break
            emitted.append(int(d))
        emitted.append(best[len(emitted)])  # the correction, or the bonus token after k kept
        return emitted, len(emitted) - 1
    history = list(history)
    p = torch.stack(
        [target_probs(logits[i], params, history + list(drafts[:i])) for i in range(k + 1)]
    )  # (k+1, V)
    if q is None:  # one-hot on each draft
        q = torch.zeros(k, p.shape[-1])
        q[torch.arange(k), torch.as_tensor(list(drafts), dtype=torch.long)] = 1.0
    return rejection_sample(p, q, drafts, generator)


@dataclass
class SpeculativeStats:
    target_forwards: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(1, self.proposed)

    @property
    def tokens_per_target_forward(self) -> float:
        return self.emitted / max(1, self.target_forwards)

    def record(self, proposed: int, accepted: int) -> None:
        self.target_forwards += 1
        self.proposed += proposed
        self.accepted += accepted


class PromptLookup:
    """Prompt-lookup speculation (``ngram_propose``): drafts copied from earlier in the sequence,
    one-hot, so acceptance is p(draft). The engine's scheduler asks ``propose`` within its token
    budget; ``generate`` drives the same object through ``start`` / ``draft`` / ``rollback``."""

    def __init__(self, num_speculative_tokens: int, ngram: tuple[int, int] = (3, 1)):
        if as_integer("num_speculative_tokens", num_speculative_tokens) < 0:
            raise ValueError(
                f"num_speculative_tokens={num_speculative_tokens} must be >= 0 (0 = off)"
            )
        if not 1 <= ngram[1] <= ngram[0]:
            raise ValueError(
                f"ngram={ngram} must be (largest, smallest) n-gram sizes with 1 <= smallest <= largest"
            )
        self.k, self.ngram = num_speculative_tokens, ngram
        self.stats = SpeculativeStats()

    def propose(self, tokens: Sequence[int], room: int) -> list[int]:
        """At most min(k, room) drafts continuing ``tokens``; room: what the budget and limits allow."""
        k = min(self.k, room)
        return ngram_propose(tokens, k, *self.ngram) if k > 0 else []

    def propose_batch(self, items) -> None:
        """The engine's proposer protocol (as ``DraftRunner``): items (sequence, room) get
        ``seq.drafts`` (one-hot: ``seq.draft_probs`` None)."""
        for seq, room in items:
            seq.drafts, seq.draft_probs = self.propose(seq.all_ids, room), None

    def release(self, rid: str) -> None:
        pass  # nothing kept per sequence

    def start(self, target: nn.Module, max_seq_len: int) -> None:
        self.stats = SpeculativeStats()

    def draft(
        self, tokens: list[int], room: int, params: SamplingParams, generator: torch.Generator
    ) -> tuple[list[int], Tensor | None]:
        return self.propose(tokens, room), None  # q one-hot

    def rollback(self, length: int) -> None:
        pass


class DraftModel:
    """Draft-model speculation: a smaller model q (or ``truncated_draft``) samples k drafts with the
    request's ``SamplingParams``, keeping its own KV cache, rolled back to what the target kept."""

    def __init__(self, draft: Transformer, num_speculative_tokens: int = 4):
        if as_integer("num_speculative_tokens", num_speculative_tokens) < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1")
        self.model, self.k = draft, num_speculative_tokens
        self.stats = SpeculativeStats()

    def start(self, target: Transformer, max_seq_len: int) -> None:
        if self.model.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft vocab_size={self.model.config.vocab_size} != target vocab_size="
                f"{target.config.vocab_size}"
            )
        p = next(self.model.parameters())
        self.cache = KVCache(self.model.config, 1, max_seq_len, dtype=p.dtype, device=p.device)
        self.done = 0  # tokens whose K/V the draft has cached
        self.stats = SpeculativeStats()

    def _run(
        self, ids: list[int]
    ) -> Tensor:  # feed ids, cached from self.done on; logits of the last (V,)
        device = self.cache.k.device
        pos = torch.arange(self.done, self.done + len(ids), device=device)
        self.done += len(ids)
        return self.model(torch.tensor([ids], device=device), pos, kv_cache=self.cache, last_n=1)[
            0, -1
        ]

    def draft(
        self, tokens: list[int], room: int, params: SamplingParams, generator: torch.Generator
    ) -> tuple[list[int], Tensor | None]:
        k = min(self.k, room)
        if k <= 0:
            return [], None
        logits = self._run(tokens[self.done :])
        drafts: list[int] = []
        q_rows: list[Tensor] = []
        for j in range(k):
            q = target_probs(logits.float().cpu(), params, tokens + drafts)  # (V,)
            drafts.append(int(torch.multinomial(q, 1, generator=generator)))
            q_rows.append(q)
            if j < k - 1:
                logits = self._run(drafts[-1:])
        return drafts, torch.stack(q_rows)  # (k,), (k, V)

    def rollback(self, length: int) -> None:
        self.done = min(self.done, length)
        self.cache.truncate(self.done)
