"""Layer variants of the HF hybrid and interleaved local/global families: Gemma-2/3 and Qwen3-Next.

CS336 notes "注意力机制" (3:1 linear:full hybrids as in Qwen3-Next; gated attention output), "推理时注意力开销"
(Gemma's interleaved sliding-window : global layers), "归一化" (zero-centred RMSNorm), "激活函数" (GeGLU).
Each piece is switched on by a ``ModelConfig`` field whose default is the Llama block, so a model that sets none
of them is the plain Llama block:

- ``OffsetRMSNorm`` (``norm_offset``): y = norm(x)·(1 + w), w stored zero-centred (Gemma, Qwen3-Next);
- ``GeGLU`` (``ffn_act="gelu_tanh"``): W_down(gelu_tanh(x W_gate) ⊙ x W_up) (Gemma);
- ``VariantAttention``: softmax attention with any of a per-layer RoPE base (``local_rope_theta``, Gemma-3's
  local layers), linear RoPE scaling of the global layers (``rope_linear_factor``), partial RoPE (``rotary_dim``), the scale 1/√query_pre_attn_scalar (Gemma), attention-logit
  soft-capping s → cap·tanh(s/cap) (``attn_softcap``, Gemma-2: ``meta.softcap``, applied by an implementation that
  declares ``supports_softcap`` — the reference — and refused by name for one that does not) and a sigmoid output gate whose values come
  from a doubled q_proj, per head [q_h | gate_h] (``attn_output_gate``, Qwen3-Next).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lmstack.model.attention import Attention
from lmstack.model.config import ModelConfig
from lmstack.model.layers import Linear, RMSNorm, RotaryEmbedding, SwiGLU
from lmstack.model.seam import AttentionMetadata, ReferenceAttention

#: the config fields that make a softmax-attention layer a ``VariantAttention``
VARIANT_ATTENTION_FIELDS = (
    "attn_output_gate",
    "attn_softcap",
    "query_pre_attn_scalar",
    "local_rope_theta",
    "rotary_dim",
    "rope_linear_factor",
)


class OffsetRMSNorm(RMSNorm):
    """RMSNorm with γ = 1 + w (w is what checkpoints store; 0 is the identity scale), in fp32 then cast back."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(dim, eps, device=device, dtype=dtype)
        with torch.no_grad():
            self.weight.zero_()

    def reset_parameters(self) -> None:
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:  # (..., D) -> (..., D)
        if self.impl is not None:
            return self.impl(x, 1.0 + self.weight, self.eps)
        x32 = (
            x.float()
        )  # (x·γ) is cast, not x then ·γ (as HF Gemma / Qwen3-Next do): equal in fp32, not in bf16
        y = (
            x32
            * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            * (1.0 + self.weight.float())
        ).to(x.dtype)
        if torch.is_autocast_enabled(y.device.type):
            y = y.to(torch.get_autocast_dtype(y.device.type))
        return y


def make_norm(config: ModelConfig, dim: int, **kw) -> RMSNorm:
    """The model's RMSNorm over ``dim`` features: plain γ, or (1 + w) when ``config.norm_offset``."""
    return (OffsetRMSNorm if config.norm_offset else RMSNorm)(dim, config.norm_eps, **kw)


class GeGLU(SwiGLU):
    """FFN(x) = W_down (gelu_tanh(x W_gate) ⊙ x W_up): Gemma's gated FFN (HF ``gelu_pytorch_tanh``)."""

    def forward(self, x: Tensor) -> Tensor:  # (B, S, D) -> (B, S, D)
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def uses_variant_attention(config: ModelConfig) -> bool:
    return any(getattr(config, f) not in (None, False) for f in VARIANT_ATTENTION_FIELDS) or (
        config.qk_norm and config.norm_offset
    )


