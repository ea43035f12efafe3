"""OpenAI's presence and frequency penalties and ``logit_bias`` as engine logits processors.

Book of LLMs §2.6 (sampling controls). The OpenAI API reference defines them on the counts c[j] of
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


class LogitBias:
    """OpenAI's ``logit_bias``: a map token id -> bias in [-100, 100] added to that token's logit before sampling
    (-100 bans the token in practice, +100 forces it)."""

    def __init__(self, bias: dict[int, float]):
        self.ids = torch.tensor(sorted(bias), dtype=torch.long)
        self.values = torch.tensor([float(bias[i]) for i in sorted(bias)])

    def __call__(self, output_ids: list[int], logits: Tensor) -> Tensor:
        out = logits.clone()
        out[self.ids.to(logits.device)] += self.values.to(device=logits.device, dtype=logits.dtype)
        return out
