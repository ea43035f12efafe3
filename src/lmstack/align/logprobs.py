"""Per-token log-probabilities of a batch under a model — the one forward every post-training loss starts from.

``batch_logprobs(model, batch)`` runs ``model(x, positions, document_ids)`` (packing-aware) and gathers
log π(y_t | x_≤t) at the targets (0 where the target is ignored); ``sequence_logprobs`` sums them over each
row's response tokens (DPO's log π(y|x)).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmstack.align.losses import token_entropy, token_logprobs
from lmstack.train.data import Batch
from lmstack.train.losses import IGNORE_INDEX


def batch_logprobs(model, batch: Batch, entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """(log-probs (B, S), per-token entropy (B, S) or None) of ``batch.y`` given ``batch.x``; 0 where ignored.

    Only the M positions with a target are unembedded: the model returns its final-normed hidden states
    (B, S, D), the M rows are picked and turned into (M, V) logits — a prompt's positions never cost a
    V-wide row (on a 60-token prompt with a 30-token answer that is two thirds of the logits saved)."""
    keep = batch.y != IGNORE_INDEX  # (B, S)
    h = model(
        batch.x, positions=batch.positions, document_ids=batch.document_ids, return_hidden=True
    )  # (B, S, D)
    # a gradient-averaging wrapper (DDP) holds the model as ``.module``: the unembedding is the model's
    logits = getattr(model, "module", model).unembed(h[keep])  # (M, V)
    logp = torch.zeros(batch.y.shape, dtype=torch.float32, device=h.device)
    logp = logp.masked_scatter(keep, token_logprobs(logits, batch.y[keep]))
    ent = None
    if entropy:
        ent = torch.zeros_like(logp).masked_scatter(keep, token_entropy(logits.detach()))
    return logp, ent


def sequence_logprobs(model, batch: Batch) -> Tensor:
    """Σ_t log π(y_t | ·) over each row's response tokens: (B,)."""
    logp, _ = batch_logprobs(model, batch)
    return logp.sum(-1)


@torch.no_grad()
def reference_logprobs(model, batch: Batch) -> Tensor:
    """``batch_logprobs`` of a frozen model (no graph kept): (B, S)."""
    return batch_logprobs(model, batch)[0]
