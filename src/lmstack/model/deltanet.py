"""Gated DeltaNet: the delta rule with a data-dependent decay (Yang, Kautz & Hatamizadeh 2025).

CS336 notes "注意力机制": S_t = γ_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ, y_t = S_tᵀ q_t — each token
first erases what the memory stored under k_t (by β_t), then writes v_t; γ_t forgets globally.
Layout as in Qwen3.5 / Qwen3-Next's linear-attention layers (HF ``Qwen3_5GatedDeltaNet``, whose parameter
names these are): projections in_proj_qkv, in_proj_z (output gate), in_proj_b (β = sigmoid),
in_proj_a (log γ = −exp(A_log)·softplus(a + dt_bias)); a short causal conv + SiLU over q, k, v;
q, k L2-normalised, q scaled by 1/√H_k; value heads may outnumber q/k heads (each q/k head serves
n_v/n_k consecutive value heads); RMSNorm over each value head then ·silu(z); output projection.
Forms: ``model.linear_scan.delta_chunked`` (UT/WY, training/prefill), ``delta_recurrent`` (decode).
Decode state per layer: the conv's last K − 1 inputs and S (B, n_v, H_k, H_v).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.model.config import ModelConfig
from lmstack.model.layers import Linear
from lmstack.model.linear_scan import delta_chunked, delta_recurrent
from lmstack.model.recurrent import NormWeight, RecurrentMixer, causal_conv, gated_rms_norm


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(RecurrentMixer):
    kind = "gated_deltanet"

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
        self.layer_idx, self.chunk_size, self.eps = layer_idx, c.mixer_chunk_size, c.norm_eps
        self.n_k = c.delta_n_heads or c.n_heads
        self.n_v = c.delta_n_v_heads or self.n_k
        self.h_k = c.delta_head_dim or c.head_dim
        self.h_v = c.delta_v_head_dim or self.h_k
        key_dim, value_dim = self.n_k * self.h_k, self.n_v * self.h_v
        self.split = [key_dim, key_dim, value_dim]
        self.conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkv = Linear(c.d_model, self.conv_dim, **kw)
        self.in_proj_z = Linear(c.d_model, value_dim, **kw)
        self.in_proj_b = Linear(c.d_model, self.n_v, **kw)
        self.in_proj_a = Linear(c.d_model, self.n_v, **kw)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            c.conv_kernel,
            groups=self.conv_dim,
            padding=c.conv_kernel - 1,
            bias=False,
            **kw,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.n_v, **kw))
        self.A_log = nn.Parameter(torch.zeros(self.n_v, **kw))
        self.norm = NormWeight(self.h_v, **kw)
        self.out_proj = Linear(value_dim, c.d_model, **kw)

    def mix(
        self, x: Tensor, state: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x (B, T, D), state (conv inputs, recurrent state) or None -> (B, T, D), new state."""
        B, T, _ = x.shape
        c = torch.float64 if x.dtype == torch.float64 else torch.float32  # the scan's precision
        conv_state, s0 = (None, None) if state is None else state
        qkv, conv_state = causal_conv(
            self.in_proj_qkv(x), self.conv1d.weight, self.conv1d.bias, conv_state
        )
        q, k, v = F.silu(qkv).split(self.split, dim=-1)
        rep = self.n_v // self.n_k
        q = (
            q.view(B, T, self.n_k, self.h_k).repeat_interleave(rep, dim=2).transpose(1, 2).to(c)
        )  # (B, n_v, T, H_k)
        k = k.view(B, T, self.n_k, self.h_k).repeat_interleave(rep, dim=2).transpose(1, 2).to(c)
        v = v.view(B, T, self.n_v, self.h_v).transpose(1, 2).to(c)  # (B, n_v, T, H_v)
        q, k = l2_normalize(q) * self.h_k**-0.5, l2_normalize(k)
        beta = torch.sigmoid(self.in_proj_b(x).to(c)).transpose(1, 2)  # (B, n_v, T)
        g = (
            -self.A_log.to(c).exp() * F.softplus(self.in_proj_a(x).to(c) + self.dt_bias.to(c))
        ).transpose(1, 2)
        if s0 is not None and T == 1:
            y, s = delta_recurrent(q, k, v, beta, g, state=s0)
        else:
            y, s = delta_chunked(q, k, v, beta, g, chunk_size=self.chunk_size, state=s0)
        y = y.transpose(1, 2).to(x.dtype)  # (B, T, n_v, H_v)
        z = self.in_proj_z(x).view(B, T, self.n_v, self.h_v)
        y = gated_rms_norm(y, z, self.norm.weight, self.eps, self.h_v, norm_first=True)
        return self.out_proj(y.reshape(B, T, -1)), (conv_state, s)
