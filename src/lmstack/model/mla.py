"""Multi-head latent attention (DeepSeek-V2/V3): one compressed KV latent per token.

CS336 notes "有损提速" (MLA: every head's keys and values are up-projections of one compressed vector, and
the per-head up-projections can be absorbed into the query and the output), Book of LLMs §2.5 (KV size:
MHA 2·N·H, GQA 2·K·H, MLA d_c + d_R numbers per token and layer).

Symbols: N heads, d_c = ``kv_lora_rank`` (the latent), d_c' = ``q_lora_rank``, H_n = ``qk_nope_head_dim``,
d_R = ``qk_rope_head_dim`` (the decoupled RoPE part: one key shared by all heads), H_v = ``v_head_dim``.

    c_t  = RMSNorm(x W_DKV)                  (B, T, d_c)     the only thing a cache must keep, plus
    k_R  = RoPE(x W_KR)                      (B, 1, T, d_R)  the shared RoPE key
    k_i  = [c W_UK_i ; k_R],  v_i = c W_UV_i                  per head, expanded ("naive" form)
    q_i  = [q_nope_i ; RoPE(q_R_i)]                          from x (or from a compressed query)
    score_i(t, s) = q_nope_i · (W_UK_i c_s) + q_R_i · k_R,s = (W_UK_iᵀ q_nope_i) · c_s + q_R_i · k_R,s

The last line is the absorbed form: one key per token, ``[c ; k_R]`` (an MQA with K = 1 of width
d_c + d_R), a query ``[W_UKᵀ q_nope ; q_R]`` per head, values c, and W_UV applied to each head's output.
Without a cache ``MLA`` runs the expanded form through the attention seam (any backend); with a cache it
runs the absorbed form, so the cache holds d_c + d_R numbers per token and layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import torch
from torch import Tensor, nn

from lmstack.model.cache import Ability, has
from lmstack.model.config import ModelConfig
from lmstack.model.layers import Linear, RMSNorm, RotaryEmbedding
from lmstack.model.seam import DEFAULT_ATTENTION, AttentionImpl, AttentionMetadata

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a / kv_a RMSNorm eps (fixed in its code, not rms_norm_eps)


class MLA(nn.Module):
    """Multi-head latent attention: (x (B, T, D), meta) -> (B, T, D).

    Parameter names follow DeepSeek's checkpoints: ``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
    ``kv_a_proj`` (W_DKV and W_KR stacked: (d_c + d_R, D)), ``kv_a_layernorm``, ``kv_b_proj`` (W_UK and W_UV
    per head: (N·(H_n + H_v), d_c)), ``o_proj`` (D, N·H_v). RoPE on the d_R dims uses ``config.rope_layout``
    (DeepSeek's own: "interleaved").
    """

    #: read as a matrix by the absorbed form (``up_weights``): weight-only quantisation keeps it in floating point
    float_linears = ("kv_b_proj",)

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int = 0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.n_heads, self.d_c, self.d_cq = c.n_heads, c.kv_lora_rank, c.q_lora_rank
        self.h_nope, self.d_rope, self.h_v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.h_qk = self.h_nope + self.d_rope
        self.impl: AttentionImpl = DEFAULT_ATTENTION
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        N = c.n_heads
        if self.d_cq:
            self.q_a_proj = Linear(c.d_model, self.d_cq, **kw)  # W_DQ (d_c', D)
            self.q_a_layernorm = RMSNorm(self.d_cq, LATENT_NORM_EPS, **kw)
            self.q_b_proj = Linear(
                self.d_cq, N * self.h_qk, **kw
            )  # W_UQ and W_QR (N·(H_n+d_R), d_c')
        else:
            self.q_proj = Linear(c.d_model, N * self.h_qk, **kw)  # (N·(H_n+d_R), D)
        self.kv_a_proj = Linear(
            c.d_model, self.d_c + self.d_rope, **kw
        )  # [W_DKV; W_KR] (d_c+d_R, D)
        self.kv_a_layernorm = RMSNorm(self.d_c, LATENT_NORM_EPS, **kw)
        self.kv_b_proj = Linear(
            self.d_c, N * (self.h_nope + self.h_v), **kw
        )  # [W_UK; W_UV] per head
        self.o_proj = Linear(N * self.h_v, c.d_model, **kw)  # W_O (D, N·H_v)
        self.rope: RotaryEmbedding
        if c.rope_yarn is not None:
            self.rope = YarnRotaryEmbedding(
                self.d_rope, c.max_seq_len, c.rope_theta, c.rope_layout, c.rope_yarn
            )
            self.q_scale = self.rope.softmax_scale_factor  # mscale² on top of 1/sqrt(H_n + d_R)
        else:
            self.rope = RotaryEmbedding(self.d_rope, c.max_seq_len, c.rope_theta, c.rope_layout)
            self.q_scale = 1.0

    # ---- pieces ---------------------------------------------------------------------------------
    def queries(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, T, D) -> q_nope (B, N, T, H_n), q_rope (B, N, T, d_R) (rotated)."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.d_cq else self.q_proj(x)
        q = q.view(B, T, -1, self.h_qk).transpose(
            1, 2
        )  # (B, N, T, H_n + d_R); N from the width (a tp shard: N/tp)
        q_nope, q_rope = q.split([self.h_nope, self.d_rope], dim=-1)
        return q_nope, self.rope(q_rope, positions)

    def latent(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, T, D) -> c (B, T, d_c) (normed latent), k_rope (B, 1, T, d_R) (rotated, shared by all heads)."""
        B, T, _ = x.shape
        c, k_rope = self.kv_a_proj(x).split([self.d_c, self.d_rope], dim=-1)
        return self.kv_a_layernorm(c), self.rope(k_rope.reshape(B, 1, T, self.d_rope), positions)

    def up_weights(self) -> tuple[Tensor, Tensor]:
        """W_UK (N, H_n, d_c) and W_UV (N, H_v, d_c) from ``kv_b_proj``."""
        w = self.kv_b_proj.weight.view(-1, self.h_nope + self.h_v, self.d_c)  # N from the width
        return w[:, : self.h_nope], w[:, self.h_nope :]

    # ---- the two forms ----------------------------------------------------------------------------
    def expanded(
        self, q_nope: Tensor, q_rope: Tensor, c: Tensor, k_rope: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        """Naive form: per-head keys/values from the latent -> (B, N, T, H_v)."""
        B, T = c.shape[:2]
        kv = self.kv_b_proj(c).view(B, T, -1, self.h_nope + self.h_v).transpose(1, 2)
        k_nope, v = kv.split([self.h_nope, self.h_v], dim=-1)  # (B, N, T, H_n), (B, N, T, H_v)
        q = torch.cat([q_nope, q_rope], dim=-1) * self.q_scale  # (B, N, T, H_n + d_R)
        k = torch.cat(
            [k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1
        )  # (B, N, T, H_n + d_R)
        return self.impl(
            q, k, v, meta
        )  # the impl scales by 1/sqrt(H_n + d_R), DeepSeek's softmax scale

    def absorbed_query(self, q_nope: Tensor, q_rope: Tensor) -> Tensor:
        """[W_UKᵀ q_nope ; q_R] (B, N, T, d_c + d_R), scaled so that an implementation's 1/sqrt(d_c + d_R)
        becomes DeepSeek's 1/sqrt(H_n + d_R)."""
        w_uk, _ = self.up_weights()
        q_lat = (
            q_nope @ w_uk
        )  # (B, N, T, H_n) @ (N, H_n, d_c) -> (B, N, T, d_c), one batched matmul
        fix = math.sqrt((self.d_c + self.d_rope) / self.h_qk) * self.q_scale
        return torch.cat([q_lat, q_rope], dim=-1) * fix

    def absorbed_output(self, o_lat: Tensor) -> Tensor:
        """Per-head latent outputs (B, N, T, d_c) -> W_UV applied: (B, N, T, H_v)."""
        _, w_uv = self.up_weights()
        return o_lat @ w_uv.transpose(1, 2)  # (B, N, T, d_c) @ (N, d_c, H_v) -> (B, N, T, H_v)

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        """x (B, T, D) -> (B, T, D). No cache: the expanded form through ``self.impl``. A cache: the absorbed
        form against a latent cache (``Ability.LATENT``, e.g. ``inference.kv_cache.LatentKVCache``) that keeps only
        [c ; k_R] per token and passes c — a view of the same storage — as the values."""
        B, T, _ = x.shape
        q_nope, q_rope = self.queries(x, meta.positions)
        c, k_rope = self.latent(x, meta.positions)
        if meta.cache is None:
            out = self.expanded(q_nope, q_rope, c, k_rope, meta)  # (B, N, T, H_v)
        else:
            q_abs = self.absorbed_query(q_nope, q_rope)  # (B, N, T, d_c + d_R)
            k_lat = torch.cat([c[:, None], k_rope], dim=-1)  # (B, 1, T, d_c + d_R)
            if not has(meta.cache, Ability.LATENT):
                raise ValueError(
                    f"an MLA model needs a latent KV cache (Ability.LATENT, e.g. "
                    f"lmstack.inference.kv_cache.LatentKVCache), got {type(meta.cache).__name__}"
                )
            o_lat = meta.cache.attend(
                self.layer_idx, q_abs, k_lat, None, meta, FoldHeads(self.impl)
            )  # (B,N,T,d_c)
            out = self.absorbed_output(o_lat)  # (B, N, T, H_v)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class YarnRotaryEmbedding(RotaryEmbedding):
    """RoPE with YaRN scaling (Peng et al. 2023; DeepSeek-V2/V3's long-context RoPE): per frequency, a ramp
    between the original θ_i (high frequencies, extrapolated) and θ_i / factor (low frequencies, interpolated)
    over the dimensions whose wavelength fits between beta_fast and beta_slow rotations of the original
    context; cos/sin scaled by the attention factor, and the softmax scale by mscale(factor, mscale_all_dim)²
    (``softmax_scale_factor``), as DeepSeek's checkpoints expect."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, layout: str, yarn: dict):
        super().__init__(head_dim, max_seq_len, theta, layout)
        factor = float(yarn["factor"])
        orig = float(yarn["original_max_position_embeddings"])
        mscale, mscale_all = yarn.get("mscale"), yarn.get("mscale_all_dim")
        att = yarn.get("attention_factor")
        if att is None:
            att = (
                _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                if mscale and mscale_all
                else _yarn_mscale(factor)
            )
        self.attention_factor = float(att)
        self.softmax_scale_factor = _yarn_mscale(factor, mscale_all) ** 2 if mscale_all else 1.0
        fast, slow = yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1

        def dim_for(
            rotations: float,
        ) -> float:  # the dimension whose wavelength makes `rotations` turns in orig
            return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_for(fast), dim_for(slow)
        if yarn.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = (
            (torch.arange(head_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)
        ).clamp(0, 1)
        base = theta ** (
            -torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
        )  # θ_i
        extrapolate = 1 - ramp  # 1: keep θ_i, 0: θ_i / factor
        self.inv_freq = base / factor * (1 - extrapolate) + base * extrapolate  # (H/2,)

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        key = (torch.device(device), dtype)
        if key not in self._cache:
            positions = torch.arange(self.length, dtype=torch.float64, device="cpu")
            angles = torch.outer(positions, self.inv_freq)  # (S, H/2)
            angles = (
                angles.repeat_interleave(2, dim=-1)
                if self.layout == "interleaved"
                else torch.cat([angles, angles], dim=-1)
            )
            self._cache[key] = (
                (angles.cos() * self.attention_factor).to(device=device, dtype=dtype),
                (angles.sin() * self.attention_factor).to(device=device, dtype=dtype),
            )
        return self._cache[key]


class FoldHeads:
    """Run an implementation on the absorbed form as one matmul over all heads: with a single kv head
    (K = 1, MQA) the N query heads can be folded into the query rows, q (B, N, T, d) -> (B, 1, N·T, d), with
    the queries' positions (and documents) tiled N times, so the shared latent keys are read once instead
    of being expanded per head. Without key positions (no cache) the call is passed through unchanged."""

    def __init__(self, impl: AttentionImpl):
        self.impl, self.name = impl, f"fold({getattr(impl, 'name', type(impl).__name__)})"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        if k.shape[1] != 1 or meta.key_positions is None:
            return self.impl(q, k, v, meta)
        B, N, T, d = q.shape
        tile = lambda t: None if t is None else t.repeat(N) if t.dim() == 1 else t.repeat(1, N)
        folded = dataclasses.replace(
            meta,
            positions=cast(Tensor, tile(meta.positions)),
            document_ids=tile(meta.document_ids),
            is_causal=False,
            cache=None,
        )
        out = self.impl(q.reshape(B, 1, N * T, d), k, v, folded)  # (B, 1, N·T, d_v)
        return out.view(B, N, T, -1)


def kv_bytes_per_token(config: ModelConfig, bytes_per_value: int = 2) -> int:
    """KV-cache bytes one token costs over all layers: MLA (d_c + d_R)·L·bytes; otherwise 2·K·H·L·bytes."""
    if config.is_mla:
        return (config.kv_lora_rank + config.qk_rope_head_dim) * config.n_layers * bytes_per_value
    assert (
        config.n_kv_heads is not None and config.head_dim is not None
    )  # resolved by ModelConfig.__post_init__
    return 2 * config.n_kv_heads * config.head_dim * config.n_layers * bytes_per_value
