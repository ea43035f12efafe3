"""DSA: DeepSeek sparse attention — a light indexer picks, for each query, the top-k past keys to attend to.

CS336 notes "注意力机制" (DeepSeek-V3.2's DSA), Book of LLMs §1.9 (sparse attention). The lightning indexer
scores every past token s for query t with a few small heads j:

    I_{t,s} = Σ_j w_{t,j} · ReLU(q^I_{t,j} · k^I_s)         q^I (B, T, n_I, H_I), k^I (B, S, H_I), w (B, T, n_I)

then query t attends (softmax, GQA, RoPE as in ``model.attention``) only to its ``dsa_top_k`` highest-scoring
causal keys. With top_k ≥ S it is dense causal attention. Training/prefill builds the (T, S) selection mask;
decode (T = 1 with a ``MixerCache``, ``inference.kv_cache``) gathers the k selected keys, so the softmax costs O(k), and the indexer
O(S·H_I·n_I) cheap multiply-adds. Simplifications against V3.2: the main attention is GQA rather than MLA;
the indexer has no RoPE and no FP8.

Training the indexer (V3.2): top-k is not differentiable, so the indexer learns from its own objective,
``indexer_kl_loss``: per query t, the main attention's distribution summed over heads and L1-normalised,
p_t = Σ_h P_{h,t,:} / ‖Σ_h P_{h,t,:}‖₁ (detached: a target), against q_t = softmax(I_{t,:}), loss = mean_t KL(p_t ‖ q_t).
``config.dsa_dense_warmup`` is the dense warm-up stage: the layer attends densely and the KL runs over every
causal key; otherwise (the sparse stage) the layer attends to its top-k and the KL is restricted to the selected
set S_t (both p and q renormalised over S_t). With ``config.dsa_indexer_loss`` > 0 and gradients on, each DSA
layer keeps ``indexer_loss`` (that weight × its KL) after the forward; the indexer then reads a detached x,
so the KL trains the indexer only and the LM loss never reaches it (``dsa_indexer_loss`` sums the layers' terms
for the trainer). Freezing the rest of the model during the warm-up, as V3.2 does, is left to the caller.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmstack.model.attention import Attention
from lmstack.model.cache import Ability, has
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
    visible = (k_positions[..., None, :] >= 0) & (
        k_positions[..., None, :] <= q_positions[..., :, None]
    )
    visible = visible.expand_as(scores)
    masked = scores.masked_fill(~visible, -torch.inf)
    kk = min(top_k, scores.shape[-1])
    idx = top_indices(masked, kk)  # (B, T, kk)
    chosen = torch.zeros_like(visible).scatter_(-1, idx, True)
    return chosen & visible  # -inf picks (fewer than kk visible keys) are dropped


def indexer_kl_loss(scores: Tensor, attn_probs: Tensor, allowed: Tensor) -> Tensor:
    """DeepSeek-V3.2's indexer objective: mean over queries of KL(p_t ‖ softmax(I_t)) over the allowed keys.

    scores (B, T, S): the indexer's I; attn_probs (B, N, T, S): the main attention's probabilities (a target:
    detached here); allowed (B, T, S) bool: the keys the KL runs over (every causal key in the dense stage, the
    selected top-k in the sparse stage; each query needs at least one). p_t = Σ_h P_{h,t} restricted to the allowed
    keys, L1-normalised; q_t = softmax of I_t over the allowed keys. In fp32 (fp64 for fp64 scores). -> scalar."""
    c = torch.float64 if scores.dtype == torch.float64 else torch.float32
    p = attn_probs.detach().to(c).sum(1).masked_fill(~allowed, 0.0)  # (B, T, S)
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(c).tiny)
    log_q = torch.log_softmax(scores.to(c).masked_fill(~allowed, -torch.inf), dim=-1).masked_fill(
        ~allowed, 0.0
    )
    kl = (torch.special.xlogy(p, p) - p * log_q).sum(-1)  # (B, T); 0·log 0 = 0
    return kl.mean()


def dsa_indexer_loss(model: nn.Module) -> Tensor | None:
    """Sum of every DSA layer's weighted indexer loss from the last forward (None: none computed)."""
    losses = [
        m.indexer_loss
        for m in model.modules()
        if isinstance(m, SparseAttention) and m.indexer_loss is not None
    ]
    return torch.stack([x.float() for x in losses]).sum() if losses else None


def dsa_loss_coefs(c) -> dict[str, float]:
    """The ``ModelConfig`` field that weights the DSA layers' indexer loss ({} without DSA layers)."""
    return {"dsa_indexer_loss": c.dsa_indexer_loss} if "dsa" in c.mixer_types else {}


