"""The attention seam: what a mixer hands to an attention implementation, and what a KV cache does.

Book of LLMs §1.2 “the forward pass layer by layer”/§1.3 (softmax(QKᵀ/√H + mask) V, True = may attend), §1.9 (sliding window), §2.4
(KV cache). ``Attention`` computes q, k, v (projections, QK-norm, RoPE) and calls

    impl(q, k, v, meta) -> out        q (B, N, T, H), k/v (B, K, S, H) -> (B, N, T, H)

with an ``AttentionMetadata`` record; with a cache it calls ``meta.cache.attend(layer_idx, q, k,
v, meta, impl)`` instead: the cache stores k, v, then calls ``impl`` on the keys it holds.

This module is the only one both ``model/`` and ``kernels/`` import (the model owns the interface it
needs; kernels implement it): the metadata, the mask it implies, the implementation Protocols, and the
torch-only reference/SDPA implementations a model built without a runtime uses. What a cache is (the
``Cache`` protocol and its declared abilities) is ``model.cache``, beside this module. ``kernels.backends``
registers these two and the tiled/Triton/matmul ones, and owns the one ``auto`` policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


def attention_mask(
    q_positions: Tensor,
    k_positions: Tensor,
    window: int | None = None,
    q_documents: Tensor | None = None,
    k_documents: Tensor | None = None,
) -> Tensor:
    """Boolean mask, True where query i may attend key j (Book of LLMs §1.3 “implementation details in PyTorch” convention).

    q_positions: (B, T) or (T,); k_positions: (B, S) or (S,). Key j is visible to query i when
    it holds a token (pos_j >= 0), is not in the future (pos_j <= pos_i) and, with a sliding
    window W, is one of the W most recent positions (pos_i - pos_j < W; Book of LLMs §1.9 “sliding-window and sparse attention”).
    With document ids (packed sequences), keys of other documents are hidden too.
    Returns (B, 1, T, S) — or (T, S) when all inputs are 1-D — broadcast over heads.
    """
    q = q_positions[..., :, None]  # (B, T, 1)
    k = k_positions[..., None, :]  # (B, 1, S)
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= (q - k) < window
    if q_documents is not None:
        assert k_documents is not None, "q_documents needs k_documents"
        mask = mask & (q_documents[..., :, None] == k_documents[..., None, :])
    return mask if mask.dim() == 2 else mask[:, None]


@dataclass
class AttentionMetadata:
    """Everything an attention implementation needs besides q, k, v; built once per forward.

    positions:        (B, T) or (T,) absolute positions of the queries
    key_positions:    (B, S) or (S,) positions of the keys (negative = empty slot); None = the keys
                      are the queries' own tokens (no cache)
    document_ids:     (B, T) packed documents / sequences of the queries, or None
    key_document_ids: (B, S) of the keys; None = the queries' own ``document_ids``
    window:           sliding window W (a query sees its W most recent positions), or None
    is_causal:        the mask is exactly the causal triangle over 0..T-1 (no cache, no window,
                      no documents): an implementation may use its built-in causal mask
    cache:            a ``model.cache.Cache`` that stores this forward's k, v and attends over what it holds
    token_ids:        (B, T) the input token ids of the queries, or None (a pipeline stage that gets
                      hidden states); read by layers that route on the token itself (hash-routed MoE)
    softcap:          attention-logit soft-cap c: scores s -> c·tanh(s/c) before the mask (Gemma-2), or None;
                      only an implementation with ``supports_softcap = True`` may be handed one
                      (``Transformer.set_attention`` refuses the others by name)
    """

    positions: Tensor
    key_positions: Tensor | None = None
    document_ids: Tensor | None = None
    key_document_ids: Tensor | None = None
    window: int | None = None
    is_causal: bool = False
    cache: Any = None
    token_ids: Tensor | None = None
    softcap: float | None = None

    def mask(self) -> Tensor | None:
        """The boolean mask (B, 1, T, S) or (T, S), True = may attend; None when ``is_causal``
        and nothing else restricts the keys (the implementation applies the causal triangle)."""
        if self.is_causal and self.window is None and self.document_ids is None:
            return None
        kp = self.positions if self.key_positions is None else self.key_positions
        kd = self.document_ids if self.key_document_ids is None else self.key_document_ids
        return attention_mask(self.positions, kp, self.window, self.document_ids, kd)

    def for_keys(
        self,
        key_positions: Tensor,
        key_document_ids: Tensor | None = None,
        positions: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> AttentionMetadata:
        """The record a cache passes on with the keys it gathered: no cache, never the causal fast path."""
        return AttentionMetadata(
            self.positions if positions is None else positions,
            key_positions,
            self.document_ids if document_ids is None else document_ids,
            key_document_ids,
            self.window,
            False,
            None,
            softcap=self.softcap,
        )


class AttentionImpl(Protocol):
    """A stateless attention implementation: q (B, N, T, H), k/v (B, K, S, H) -> (B, N, T, H). It may declare
    ``supports_softcap = True`` when it applies ``meta.softcap`` (absent: it does not)."""

    name: str

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor: ...


class NormImpl(Protocol):
    """An RMSNorm implementation: (x (..., D), γ (D,), eps) -> (..., D) in x's dtype."""

    def __call__(self, x: Tensor, weight: Tensor, eps: float) -> Tensor: ...