class LinearScaledRotary(RotaryEmbedding):
    """RoPE with linear position scaling: angle m·θ_i / factor (HF ``rope_type="linear"``, Gemma-3's global layers)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, layout: str, factor: float):
        super().__init__(head_dim, max_seq_len, theta, layout)
        self.factor = self.position_scale = factor


class VariantAttention(Attention):
    """Softmax attention (GQA, KV cache through the seam) with the Gemma / Qwen3-Next variations listed in the
    module docstring. A ``local_attention`` layer uses ``config.local_window`` as its window (and
    ``local_rope_theta`` as its RoPE base when set); other layers use the model's window (None for these families)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int = 0,
        rope: RotaryEmbedding | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(config, layer_idx, rope, device=device, dtype=dtype)
        c = config
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        H = c.head_dim
        assert H is not None  # resolved by ModelConfig.__post_init__
        self.local = c.mixer_types[layer_idx] == "local_attention"
        self.window = c.local_window if self.local else None
        self.gate = c.attn_output_gate
        if self.gate:  # per head [q_h | gate_h]: (2·N·H, D)
            self.q_proj = Linear(c.d_model, 2 * c.n_heads * H, bias=c.qkv_bias, **kw)
        if c.qk_norm:
            self.q_norm, self.k_norm = make_norm(c, H, **kw), make_norm(c, H, **kw)
        theta = (
            c.local_rope_theta if self.local and c.local_rope_theta is not None else c.rope_theta
        )
        self.rotary_dim = c.rotary_dim or H
        self._own_rope: list[RotaryEmbedding] | None = (
            None  # not a submodule (no weights); tables grow on demand
        )
        factor = None if self.local else c.rope_linear_factor
        if factor is not None:
            self._own_rope = [
                LinearScaledRotary(self.rotary_dim, c.max_seq_len, theta, c.rope_layout, factor)
            ]
        elif theta != c.rope_theta or self.rotary_dim != H:
            self._own_rope = [RotaryEmbedding(self.rotary_dim, c.max_seq_len, theta, c.rope_layout)]
        # impl divides the scores by √H; Gemma's scale is 1/√query_pre_attn_scalar: fold the ratio into q
        self.q_scale = (
            None if c.query_pre_attn_scalar is None else math.sqrt(H / c.query_pre_attn_scalar)
        )
        # Gemma-2's soft-capped scores are metadata the implementation applies (``meta.softcap``): a capped layer
        # starts on the reference formula, and Transformer.set_attention refuses a backend that cannot cap
        self.softcap = c.attn_softcap
        if self.softcap is not None:
            self.impl = ReferenceAttention()

    def _rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """RoPE on the first ``rotary_dim`` dims of x (B, heads, T, H); the rest pass through."""
        if self._own_rope is None:
            return self.rope.rotate(
                x, positions
            )  # the model's shared tables (covered once per forward)
        rope, rd = self._own_rope[0], self.rotary_dim
        if rd == x.shape[-1]:  # covered once per forward with the model's own (Transformer.ropes)
            return rope.rotate(x, positions)
        return torch.cat([rope.rotate(x[..., :rd], positions), x[..., rd:]], dim=-1)

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        """x (B, T, D) -> (B, T, D)."""
        B, T, _ = x.shape
        H = self.head_dim
        gate = None
        if self.gate:
            q, gate = self.q_proj(x).view(B, T, -1, 2 * H).split(H, dim=-1)  # (B, T, N, H) x2
            gate = gate.reshape(B, T, -1)  # (B, T, N·H)
        else:
            q = self.q_proj(x).view(B, T, -1, H)
        q = q.transpose(1, 2)  # (B, N, T, H)
        k = self.k_proj(x).view(B, T, -1, H).transpose(1, 2)  # (B, K, T, H)
        v = self.v_proj(x).view(B, T, -1, H).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:  # set together
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(q, meta.positions), self._rotate(k, meta.positions)
        if self.q_scale is not None:
            q = q * self.q_scale
        if self.local or self.softcap is not None:
            meta = dataclasses.replace(
                meta, window=self.window if self.local else meta.window, softcap=self.softcap
            )
        if meta.cache is not None:
            out = meta.cache.attend(self.layer_idx, q, k, v, meta, self.impl)
        else:
            out = self.impl(q, k, v, meta)  # (B, N, T, H)
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, N·H)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)
