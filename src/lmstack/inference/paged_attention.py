"""Decode attention read in place through the block table (vLLM's PagedAttention, Kwon et al. 2023; Book of
LLMs §1.2/§1.3 for softmax(qKᵀ/√H + mask) V, §1.9 for the window).

One query per row b at position p_b; its keys are the blocks of its table (B, M): slot s of row b is
``pool[table[b, s // bs], s % bs]``, holding position s. Written as indexing, a broadcast multiply and sums
(no ``bmm``), so under ``torch.compile`` inductor turns the gather into indirect loads inside the score and the
output reductions: the pool is read where it lies, no (B, M·bs, K, H) copy per layer (a ``bmm`` would need
the keys materialised first). This step's own k, v are put at slot p_b by a ``where`` (the pool gets them
after the forward, ``DecodeStep``). Quantised pools (int8/fp8 codes, one scale per (block, KV head),
``quant.kv_codec``) are dequantised in the same loads. Eagerly it is the plain formula (the reference the
tests compare against the gathered keys and ``reference_attention``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def paged_decode_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    positions: Tensor,
    k_new: Tensor | None = None,
    v_new: Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """q (B, N, 1, H); one layer's pool k_pool, v_pool (NB, bs, K, H) (codes when scales are given: k_scale,
    v_scale (NB, K)); table (B, M) block ids; positions (B,) of the queries; k_new, v_new (B, K, H) this
    step's keys/values, used at slot p_b in place of the pool's (None: the pool already holds them).
    Key slot s is visible when s ≤ p_b (and p_b − s < window). Scores soft-capped c·tanh(s/c) before the mask
    (Gemma-2). -> (B, N, 1, H) in q's dtype; computed in fp32 (fp64 for fp64 q)."""
    B, N, _, H = q.shape
    _, bs, K, _ = k_pool.shape
    M = table.shape[1]
    S, G = M * bs, N // K
    c = torch.float64 if q.dtype == torch.float64 else torch.float32
    slot = torch.arange(S, device=q.device)  # (S,): slot s holds position s
    here = (slot[None] == positions[:, None])[:, :, None, None]  # (B, S, 1, 1)

    def keys(pool: Tensor, scale: Tensor | None, new: Tensor | None) -> Tensor:
        x = pool[table].to(c)  # (B, M, bs, K, H): indirect loads under compile
        if scale is not None:
            x = x * scale[table][:, :, None, :, None].to(c)
        x = x.reshape(B, S, K, H)
        return x if new is None else torch.where(here, new[:, None].to(c), x)

    ks = keys(k_pool, k_scale, k_new).permute(0, 2, 1, 3)[:, :, None]  # (B, K, 1, S, H)
    qg = q[:, :, 0].reshape(B, K, G, 1, H).to(c)  # query head n = kv head n // G (GQA)
    scores = (qg * ks).sum(-1) / math.sqrt(H)  # (B, K, G, S): S last, the softmax runs along it
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    visible = slot[None] <= positions[:, None]  # (B, S)
    if window is not None:
        visible = visible & (positions[:, None] - slot[None] < window)
    scores = scores.masked_fill(~visible[:, None, None], -torch.inf)
    p = torch.softmax(scores, dim=-1)
    vs = keys(v_pool, v_scale, v_new).permute(0, 2, 1, 3)[:, :, None]  # (B, K, 1, S, H)
    out = (p[..., None] * vs).sum(3)  # (B, K, G, H)
    return out.reshape(B, N, 1, H).to(q.dtype)
