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


def batch_logprobs(model, batch: Batch, entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """(log-probs (B, S), per-token entropy (B, S) or None) of ``batch.y`` given ``batch.x``."""
    logits = model(batch.x, positions=batch.positions, document_ids=batch.document_ids)  # (B, S, V)
    logp = token_logprobs(logits, batch.y)
    ent = token_entropy(logits.detach()) if entropy else None
    return logp, ent


def sequence_logprobs(model, batch: Batch) -> Tensor:
    """Σ_t log π(y_t | ·) over each row's response tokens: (B,)."""
    logp, _ = batch_logprobs(model, batch)
    return logp.sum(-1)


@torch.no_grad()
def reference_logprobs(model, batch: Batch) -> Tensor:
    """``batch_logprobs`` of a frozen model (no graph kept): (B, S)."""
    return batch_logprobs(model, batch)[0]
