"""Linear attention: softmax(QKᵀ)V replaced by φ(Q)(φ(K)ᵀV), with an optional normaliser.

CS336 notes "注意力机制": the batch form Q(KᵀV) costs O(S·H²) instead of O(S²·H), and the same
computation is the recurrence S_t = S_{t−1} + φ(k_t) v_tᵀ, y_t = φ(q_t)ᵀ S_t — a constant-size state
for decode. Normalised (``linear_normalize``, Katharopoulos et al. 2020) it divides by φ(q_t)·Σ_{j≤t} φ(k_j),
carried as one extra value column of ones, so the state is (N, H, H + 1).
Forms: ``model.linear_scan.decay_chunked`` (training/prefill), ``decay_recurrent`` (decode).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lmstack.model.config import ModelConfig
from lmstack.model.layers import Linear
from lmstack.model.linear_scan import decay_chunked, decay_recurrent
from lmstack.model.recurrent import RecurrentMixer

FEATURE_MAPS = {"identity": lambda x: x, "elu1": lambda x: F.elu(x) + 1.0, "relu": F.relu}


class LinearAttention(RecurrentMixer):
    """N heads of head dim H; q, k, v, o projections as in softmax attention (no RoPE: order comes from causality)."""

    kind = "linear_attention"

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int = 0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        c = config
        assert c.head_dim is not None  # resolved by ModelConfig.__post_init__
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        self.layer_idx, self.head_dim, self.chunk_size = layer_idx, c.head_dim, c.mixer_chunk_size
        self.feature_map, self.normalize, self.eps = c.linear_feature_map, c.linear_normalize, 1e-6
        self.q_proj = Linear(c.d_model, c.n_heads * c.head_dim, **kw)  # (N·H, D)
        self.k_proj = Linear(c.d_model, c.n_heads * c.head_dim, **kw)
        self.v_proj = Linear(c.d_model, c.n_heads * c.head_dim, **kw)
        self.o_proj = Linear(c.n_heads * c.head_dim, c.d_model, **kw)  # (D, N·H)

    def mix(self, x: Tensor, state: tuple[Tensor] | None) -> tuple[Tensor, tuple[Tensor]]:
        """x (B, T, D), state (S (B, N, H, H [+1]),) or None -> (B, T, D), new state."""
        B, T, _ = x.shape
        H = self.head_dim
        phi = FEATURE_MAPS[self.feature_map]
        q = phi(self.q_proj(x).view(B, T, -1, H).transpose(1, 2))  # (B, N, T, H)
        k = phi(self.k_proj(x).view(B, T, -1, H).transpose(1, 2))
        v = self.v_proj(x).view(B, T, -1, H).transpose(1, 2)
        if self.normalize:
            v = torch.cat(
                [v, torch.ones_like(v[..., :1])], dim=-1
            )  # last column accumulates φ(q)·Σφ(k)
        else:
            q = q * H**-0.5
        s0 = None if state is None else state[0]
        if s0 is not None and T == 1:
            y, s = decay_recurrent(q, k, v, None, state=s0)
        else:
            y, s = decay_chunked(q, k, v, None, chunk_size=self.chunk_size, state=s0)
        if self.normalize:
            y = y[..., :-1] / (y[..., -1:] + self.eps)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1)), (s,)
