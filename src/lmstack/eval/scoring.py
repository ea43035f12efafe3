"""Log-probabilities of token rows under a model: the one primitive every evaluation here uses.

Book of LLMs (perplexity = exp of the mean cross-entropy) and CS336 notes "基准测试" (log-likelihood
scoring of options and continuations). ``score_rows`` runs the model's own forward
(``Transformer.forward(tokens, return_hidden=True)`` then ``unembed``) over right-padded batches
of rows; causal attention means a row's padding never reaches its real positions. The logits are
formed a chunk of positions at a time, so a long window never holds a (S, V) tensor per row at once.

Requests that share a context (a multiple-choice item's options) run that context once: ``shared_context_scores``
prefills it into a KV cache and scores every option's continuation from copies of that cache, instead of running
the context once per option as a plain row would.

``encode_pair`` splits a (context, continuation) pair into token ids the way lm-evaluation-harness
does: trailing spaces of the context move to the continuation, the whole string is encoded, and the
continuation is what follows the context's own encoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmstack.model.config import ModelConfig
from lmstack.model.mixer_spec import layer_kinds


@dataclass
class RowScore:
    """log p(row[j] | row[:j]) for the scored positions j (in order), and whether each was the argmax."""

    logprobs: torch.Tensor  # (n,) float64
    greedy: torch.Tensor  # (n,) bool


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def score_rows(
    model,
    rows: list[list[int]],
    starts: list[int],
    max_batch_tokens: int = 8192,
    chunk_positions: int = 512,
) -> list[RowScore]:
    """Score each row's positions ``start .. len(row)-1`` (``start`` >= 1: position 0 has no context). The
    model sees each row without its last token, so a row may be one token longer than the context.

    Rows are grouped longest first into batches of at most ``max_batch_tokens`` padded tokens.
    """
    if len(rows) != len(starts):
        raise ValueError(f"{len(rows)} rows but {len(starts)} starts")
    for i, (r, s) in enumerate(zip(rows, starts)):
        if not (1 <= s <= len(r)):
            raise ValueError(
                f"row {i}: start={s} must be in 1..{len(r)} (the row has {len(r)} tokens)"
            )
    device = _device(model)
    out: list[RowScore | None] = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    i = 0
    while i < len(order):
        T = len(rows[order[i]])
        B = max(1, min(len(order) - i, max_batch_tokens // max(T, 1)))
        batch = order[i : i + B]
        i += B
        tokens = torch.zeros(len(batch), T, dtype=torch.long)
        for b, k in enumerate(batch):
            tokens[b, : len(rows[k])] = torch.tensor(rows[k], dtype=torch.long)
        tokens = tokens.to(device)
        if T == 1:  # rows of one token have nothing to score (start == 1 == len)
            for k in batch:
                out[k] = RowScore(
                    torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.bool)
                )
            continue
        # the last token is only a target: the inputs are the first T-1 (a row of max_length + 1 fits the context)
        hidden = model(tokens[:, : T - 1], return_hidden=True)  # (B, T-1, D)
        # every scored position of the batch in one (P, D) matrix: the unembedding (V, D) is read once per
        # chunk of positions, not once per row; logits at j-1 predict token j
        bi = torch.cat(
            [torch.full((len(rows[k]) - starts[k],), b) for b, k in enumerate(batch)]
        ).to(device)
        pj = torch.cat([torch.arange(starts[k] - 1, len(rows[k]) - 1) for k in batch]).to(device)
        score = _row_score(
            model, hidden[bi, pj], tokens[bi, pj + 1], chunk_positions
        )  # log softmax at the targets
        lp, g = score.logprobs, score.greedy
        o = 0
        for k in batch:
            n = len(rows[k]) - starts[k]
            out[k] = RowScore(lp[o : o + n], g[o : o + n])
            o += n
    return out  # type: ignore[return-value]


def _row_score(
    model, hidden: torch.Tensor, target: torch.Tensor, chunk_positions: int = 512
) -> RowScore:
    """hidden (P, D) at the positions that predict target (P,) -> their log-probabilities and greedy flags; the
    (V, D) unembedding is applied a chunk of positions at a time, so no (P, V) logits are ever held at once."""
    lps, gr = [torch.zeros(0, dtype=torch.float64)], [torch.zeros(0, dtype=torch.bool)]
    for c0 in range(0, len(target), chunk_positions):
        logits = model.unembed(hidden[c0 : c0 + chunk_positions]).float()  # (c, V)
        t = target[c0 : c0 + chunk_positions]
        lps.append(
            (logits.gather(-1, t[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)).double().cpu()
        )
        gr.append((logits.argmax(-1) == t).cpu())
    return RowScore(torch.cat(lps), torch.cat(gr))


def can_share_context(model) -> bool:
    """Whether ``shared_context_scores`` applies: a softmax-attention model (no recurrent / local layers, no MLA
    latent cache) whose layers store K/V in ``inference.kv_cache.KVCache``."""
    c = getattr(model, "config", None)
    return isinstance(c, ModelConfig) and set(layer_kinds(c)) == {"attention"}  # model.mixer_spec


@torch.inference_mode()
def shared_context_scores(
    model,
    rows: list[list[int]],
    starts: list[int],
    groups: list[list[int]],
    max_batch_tokens: int = 8192,
) -> dict[int, RowScore]:
    """Score rows whose first ``starts[i]`` tokens (>= 2) are a context shared within each group of row indices:
    each group's context minus its last token is prefilled once into a KV cache row (groups batched, right-padded),
    the row is copied to one cache row per request, and every request's last context token + continuation (but
    its last token) is fed from there at its own positions, all requests of a batch in one forward."""
    from lmstack.inference.kv_cache import KVCache

    p = next(model.parameters())
    device = p.device
    out: dict[int, RowScore] = {}
    groups = sorted(groups, key=lambda g: -len(rows[g[0]]))
    i = 0
    while i < len(groups):  # batches of groups: about max_batch_tokens tokens of rows each
        batch, tokens_in = [], 0
        while i < len(groups) and (
            not batch or tokens_in + sum(len(rows[k]) for k in groups[i]) <= max_batch_tokens
        ):
            batch.append(groups[i])
            tokens_in += sum(len(rows[k]) for k in groups[i])
            i += 1
        members = [k for g in batch for k in g]
        n = {k: len(rows[k]) - starts[k] for k in members}  # scored tokens per request
        C = max(starts[g[0]] - 1 for g in batch)  # longest prefilled context
        S = max(starts[k] - 1 + n[k] for k in members)  # positions 0 .. S-1 are ever stored
        ctx = torch.zeros(len(batch), C, dtype=torch.long)
        for j, g in enumerate(batch):
            ctx[j, : starts[g[0]] - 1] = torch.tensor(
                rows[g[0]][: starts[g[0]] - 1], dtype=torch.long
            )
        cache = KVCache(model.config, len(batch), S, dtype=p.dtype, device=device)
        # right padding is harmless: a request's own tokens overwrite positions start-1 .., and the pad keys left
        # beyond them sit at positions later than any query of that row (causal by position)
        model(
            ctx.to(device),
            positions=torch.arange(C, device=device)[None].expand(len(batch), C),
            kv_cache=cache,
            return_hidden=True,
        )
        rows_of = torch.tensor(
            [j for j, g in enumerate(batch) for _ in g], device=device
        )  # (R,) group per request
        cache.k, cache.v = (
            cache.k.index_select(1, rows_of),
            cache.v.index_select(1, rows_of),
        )  # (L, R, K, S, H)
        cache.positions = cache.positions.index_select(0, rows_of)
        T = max(n.values())
        tokens = torch.zeros(len(members), T, dtype=torch.long)
        positions = torch.zeros(len(members), T, dtype=torch.long)
        for b, k in enumerate(members):
            tokens[b, : n[k]] = torch.tensor(rows[k][starts[k] - 1 : -1], dtype=torch.long)
            positions[b] = starts[k] - 1 + torch.arange(T)
        if (
            int(positions.max()) >= S
        ):  # pad positions of short requests may run past S: store them in a wider cache
            wider = KVCache(
                model.config, len(members), int(positions.max()) + 1, dtype=p.dtype, device=device
            )
            wider.k[..., :S, :], wider.v[..., :S, :] = cache.k, cache.v
            wider.positions[:, :S], wider.length = cache.positions, cache.length
            cache = wider
        hidden = model(
            tokens.to(device), positions=positions.to(device), kv_cache=cache, return_hidden=True
        )
        # (R, T, D): the first n[k] positions of row b predict request k's continuation; all of them in one
        # (P, D) matrix so the (V, D) unembedding is read once per batch, not once per request
        h = torch.cat([hidden[b, : n[k]] for b, k in enumerate(members)])
        target = torch.cat(
            [torch.tensor(rows[k][starts[k] :], dtype=torch.long) for k in members]
        ).to(device)
        score = _row_score(model, h, target)
        o = 0
        for k in members:
            out[k] = RowScore(score.logprobs[o : o + n[k]], score.greedy[o : o + n[k]])
            o += n[k]
    return out


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's HF model splits them: encode the whole, then split."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return whole[: len(ctx)], whole[len(ctx) :]


def prefix_token_id(model, tokenizer) -> int:
    """The token an empty context starts from (lm-eval: BOS if the model has one, else EOS)."""
    c = model.config
    for t in (c.bos_token_id, c.eos_token_id, getattr(tokenizer, "eos_token_id", None)):
        if t is not None:
            return int(t)
    raise ValueError(
        "an empty context needs a BOS or EOS token, and neither the model config nor the tokenizer has one"
    )


class RequestError(ValueError):
    """A (context, continuation) request that cannot be scored; ``index`` is its position in the list."""

    def __init__(self, index: int, reason: str):
        super().__init__(f"request {index}: {reason}")
        self.index, self.reason = index, reason


def loglikelihoods(
    model,
    requests: list[tuple[list[int], list[int]]],
    max_length: int | None = None,
    prefix_id: int | None = None,
    **kw,
) -> list[tuple[float, bool]]:
    """(sum log p(continuation | context), continuation is the greedy one) per (context ids, continuation ids).

    As lm-eval: an empty context becomes [prefix_id]; the row is (context + continuation) cut to its
    last ``max_length + 1`` tokens, fed without its last token."""
    max_length = max_length or model.config.max_seq_len
    rows, starts = [], []
    for i, (ctx, cont) in enumerate(requests):
        if not cont:
            raise RequestError(i, "the continuation has no tokens")
        if len(cont) > max_length:
            raise RequestError(
                i, f"the continuation of {len(cont)} tokens exceeds the context {max_length}"
            )
        if not ctx:
            if prefix_id is None:
                raise RequestError(i, "empty context and no prefix token")
            ctx = [prefix_id]
        row = (list(ctx) + list(cont))[-(max_length + 1) :]
        rows.append(row)
        starts.append(len(row) - len(cont))
    scores: list[RowScore | None] = [None] * len(rows)
    if can_share_context(model):  # a context shared by several requests (multiple choice) runs once
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (r, s) in enumerate(zip(rows, starts)):
            groups.setdefault(tuple(r[:s]), []).append(i)
        shared = [g for ctx, g in groups.items() if len(g) > 1 and len(ctx) >= 2]
        for i, sc in shared_context_scores(
            model, rows, starts, shared, kw.get("max_batch_tokens", 8192)
        ).items():
            scores[i] = sc
    rest = [i for i, s in enumerate(scores) if s is None]
    for i, sc in zip(
        rest, score_rows(model, [rows[i] for i in rest], [starts[i] for i in rest], **kw)
    ):
        scores[i] = sc
    return [(float(s.logprobs.sum()), bool(s.greedy.all())) for s in scores]
