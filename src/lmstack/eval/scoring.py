"""Log-probabilities of token rows under a model: the one primitive every evaluation here uses.

Seed 000 (perplexity = exp of the mean cross-entropy) and seed 001 "基准测试" (log-likelihood
scoring of options and continuations). ``score_rows`` runs the model's own forward
(``Transformer.forward(tokens, return_hidden=True)`` then ``unembed``) over right-padded batches
of rows; causal attention means a row's padding never reaches its real positions. The logits are
formed a chunk of positions at a time, so a long window never holds a (S, V) tensor per row at once.

``encode_pair`` splits a (context, continuation) pair into token ids the way lm-evaluation-harness
does: trailing spaces of the context move to the continuation, the whole string is encoded, and the
continuation is what follows the context's own encoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowScore:
    """log p(row[j] | row[:j]) for the scored positions j (in order), and whether each was the argmax."""

    logprobs: torch.Tensor  # (n,) float64
    greedy: torch.Tensor  # (n,) bool


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def score_rows(model, rows: list[list[int]], starts: list[int], max_batch_tokens: int = 8192,
               chunk_positions: int = 512) -> list[RowScore]:
    """Score each row's positions ``start .. len(row)-1`` (``start`` >= 1: position 0 has no context). The
    model sees each row without its last token, so a row may be one token longer than the context.

    Rows are grouped longest first into batches of at most ``max_batch_tokens`` padded tokens.
    """
    if len(rows) != len(starts):
        raise ValueError(f"{len(rows)} rows but {len(starts)} starts")
    for i, (r, s) in enumerate(zip(rows, starts)):
        if not (1 <= s <= len(r)):
            raise ValueError(f"row {i}: start={s} must be in 1..{len(r)} (the row has {len(r)} tokens)")
    device = _device(model)
    out: list[RowScore | None] = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    i = 0
    while i < len(order):
        T = len(rows[order[i]])
        B = max(1, min(len(order) - i, max_batch_tokens // max(T, 1)))
        batch = order[i:i + B]
        i += B
        tokens = torch.zeros(len(batch), T, dtype=torch.long)
        for b, k in enumerate(batch):
            tokens[b, :len(rows[k])] = torch.tensor(rows[k], dtype=torch.long)
        tokens = tokens.to(device)
        if T == 1:  # rows of one token have nothing to score (start == 1 == len)
            for k in batch:
                out[k] = RowScore(torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.bool))
            continue
        # the last token is only a target: the inputs are the first T-1 (a row of max_length + 1 fits the context)
        hidden = model(tokens[:, :T - 1], return_hidden=True)  # (B, T-1, D)
        # every scored position of the batch in one (P, D) matrix: the unembedding (V, D) is read once per
        # chunk of positions, not once per row; logits at j-1 predict token j
        bi = torch.cat([torch.full((len(rows[k]) - starts[k],), b) for b, k in enumerate(batch)]).to(device)
        pj = torch.cat([torch.arange(starts[k] - 1, len(rows[k]) - 1) for k in batch]).to(device)
        target = tokens[bi, pj + 1]  # (P,)
        lps, gr = [], []
        for c0 in range(0, len(pj), chunk_positions):
            logits = model.unembed(hidden[bi[c0:c0 + chunk_positions], pj[c0:c0 + chunk_positions]]).float()  # (c, V)
            t = target[c0:c0 + chunk_positions]
            lp = logits.gather(-1, t[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)  # log softmax at t only
            lps.append(lp.double().cpu())
            gr.append((logits.argmax(-1) == t).cpu())
        lp, g = (torch.cat(lps), torch.cat(gr)) if lps else (torch.zeros(0, dtype=torch.float64),
                                                              torch.zeros(0, dtype=torch.bool))
        o = 0
        for k in batch:
            n = len(rows[k]) - starts[k]
            out[k] = RowScore(lp[o:o + n], g[o:o + n])
            o += n
    return out  # type: ignore[return-value]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's HF model splits them: encode the whole, then split."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return whole[:len(ctx)], whole[len(ctx):]


def prefix_token_id(model, tokenizer) -> int:
    """The token an empty context starts from (lm-eval: BOS if the model has one, else EOS)."""
    c = model.config
    for t in (c.bos_token_id, c.eos_token_id, getattr(tokenizer, "eos_token_id", None)):
        if t is not None:
            return int(t)
    raise ValueError("an empty context needs a BOS or EOS token, and neither the model config nor the tokenizer has one")


def loglikelihoods(model, requests: list[tuple[list[int], list[int]]], max_length: int | None = None,
                   prefix_id: int | None = None, **kw) -> list[tuple[float, bool]]:
    """(sum log p(continuation | context), continuation is the greedy one) per (context ids, continuation ids).

    As lm-eval: an empty context becomes [prefix_id]; the row is (context + continuation) cut to its
    last ``max_length + 1`` tokens, fed without its last token."""
    max_length = max_length or model.config.max_seq_len
    rows, starts = [], []
    for i, (ctx, cont) in enumerate(requests):
        if not cont:
            raise ValueError(f"request {i}: the continuation has no tokens")
        if len(cont) > max_length:
            raise ValueError(f"request {i}: continuation of {len(cont)} tokens exceeds the context {max_length}")
        if not ctx:
            if prefix_id is None:
                raise ValueError(f"request {i}: empty context and no prefix token")
            ctx = [prefix_id]
        row = (list(ctx) + list(cont))[-(max_length + 1):]
        rows.append(row)
        starts.append(len(row) - len(cont))
    scores = score_rows(model, rows, starts, **kw)
    return [(float(s.logprobs.sum()), bool(s.greedy.all())) for s in scores]
