"""OLMoE's attention: the Llama attention with QK-norm over all heads at once and optional q/k/v clipping.

CS336 notes "训练稳定性" (QK-norm, here as OLMoE applies it: one RMSNorm over the N·H query features and one
over the K·H key features, before the split into heads; ``clip_qkv`` clamps q, k, v to ±clip).
Everything else — GQA, RoPE, the attention seam, caches — is ``model.attention.Attention``'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lmstack.model.attention import Attention
from lmstack.model.config import ModelConfig
from lmstack.model.layers import RMSNorm, RotaryEmbedding


class OlmoeAttention(Attention):
    """``Attention`` with ``q_norm`` (N·H,) / ``k_norm`` (K·H,) over whole projections and ``qkv_clip``."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int = 0,
        rope: RotaryEmbedding | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(config.replace(qk_norm=False), layer_idx, rope, device=device, dtype=dtype)
        c = config
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        self.clip = c.qkv_clip
        assert (
            c.head_dim is not None and c.n_kv_heads is not None
        )  # resolved by ModelConfig.__post_init__
        if c.qk_norm_full:
            self.q_norm = RMSNorm(c.n_heads * c.head_dim, c.norm_eps, **kw)
            self.k_norm = RMSNorm(c.n_kv_heads * c.head_dim, c.norm_eps, **kw)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # (B, T, D) -> (B, N|K, T, H) x3
        B, T, _ = x.shape
        H = self.head_dim
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, T, N·H), (B, T, K·H) x2
        if self.q_norm is not None and self.k_norm is not None:  # set together
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        return tuple(t.view(B, T, -1, H).transpose(1, 2) for t in (q, k, v))
