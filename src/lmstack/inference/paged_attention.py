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

``decode_attention`` is what the seams call: lmstack's C++ kernel (``paged_kernel``: only each row's real
blocks, each key once for its G query heads, online softmax) where it is built and takes the dtypes, else
this formula.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lmstack.inference import paged_kernel


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
    p_b = positions[:, None]  # (B, 1)

    def keys(pool: Tensor, scale: Tensor | None) -> Tensor:
        x = pool[table].to(c)  # (B, M, bs, K, H): indirect loads under compile
        if scale is not None:
            x = x * scale[table][:, :, None, :, None].to(c)
        return x.reshape(B, S, K, H).permute(0, 2, 1, 3)[:, :, None]  # (B, K, 1, S, H)

    qg = q[:, :, 0].reshape(B, K, G, 1, H).to(c)  # query head n = kv head n // G (GQA)
    scores = (qg * keys(k_pool, k_scale)).sum(-1) / math.sqrt(H)  # (B, K, G, S): S last
    # with this step's k, v given, the pool's slot p_b is not read (it is stored after the forward): the
    # new key's score is one more column, so nothing per slot depends on this step's (RoPE'd) k
    visible = slot[None] < p_b if k_new is not None else slot[None] <= p_b  # (B, S)
    if window is not None:
        visible = visible & (p_b - slot[None] < window)
    if k_new is not None:
        new = (qg[..., 0, :] * k_new[:, :, None].to(c)).sum(-1, keepdim=True) / math.sqrt(H)
        scores = torch.cat([scores, new], dim=-1)  # (B, K, G, S + 1): the new token last, visible
        visible = torch.cat([visible, torch.ones_like(visible[:, :1])], dim=-1)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[:, None, None], -torch.inf)
    p = torch.softmax(scores, dim=-1)
    out = (p[..., :S, None] * keys(v_pool, v_scale)).sum(3)  # (B, K, G, H)
    if v_new is not None:
        out = out + p[..., S:] * v_new[:, :, None].to(c)
    return out.reshape(B, N, 1, H).to(q.dtype)


def decode_attention(
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
    """``paged_decode_attention``'s arguments and result, from the C++ kernel when ``paged_kernel.usable``
    (built for this CPU, q float32/bf16/fp16 on CPU; ``LMSTACK_PAGED_KERNEL=torch`` turns it off), else
    from the formula above."""
    fn = paged_kernel.paged_decode if paged_kernel.usable(q, k_pool) else paged_decode_attention
    return fn(q, k_pool, v_pool, table, positions, k_new, v_new, window, softcap, k_scale, v_scale)
