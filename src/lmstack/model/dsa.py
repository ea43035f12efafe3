"""DSA: DeepSeek sparse attention — a light indexer picks, for each query, the top-k past keys to attend to.

Seed 001 "注意力机制" (DeepSeek-V3.2's DSA), seed 000 §1.9 (sparse attention). The lightning indexer
scores every past token s for query t with a few small heads j:

    I_{t,s} = Σ_j w_{t,j} · ReLU(q^I_{t,j} · k^I_s)         q^I (B, T, n_I, H_I), k^I (B, S, H_I), w (B, T, n_I)

then query t attends (softmax, GQA, RoPE as in ``model.attention``) only to its ``dsa_top_k`` highest-scoring
causal keys. With top_k ≥ S it is dense causal attention. Training/prefill builds the (T, S) selection mask;
decode (T = 1 with a ``MixerCache``) gathers the k selected keys, so the softmax costs O(k), and the indexer
O(S·H_I·n_I) cheap multiply-adds. Simplifications against V3.2: the main attention is GQA rather than MLA;
the indexer has no RoPE and no FP8; top-k is not differentiable, so the indexer learns nothing from the LM
loss here (V3.2 trains it with a KL loss towards the dense attention distribution).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor

from lmstack.model.attention import Attention
from lmstack.model.config import ModelConfig
from lmstack.model.layers import Linear, RotaryEmbedding
from lmstack.model.seam import AttentionMetadata


def index_scores(q_idx: Tensor, k_idx: Tensor, w: Tensor) -> Tensor:
    """I = Σ_j w_j ReLU(q_j · k): q_idx (B, T, n_I, H_I), k_idx (B, S, H_I), w (B, T, n_I) -> (B, T, S)."""
    dots = torch.einsum("btjh,bsh->btjs", q_idx, k_idx)  # (B, T, n_I, S)
    return torch.einsum("btj,btjs->bts", w, F.relu(dots))


def top_indices(scores: Tensor, k: int) -> Tensor:
    """Indices of the k largest scores along the last dim; ties go to the earlier key (a stable sort), so
    prefill and decode pick the same keys even when ReLU makes many scores exactly 0."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def top_k_selection(scores: Tensor, q_positions: Tensor, k_positions: Tensor, top_k: int) -> Tensor:
    """Boolean (B, T, S): True for each query's ``top_k`` highest-scoring visible keys (causal, filled).
    A query that sees fewer than top_k keys gets all of them."""
    visible = (k_positions[..., None, :] >= 0) & (k_positions[..., None, :] <= q_positions[..., :, None])
    visible = visible.expand_as(scores)
    masked = scores.masked_fill(~visible, -torch.inf)
    kk = min(top_k, scores.shape[-1])
    idx = top_indices(masked, kk)  # (B, T, kk)
    chosen = torch.zeros_like(visible).scatter_(-1, idx, True)
    return chosen & visible  # -inf picks (fewer than kk visible keys) are dropped


class SparseAttention(Attention):
    """GQA softmax attention (q/k/v/o, RoPE, QK-norm from ``Attention``) over indexer-selected keys."""

    kind = "dsa"

    def __init__(self, config: ModelConfig, layer_idx: int = 0, rope: RotaryEmbedding | None = None,
                 device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__(config, layer_idx, rope, device=device, dtype=dtype)
        kw = dict(device=device, dtype=dtype)
        self.top_k, self.n_idx, self.h_idx = config.dsa_top_k, config.dsa_index_heads, config.dsa_index_head_dim
        self.idx_q = Linear(config.d_model, self.n_idx * self.h_idx, **kw)  # (n_I·H_I, D)
        self.idx_k = Linear(config.d_model, self.h_idx, **kw)  # one key head shared by the indexer heads
        self.idx_w = Linear(config.d_model, self.n_idx, **kw)  # per-query head weights w_{t,j}

    def indexer(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        q_idx = self.idx_q(x).view(B, T, self.n_idx, self.h_idx) * self.h_idx ** -0.5
        w = self.idx_w(x) * self.n_idx ** -0.5
        return q_idx, self.idx_k(x), w

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        if meta.document_ids is not None:
            raise ValueError(f"layer {self.layer_idx} (dsa): packed documents (document_ids) are not supported")
        B, T, _ = x.shape
        q, k, v = self.project(x)  # (B, N, T, H), (B, K, T, H) x2
        q, k = self.rope.rotate(q, meta.positions), self.rope.rotate(k, meta.positions)
        q_idx, k_idx, w = self.indexer(x)
        qpos = meta.positions if meta.positions.dim() == 2 else meta.positions.expand(B, -1)  # (B, T)
        kpos = qpos
        if meta.cache is not None:
            if not hasattr(meta.cache, "extra"):
                raise TypeError(f"layer {self.layer_idx} (dsa) also caches its indexer keys, which "
                                f"{type(meta.cache).__name__} cannot hold; decode with lmstack.model.mixers.MixerCache")
            k, v, kpos = meta.cache.update(self.layer_idx, k, v, qpos)  # (B, K, S, H), positions (B, S)
            key = (self.layer_idx, "index_k")
            if key in meta.cache.extra:
                k_idx = torch.cat([meta.cache.extra[key], k_idx], dim=1)
            meta.cache.extra[key] = k_idx
        scores = index_scores(q_idx, k_idx, w)  # (B, T, S)
        G = q.shape[1] // k.shape[1]
        if T == 1 and meta.cache is not None:  # decode: gather the selected keys only
            visible = (kpos >= 0) & (kpos <= qpos)  # (B, S)
            kk = min(self.top_k, k.shape[2])
            idx = top_indices(scores[:, 0].masked_fill(~visible, -torch.inf), kk)  # (B, kk)
            ok = visible.gather(1, idx)  # (B, kk): False only when fewer than kk keys are visible
            gather = idx[:, None, :, None].expand(B, k.shape[1], kk, self.head_dim)
            ks, vs = k.gather(2, gather), v.gather(2, gather)  # (B, K, kk, H)
            out = F.scaled_dot_product_attention(q, ks, vs, attn_mask=ok[:, None, None, :], enable_gqa=G > 1)
        else:
            chosen = top_k_selection(scores, qpos, kpos, self.top_k)  # (B, T, S)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=chosen[:, None], enable_gqa=G > 1)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))




__all__ = ["SparseAttention", "index_scores", "top_k_selection"]