class SparseAttention(Attention):
    """GQA softmax attention (q/k/v/o, RoPE, QK-norm from ``Attention``) over indexer-selected keys."""

    kind = "dsa"

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int = 0,
        rope: RotaryEmbedding | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(config, layer_idx, rope, device=device, dtype=dtype)
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        self.top_k, self.n_idx, self.h_idx = (
            config.dsa_top_k,
            config.dsa_index_heads,
            config.dsa_index_head_dim,
        )
        self.idx_q = Linear(config.d_model, self.n_idx * self.h_idx, **kw)  # (n_I·H_I, D)
        self.idx_k = Linear(
            config.d_model, self.h_idx, **kw
        )  # one key head shared by the indexer heads
        self.idx_w = Linear(config.d_model, self.n_idx, **kw)  # per-query head weights w_{t,j}
        self.loss_weight, self.dense_warmup = config.dsa_indexer_loss, config.dsa_dense_warmup
        self.indexer_loss: Tensor | None = (
            None  # weight × KL of the last training forward (module docstring)
        )

    def aux_losses(self) -> dict[str, Tensor]:
        """The weighted indexer KL of the last training forward, named as the trainer logs it
        (``Transformer.aux_losses`` sums the layers'); {} when none was computed."""
        return {} if self.indexer_loss is None else {"dsa_indexer_loss": self.indexer_loss}

    def indexer(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        q_idx = self.idx_q(x).view(B, T, self.n_idx, self.h_idx) * self.h_idx**-0.5
        w = self.idx_w(x) * self.n_idx**-0.5
        return q_idx, self.idx_k(x), w

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        if meta.document_ids is not None:
            raise ValueError(
                f"layer {self.layer_idx} (dsa): packed documents (document_ids) are not supported"
            )
        B, T, _ = x.shape
        q, k, v = self.project(x)  # (B, N, T, H), (B, K, T, H) x2
        q, k = self.rope.rotate(q, meta.positions), self.rope.rotate(k, meta.positions)
        train_indexer = self.loss_weight > 0 and torch.is_grad_enabled()
        self.indexer_loss = None
        q_idx, k_idx, w = self.indexer(
            x.detach() if train_indexer else x
        )  # the KL alone trains the indexer
        qpos = (
            meta.positions if meta.positions.dim() == 2 else meta.positions.expand(B, -1)
        )  # (B, T)
        kpos = qpos
        if meta.cache is not None:
            if not has(meta.cache, Ability.LAYER_TENSORS):
                raise TypeError(
                    f"layer {self.layer_idx} (dsa) also caches its indexer keys, which "
                    f"{type(meta.cache).__name__} cannot hold (no Ability.LAYER_TENSORS); decode with "
                    "lmstack.inference.kv_cache.MixerCache"
                )
            k, v, kpos = meta.cache.update(
                self.layer_idx, k, v, qpos
            )  # (B, K, S, H), positions (B, S)
            key = (self.layer_idx, "index_k")
            if key in meta.cache.extra:
                k_idx = torch.cat([meta.cache.extra[key], k_idx], dim=1)
            meta.cache.extra[key] = k_idx
        scores = index_scores(q_idx, k_idx, w)  # (B, T, S)
        G = q.shape[1] // k.shape[1]
        if T == 1 and meta.cache is not None:  # decode: gather the selected keys only
            visible = (kpos >= 0) & (kpos <= qpos)  # (B, S)
            kk = (
                k.shape[2] if self.dense_warmup else min(self.top_k, k.shape[2])
            )  # warm-up: every key
            idx = top_indices(scores[:, 0].masked_fill(~visible, -torch.inf), kk)  # (B, kk)
            ok = visible.gather(1, idx)  # (B, kk): False only when fewer than kk keys are visible
            gather = idx[:, None, :, None].expand(B, k.shape[1], kk, self.head_dim)
            ks, vs = k.gather(2, gather), v.gather(2, gather)  # (B, K, kk, H)
            out = F.scaled_dot_product_attention(
                q, ks, vs, attn_mask=ok[:, None, None, :], enable_gqa=G > 1
            )
        else:
            if (
                self.dense_warmup
            ):  # V3.2's warm-up: dense attention; the indexer only learns to imitate it
                chosen = (kpos[..., None, :] >= 0) & (
                    kpos[..., None, :] <= qpos[..., :, None]
                )  # (B, T, S)
                chosen = chosen.expand_as(scores)
            else:
                chosen = top_k_selection(scores, qpos, kpos, self.top_k)  # (B, T, S)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=chosen[:, None], enable_gqa=G > 1
            )
            if train_indexer:
                with (
                    torch.no_grad()
                ):  # the main attention's probabilities over the same keys: the target
                    c = torch.float64 if q.dtype == torch.float64 else torch.float32
                    kg = k.repeat_interleave(G, dim=1).to(c)  # (B, N, S, H)
                    logits = (q.to(c) @ kg.transpose(-2, -1)) / math.sqrt(
                        q.shape[-1]
                    )  # (B, N, T, S)
                    probs = torch.softmax(logits.masked_fill(~chosen[:, None], -torch.inf), dim=-1)
                self.indexer_loss = self.loss_weight * indexer_kl_loss(scores, probs, chosen)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


__all__ = [
    "SparseAttention",
    "dsa_indexer_loss",
    "dsa_loss_coefs",
    "index_scores",
    "indexer_kl_loss",
    "top_k_selection",
]
