"""Mamba-2 (SSD): a selective state-space mixer with a scalar decay per head and token.

CS336 notes "注意力机制": h_t = γ_t h_{t−1} + Δ_t B_t x_tᵀ, y_t = C_tᵀ h_t + D·x_t with γ_t = exp(Δ_t A),
Δ_t = softplus(W_Δ x_t + b_Δ) (the decay is a function of the input), A = −exp(A_log) < 0 per head.
As in the reference architecture (Dao & Gu 2024; HF ``Mamba2Mixer``, whose parameter names these are):
one input projection → [z | xBC | Δ]; a short causal depthwise conv + SiLU over xBC; B_t, C_t shared
by the heads of a group; the D skip; a gated RMSNorm norm(y·silu(z)) per group; the output projection.
It is ``model.linear_scan``'s decayed recurrence with q = C, k = B, v = Δ·x, log γ = Δ·A.
Decode state per layer: the conv's last K − 1 inputs (B, conv_dim, K − 1) and h (B, heads, N_state, P).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.model.config import ModelConfig
from lmstack.model.layers import Linear
from lmstack.model.linear_scan import decay_chunked, decay_recurrent
from lmstack.model.recurrent import NormWeight, RecurrentMixer, causal_conv, gated_rms_norm


class Mamba2Mixer(RecurrentMixer):
    kind = "mamba2"

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int = 0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        c = config
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        self.layer_idx, self.chunk_size, self.eps = layer_idx, c.mixer_chunk_size, c.norm_eps
        self.dt_limit = (
            c.ssm_dt_limit
        )  # [lo, hi] clamp on Δ after the softplus (HF time_step_limit); None = none
        self.inner = c.ssm_expand * c.d_model  # I
        self.head_dim = c.ssm_head_dim  # P
        self.n_heads = self.inner // self.head_dim
        self.n_groups, self.state_size = c.ssm_n_groups, c.ssm_state_size  # G, N_state
        self.conv_dim = self.inner + 2 * self.n_groups * self.state_size
        self.in_proj = Linear(
            c.d_model, self.inner + self.conv_dim + self.n_heads, **kw
        )  # [z | xBC | Δ]
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            c.conv_kernel,
            groups=self.conv_dim,
            padding=c.conv_kernel - 1,
            bias=True,
            **kw,
        )  # (conv_dim, 1, K)
        self.dt_bias = nn.Parameter(torch.ones(self.n_heads, **kw))
        self.A_log = nn.Parameter(torch.zeros(self.n_heads, **kw))
        self.D = nn.Parameter(torch.ones(self.n_heads, **kw))
        self.norm = NormWeight(self.inner, **kw)
        self.out_proj = Linear(self.inner, c.d_model, **kw)

    def mix(
        self, x: Tensor, state: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x (B, T, D), state (conv inputs, recurrent state) or None -> (B, T, D), new state."""
        B, T, _ = x.shape
        P, G, Ns, nH = self.head_dim, self.n_groups, self.state_size, self.n_heads
        c = torch.float64 if x.dtype == torch.float64 else torch.float32  # the scan's precision
        z, xBC, dt = self.in_proj(x).split([self.inner, self.conv_dim, nH], dim=-1)
        conv_state, h0 = (None, None) if state is None else state
        xBC, conv_state = causal_conv(xBC, self.conv1d.weight, self.conv1d.bias, conv_state)
        xs, Bm, Cm = F.silu(xBC).split([self.inner, G * Ns, G * Ns], dim=-1)
        dt = F.softplus(dt.to(c) + self.dt_bias.to(c))  # Δ (B, T, nH)
        if self.dt_limit is not None:
            dt = dt.clamp(*self.dt_limit)
        A = -self.A_log.to(c).exp()  # (nH,)
        xh = xs.view(B, T, nH, P).transpose(1, 2)  # (B, nH, T, P)
        k = (
            Bm.view(B, T, G, Ns).repeat_interleave(nH // G, dim=2).transpose(1, 2)
        )  # (B, nH, T, N_state)
        q = Cm.view(B, T, G, Ns).repeat_interleave(nH // G, dim=2).transpose(1, 2)
        dt_h = dt.transpose(1, 2)  # (B, nH, T)
        v = xh.to(c) * dt_h[..., None]  # Δ_t x_t
        q, k = q.to(c), k.to(c)
        if h0 is not None and T == 1:
            y, h = decay_recurrent(q, k, v, dt_h * A[:, None], state=h0)
        else:
            y, h = decay_chunked(q, k, v, dt_h * A[:, None], chunk_size=self.chunk_size, state=h0)
        y = y + self.D.to(c)[:, None, None] * xh.to(c)  # the D skip
        y = y.transpose(1, 2).reshape(B, T, self.inner).to(x.dtype)
        y = gated_rms_norm(y, z, self.norm.weight, self.eps, self.inner // G, norm_first=False)
        return self.out_proj(y), (conv_state, h)
