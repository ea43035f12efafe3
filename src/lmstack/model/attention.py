"""Causal self-attention with MHA / GQA / MQA, sliding window, QK-norm and q/k/v bias.

Book of LLMs §1.2 (projections, reshape to heads, GQA expansion, RoPE, scaled scores, causal mask,
softmax, output projection), §1.3 (masked_fill with True = may attend), §1.9 (sliding window);
CS336 notes "注意力机制", "训练稳定性" (QK-norm).

``Attention`` computes q, k, v and hands them to one implementation through the seam
(``lmstack.model.seam``): ``impl(q, k, v, meta)``, or ``meta.cache.attend(layer, q, k, v, meta, impl)``
with a KV cache. Which implementation runs is set once by whoever builds the model
(``Transformer.set_attention``); the module never chooses per call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lmstack.model.config import ModelConfig
from lmstack.model.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    fuse_linears,
    fused_linear,
    still_fused,
)
from lmstack.model.seam import (
    DEFAULT_ATTENTION,
    AttentionImpl,
    AttentionMetadata,
    attention_mask,
    reference_attention,
)

__all__ = ["Attention", "attention_mask", "reference_attention"]


class Attention(nn.Module):
    """Multi-head attention with K ≤ N kv heads (MHA when K = N, GQA when 1 < K < N, MQA when K = 1)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int = 0,
        rope: RotaryEmbedding | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        c = config
        assert (
            c.head_dim is not None and c.n_kv_heads is not None
        )  # resolved by ModelConfig.__post_init__
        self.layer_idx = layer_idx
        self.head_dim = (
            c.head_dim
        )  # H; N and K are read from the projections (a tp shard holds N/tp, K/tp)
        self.impl: AttentionImpl = DEFAULT_ATTENTION  # set by Transformer.set_attention
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        self.q_proj = Linear(
            c.d_model, c.n_heads * c.head_dim, bias=c.qkv_bias, **kw
        )  # W_Q (N·H, D)
        self.k_proj = Linear(
            c.d_model, c.n_kv_heads * c.head_dim, bias=c.qkv_bias, **kw
        )  # W_K (K·H, D)
        self.v_proj = Linear(
            c.d_model, c.n_kv_heads * c.head_dim, bias=c.qkv_bias, **kw
        )  # W_V (K·H, D)
        self.o_proj = Linear(c.n_heads * c.head_dim, c.d_model, bias=False, **kw)  # W_O (D, N·H)
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.norm_eps, **kw)
            self.k_norm = RMSNorm(c.head_dim, c.norm_eps, **kw)
        else:
            self.q_norm = self.k_norm = None
        # fused [W_Q; W_K; W_V] (or the fused quantised module), bias, widths (``fuse``)
        self.qkv: tuple[Tensor | nn.Module, Tensor | None, list[int]] | None = None
        # Shared across layers when the Transformer passes one in; not a submodule then.
        self._rope = [
            rope
            if rope is not None
            else RotaryEmbedding(c.head_dim, c.max_seq_len, c.rope_theta, c.rope_layout)
        ]

    @property
    def rope(self) -> RotaryEmbedding:
        return self._rope[0]

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, D) -> q (B, N, T, H), k, v (B, K, T, H) before RoPE (projections, per-head QK-norm).
        A variant attention (OLMoE's, ``model.olmoe``) overrides only this."""
        B, T, _ = x.shape
        H = self.head_dim
        if self.qkv is not None and not still_fused(
            [self.q_proj, self.k_proj, self.v_proj], self.qkv[0]
        ):
            self.qkv = None  # a parameter was replaced: back to the separate projections
        if (
            self.qkv is not None and not torch.is_grad_enabled()
        ):  # one GEMM for the three projections; with
            # autograd on, the separate ones: the fused weight is no parameter, so gradients would miss q/k/v
            w, b, widths = self.qkv
            q, k, v = (
                t.reshape(B, T, -1, H).transpose(1, 2)
                for t in fused_linear(x, w, b, [self.q_proj, self.k_proj, self.v_proj]).split(
                    widths, dim=-1
                )
            )
        else:
            q = self.q_proj(x).view(B, T, -1, H).transpose(1, 2)  # (B, N, T, H)
            k = self.k_proj(x).view(B, T, -1, H).transpose(1, 2)  # (B, K, T, H)
            v = self.v_proj(x).view(B, T, -1, H).transpose(1, 2)  # (B, K, T, H)
        if self.q_norm is not None and self.k_norm is not None:  # set together
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def fuse(self) -> bool:
        """Compute q, k, v with one GEMM from now on (``fuse_linears``: the projections' weights become views
        of one (N·H + 2·K·H, D) weight); False where they cannot be fused or a subclass projects otherwise."""
        if self.qkv is None and type(self).project is Attention.project:
            linears = [self.q_proj, self.k_proj, self.v_proj]
            fused = fuse_linears(linears)
            if fused is not None:
                self.qkv = (*fused, [int(m.out_features) for m in linears])
        return self.qkv is not None

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        """x: (B, T, D); ``meta``: this forward's positions, documents, window, cache. -> (B, T, D)
        The head counts N and K follow from the projections' output widths (N·H, K·H), so a
        model whose projections hold a subset of the heads runs unchanged."""
        B, T, _ = x.shape
        q, k, v = self.project(x)  # (B, N, T, H), (B, K, T, H) x2
        q, k = (
            self.rope.rotate(q, meta.positions),
            self.rope.rotate(k, meta.positions),
        )  # RoPE on q and k, never v;
        # the positions were covered once for all layers (Transformer.forward)
        if meta.cache is not None:
            out = meta.cache.attend(
                self.layer_idx, q, k, v, meta, self.impl
            )  # store K/V, then attend
        else:
            out = self.impl(q, k, v, meta)  # (B, N, T, H)
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, N·H)
        return self.o_proj(out)
