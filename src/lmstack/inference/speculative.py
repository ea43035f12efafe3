"""Speculative decoding: a cheap proposer guesses k tokens, the target checks them in one pass.

Seed 000 §2.3 and seed 001 "无损提速". The target p scores the k drafted tokens x_1..x_k in a
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

The expected acceptance rate is α = Σ_x min(p(x), q(x)) (seed 001); ``SpeculativeStats``
reports the measured rate and the tokens produced per target forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lmstack.inference.kv_cache import KVCache
from lmstack.inference.prompts import prompt_token_ids
from lmstack.inference.sampling import SamplingParams, target_probs
from lmstack.model.transformer import Transformer


def truncated_draft(model: nn.Module, n_layers: int) -> nn.Module:
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
        suffix = list(tokens[L - n:])
        for start in range(L - n - 1, -1, -1):  # latest earlier occurrence first
            if list(tokens[start:start + n]) == suffix:
                follow = list(tokens[start + n:start + n + k])
                if follow:
                    return follow
    return []


def rejection_sample(p: Tensor, q: Tensor, draft: Sequence[int], generator: torch.Generator | None = None
                     ) -> tuple[list[int], int]:
    """Seed 000 §2.3 accept/reject. p (k+1, V) target, q (k, V) proposer, draft: k token ids.

    Returns (emitted tokens, number of accepted drafts): the accepted drafts followed by one
    token — the residual sample at the first rejection, or the bonus token from p[k].
    """
    k = len(draft)
    if p.shape[0] != k + 1 or q.shape[0] != k:
        raise ValueError(f"need p with k+1={k + 1} rows and q with k={k} rows, got {tuple(p.shape)} and {tuple(q.shape)}")
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


def verify_drafts(logits: Tensor, drafts: Sequence[int], params: SamplingParams, history: Sequence[int],
                  generator: torch.Generator | None = None) -> list[int]:
    """Verify one-hot (prompt-lookup) drafts against the target: logits (k + 1, V) at the last
    token and at each draft. Returns the kept drafts followed by one more token.

    Greedy: a draft is kept while it is the argmax; the extra token is the argmax after them.
    Sampling: the accept/reject rule with q one-hot on the draft d — keep d with probability
    p(d), else draw from max(0, p − q) renormalised, i.e. p with d removed; after k kept drafts
    a bonus token comes from the last row. The tokens have exactly the target's distribution.
    ``history`` (the tokens before the drafts) feeds the repetition penalty.
    """
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"need k+1={len(drafts) + 1} rows of logits for {len(drafts)} drafts, got {logits.shape[0]}")
    emitted: list[int] = []
    if params.greedy and params.repetition_penalty == 1.0:
        best = logits.argmax(dim=-1).tolist()
        for i, d in enumerate(drafts):
            if best[i] != d:
                break
            emitted.append(int(d))
        emitted.append(best[len(emitted)])  # the correction, or the bonus token after k kept
        return emitted
    # the one-hot case of rejection_sample: p for every position (history grows by the drafts before
    # it; past a rejection the rows are not read), q one-hot on each draft
    history = list(history)
    p = torch.stack([target_probs(logits[i], params, history + list(drafts[:i])) for i in range(len(drafts) + 1)])
    q = torch.zeros(len(drafts), p.shape[-1])
    q[torch.arange(len(drafts)), torch.as_tensor(list(drafts), dtype=torch.long)] = 1.0
    return rejection_sample(p, q, drafts, generator)[0]


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


def _probs(logits: Tensor, params: SamplingParams, history: list[int]) -> Tensor:
    return target_probs(logits.float().cpu(), params, history if params.repetition_penalty != 1.0 else None)


@torch.inference_mode()
def speculative_generate(target: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                         params: SamplingParams | None = None, draft: nn.Module | None = None,
                         num_speculative_tokens: int = 4, ngram: tuple[int, int] = (3, 1),
                         stop_ids: Sequence[int] = (), seed: int = 0) -> tuple[list[int], SpeculativeStats]:
    """Generate up to ``max_new_tokens`` for one prompt with speculation; returns (tokens, stats).

    With ``draft`` the proposals come from the draft model (sampled from q with the same
    SamplingParams); without it from prompt lookup with n in ``ngram`` = (max_n, min_n).
    """
    params = params or SamplingParams(temperature=0.0)
    k_max = num_speculative_tokens
    if k_max < 1:
        raise ValueError(f"num_speculative_tokens={k_max} must be >= 1")
    prompt_ids = prompt_token_ids(prompt_ids, target.config.vocab_size, name="prompt_ids")  # as every path
    p0 = next(target.parameters())
    device, dtype = p0.device, p0.dtype
    total = len(prompt_ids) + max_new_tokens + k_max + 1
    if total > target.config.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) + k+1 ({k_max + 1}) "
                         f"exceeds max_seq_len={target.config.max_seq_len}")
    if draft is not None and draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft vocab_size={draft.config.vocab_size} != target vocab_size={target.config.vocab_size}")
    gen = torch.Generator().manual_seed(params.seed if params.seed is not None else seed)
    t_cache = KVCache(target.config, 1, total, dtype=dtype, device=device)
    d_cache = KVCache(draft.config, 1, total, dtype=next(draft.parameters()).dtype, device=device) if draft else None
    tokens = list(prompt_ids)
    n_prompt = len(tokens)
    t_done = d_done = 0  # tokens whose K/V each model has cached
    stats = SpeculativeStats()
    stop = set(stop_ids)

    def run(model, cache, start, new):  # feed tokens[start:] + new, return logits for every fed token
        ids = torch.tensor([new], device=device)
        pos = torch.arange(start, start + len(new), device=device)
        return model(ids, pos, kv_cache=cache)[0]  # (T, V)

    while len(tokens) - n_prompt < max_new_tokens:
        room = max_new_tokens - (len(tokens) - n_prompt)
        k = min(k_max, room - 1) if room > 1 else 0
        # ---- propose
        drafts: list[int] = []
        q_rows: list[Tensor] = []
        if k > 0 and draft is not None:
            logits = run(draft, d_cache, d_done, tokens[d_done:])[-1]
            d_done = len(tokens)
            for j in range(k):
                q = _probs(logits, params, tokens + drafts)
                x = int(torch.multinomial(q, 1, generator=gen))
                drafts.append(x)
                q_rows.append(q)
                if j < k - 1:
                    logits = run(draft, d_cache, d_done, [x])[-1]
                    d_done += 1
        elif k > 0:
            drafts = ngram_propose(tokens, k, *ngram)
            for x in drafts:
                q_rows.append(torch.zeros(target.config.vocab_size).index_fill_(0, torch.tensor(x), 1.0))
        # ---- verify: one target forward over the pending tokens and the drafts
        fed = tokens[t_done:] + drafts
        logits = run(target, t_cache, t_done, fed)[-(len(drafts) + 1):]  # (k+1, V)
        stats.target_forwards += 1
        history = list(tokens)
        p_rows = []
        for j in range(len(drafts) + 1):
            p_rows.append(_probs(logits[j], params, history))
            if j < len(drafts):
                history.append(drafts[j])
        p = torch.stack(p_rows)
        q = torch.stack(q_rows) if q_rows else torch.zeros(0, target.config.vocab_size)
        emitted, n_acc = rejection_sample(p, q, drafts, gen)
        stats.proposed += len(drafts)
        stats.accepted += n_acc
        # ---- roll back: the target keeps the accepted drafts, the draft model what it had right
        base = len(tokens)
        t_done = base + n_acc
        t_cache.truncate(t_done)
        if d_cache is not None:
            d_done = min(d_done, t_done)
            d_cache.truncate(d_done)
        for x in emitted:
            tokens.append(x)
            stats.emitted += 1
            if x in stop or len(tokens) - n_prompt >= max_new_tokens:
                return tokens[n_prompt:], stats
    return tokens[n_prompt:], stats
