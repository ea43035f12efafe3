"""OpenAI's presence and frequency penalties as an engine logits processor.

Seed 000 §2.6 (sampling controls). The OpenAI API reference defines them on the counts c[j] of
each token j in the output so far: ``logit[j] -= c[j] · frequency_penalty + [c[j] > 0] · presence_penalty``
(the prompt does not count, unlike the CTRL repetition penalty in ``inference.sampling``).
"""

from __future__ import annotations

import torch
from torch import Tensor


class Penalties:
    """``(output ids, logits (V,)) -> logits (V,)`` with the two penalties applied."""

    def __init__(self, presence: float = 0.0, frequency: float = 0.0):
        self.presence, self.frequency = float(presence), float(frequency)

    def __call__(self, output_ids: list[int], logits: Tensor) -> Tensor:
        if not output_ids:
            return logits
        V = logits.shape[-1]
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=V)[:V]  # (V,)
        counts = counts.to(device=logits.device, dtype=logits.dtype)
        return logits - self.frequency * counts - self.presence * (counts > 0).to(logits.dtype)
