"""Causal self-attention with MHA / GQA / MQA, sliding window, QK-norm and q/k/v bias.

Seed 000 §1.2 (projections, reshape to heads, GQA expansion, RoPE, scaled scores, causal mask,
softmax, output projection), §1.3 (masked_fill with True = may attend), §1.9 (sliding window);
seed 001 "注意力机制", "训练稳定性" (QK-norm).

The KV-cache seam: ``forward`` takes an optional ``kv_cache`` object with one method,
``update(layer_idx, k, v, positions) -> (k_all, v_all, k_positions)``: it stores this step's
keys/values (B, K, T, H) and returns every key/value this layer may attend to, (B, K, S, H),
with their positions (B, S) (negative = empty slot). The mask is built from positions alone,
so contiguous, paged and packed layouts all work without the model changing.

Two optional extensions of the seam serve Orca's selective batching (seed 000 §2.2: the tokens
of several sequences flattened into one row, prefill chunks and decode tokens together):

- ``update`` may return a fourth tensor, the keys' sequence ids (B, S); with ``document_ids``
  (B, T) for the queries the mask then also hides keys of other sequences;
- the cache may define ``attention(layer_idx, q, k, v, positions, window) -> (B, N, T, H)``;
  it then stores k, v and computes the attention itself, grouped per sequence (the non-attention
  ops stay batched over all T tokens), instead of one masked attention over every gathered key.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lmstack.model.config import ModelConfig
from lmstack.model.layers import Linear, RMSNorm, RotaryEmbedding


def attention_mask(q_positions: Tensor, k_positions: Tensor, window: int | None = None,
                   q_documents: Tensor | None = None, k_documents: Tensor | None = None) -> Tensor:
    """Boolean mask, True where query i may attend key j (seed 000 §1.3 convention).

    q_positions: (B, T) or (T,); k_positions: (B, S) or (S,). Key j is visible to query i when
    it holds a token (pos_j >= 0), is not in the future (pos_j <= pos_i) and, with a sliding
    window W, is one of the W most recent positions (pos_i - pos_j < W; seed 000 §1.9).
    With document ids (packed sequences), keys of other documents are hidden too.
    Returns (B, 1, T, S) — or (T, S) when all inputs are 1-D — broadcast over heads.
    """
    q = q_positions[..., :, None]  # (B, T, 1)
    k = k_positions[..., None, :]  # (B, 1, S)
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= (q - k) < window
    if q_documents is not None:
        mask = mask & (q_documents[..., :, None] == k_documents[..., None, :])
    return mask if mask.dim() == 2 else mask[:, None]


def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(QKᵀ/√H + mask) V in fp32 (fp64 for fp64 inputs) with GQA expansion made explicit (seed 000 §1.2, §1.3).

    q: (B, N, T, H); k, v: (B, K, S, H); mask: bool broadcastable to (B, N, T, S). -> (B, N, T, H)
    """
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)  # (B, N, S, H)
    v = v.repeat_interleave(G, dim=1)  # (B, N, S, H)
    c = torch.float64 if q.dtype == torch.float64 else torch.float32  # fp32 at least
    scores = (q.to(c) @ k.to(c).transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, N, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v.to(c)).to(q.dtype)


def _resolve_backend(name: str, device: torch.device, key_len: int) -> str:
    from lmstack.kernels.backends import resolve_attn_backend

    return resolve_attn_backend(name, device, key_len)


class Attention(nn.Module):
    """Multi-head attention with K ≤ N kv heads (MHA when K = N, GQA when 1 < K < N, MQA when K = 1)."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0, rope: RotaryEmbedding | None = None,
                 device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim  # N, K, H
        self.window = c.sliding_window
        self.backend = c.attn_backend
        kw = dict(device=device, dtype=dtype)
        self.q_proj = Linear(c.d_model, c.n_heads * c.head_dim, bias=c.qkv_bias, **kw)  # W_Q (N·H, D)
        self.k_proj = Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=c.qkv_bias, **kw)  # W_K (K·H, D)
        self.v_proj = Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=c.qkv_bias, **kw)  # W_V (K·H, D)
        self.o_proj = Linear(c.n_heads * c.head_dim, c.d_model, bias=False, **kw)  # W_O (D, N·H)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.norm_eps, **kw)
            self.k_norm = RMSNorm(c.head_dim, c.norm_eps, **kw)
        else:
            self.q_norm = self.k_norm = None
        # Shared across layers when the Transformer passes one in; not a submodule then.
        self._rope = [rope if rope is not None else RotaryEmbedding(c.head_dim, c.max_seq_len, c.rope_theta, c.rope_layout)]

    @property
    def rope(self) -> RotaryEmbedding:
        return self._rope[0]

    def forward(self, x: Tensor, positions: Tensor, kv_cache=None, causal_fast_path: bool = False,
                document_ids: Tensor | None = None) -> Tensor:
        """x: (B, T, D); positions: (B, T) or (T,) absolute positions of these tokens. -> (B, T, D)

        ``causal_fast_path`` says positions are 0..T-1 for every row, there is no cache and no
        window, so SDPA's built-in causal mask can be used instead of a materialised one.
        ``document_ids`` (B, T): packed documents; a token attends only within its document.
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, N, T, H)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, K, T, H)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, K, T, H)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, positions), self.rope(k, positions)  # RoPE on q and k, never v

        k_documents = document_ids  # without a cache the keys are the queries' own tokens
        if kv_cache is not None:
            if hasattr(kv_cache, "attention"):  # the cache groups the attention per sequence itself
                out = kv_cache.attention(self.layer_idx, q, k, v, positions, self.window)  # (B, N, T, H)
                return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
            k, v, k_positions, *rest = kv_cache.update(self.layer_idx, k, v, positions)  # (B, K, S, H), (B, S)
            causal_fast_path = False
            if document_ids is not None:
                if not rest:
                    raise ValueError("document_ids with a kv_cache need a cache whose update() also returns the "
                                     "keys' sequence ids (a 4th tensor); this cache returns 3")
                k_documents = rest[0]  # (B, S) sequence ids of the keys
        else:
            k_positions = positions
        if document_ids is not None:
            causal_fast_path = False

        if causal_fast_path and self.window is None:
            mask = None
        else:
            mask = attention_mask(positions, k_positions, self.window, document_ids, k_documents)

        backend = self.backend if self.backend != "auto" else _resolve_backend(self.backend, q.device, k.shape[2])
        if backend == "sdpa" and mask is not None and q.device.type == "cpu" and torch.compiler.is_compiling():
            # Under torch.compile on CPU the masked attention is written out (QKᵀ, mask, softmax, ·V) so
            # inductor fuses it into one loop; SDPA's CPU kernel costs ~0.1 ms per call for one query.
            backend = "reference"
        if backend in ("flash_pytorch", "flash_triton") and mask is not None:
            # FlashAttention-2 (seed 000 §2.7) covers the plain causal case; anything that needs an
            # explicit mask (KV-cache slots, sliding window, packed documents) takes sdpa.
            backend = "sdpa"
        from lmstack.kernels.backends import attention as attention_backend

        out = attention_backend(q, k, v, mask=mask, causal=mask is None, backend=backend)  # (B, N, T, H)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, N·H)
        return self.o_proj(out)