def supports_softcap(impl: AttentionImpl) -> bool:
    """Whether ``impl`` applies ``AttentionMetadata.softcap`` (it declares ``supports_softcap = True``)."""
    return bool(getattr(impl, "supports_softcap", False))


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, softcap: float | None = None
) -> Tensor:
    """softmax(QKᵀ/√H + mask) V in fp32 (fp64 for fp64 inputs) with GQA expansion made explicit (Book of LLMs §1.2 “the forward pass layer by layer”, §1.3);
    with ``softcap`` c the scores are c·tanh(s/c) before the mask (Gemma-2's attention-logit soft-capping).

    q: (B, N, T, H); k, v: (B, K, S, H); mask: bool broadcastable to (B, N, T, S). -> (B, N, T, H)
    """
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)  # (B, N, S, H)
    v = v.repeat_interleave(G, dim=1)  # (B, N, S, H)
    c = torch.float64 if q.dtype == torch.float64 else torch.float32  # fp32 at least
    scores = (q.to(c) @ k.to(c).transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, N, T, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v.to(c)).to(q.dtype)


def causal_mask(T: int, S: int, device: torch.device) -> Tensor:
    """(T, S) bottom-right aligned causal mask: query i (position S-T+i) sees keys j <= S-T+i."""
    return attention_mask(torch.arange(S - T, S, device=device), torch.arange(S, device=device))


class ReferenceAttention:
    """The explicit formula, materialising the (T, S) scores: the reference every other one equals. It applies
    soft-capped scores (``meta.softcap``)."""

    name = "reference"
    supports_softcap = True

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        mask = meta.mask()
        if mask is None:
            mask = causal_mask(q.shape[2], k.shape[2], q.device)
        return reference_attention(q, k, v, mask, meta.softcap)


class SDPAAttention:
    """``F.scaled_dot_product_attention`` (FlashAttention-2 on CUDA). Under torch.compile on CPU a
    masked call is written out as the reference formula, which inductor fuses into one loop (SDPA's
    CPU kernel costs ~0.1 ms per call for one decode query)."""

    name = "sdpa"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        mask = meta.mask()
        if mask is not None and q.device.type == "cpu" and torch.compiler.is_compiling():
            return reference_attention(q, k, v, mask)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1]
        )


#: What a model built without a runtime runs (``Transformer(config)``); ``kernels.backends`` resolves others.
DEFAULT_ATTENTION = SDPAAttention()
