"""FlashAttention-2 in plain PyTorch: tiled forward with online softmax, tiled recomputing backward.

Book of LLMs §2.7 “FlashAttention tiling”: standard attention writes the (S_q, S_k) score matrix to HBM and reads it back
several times, so it is memory-bound and needs O(S²) memory; FlashAttention cuts Q, K and V
into tiles, keeps a running max m and running sum ℓ per query row ("online softmax"), and never
materialises the full matrix — activations drop from O(S²) to O(S), and the result is exact.
CS336 notes "FlashAttention": the product with V is the collector that lets a later K/V tile
correct the output of earlier ones ("online tiled attention").

This module is the readable reference of the algorithm; ``flash_triton`` is the same algorithm
as GPU kernels. Shapes use the seed symbols: B batch, N query heads, K kv heads, G = N // K,
T query length, S key length, H head dim; Bq / Bk are the query / key tile sizes.

Causal masking is aligned bottom-right: query row i (0 ≤ i < T) sits at position i + S - T and
sees keys j ≤ i + S - T. With T = S this is the usual lower-triangular mask; with T < S it is
"T new tokens after S - T cached ones" (what a KV cache does).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Tiles are computed in fp32 (fp64 stays fp64) and the output cast back (Book of LLMs §5.1 “mixed precision and underflow”)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"expected q (B, N, T, H), k and v (B, K, S, H); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, N, T, H = q.shape
    Bk, K, S, Hk = k.shape
    if k.shape != v.shape or Bk != B or Hk != H:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be (B={B}, K, S, H={H})"
        )
    if N % K != 0:
        raise ValueError(f"n_kv_heads K={K} does not divide n_heads N={N}")
    return B, N, K, T, S, H


def _tile_mask(q0: int, q1: int, k0: int, k1: int, offset: int, device) -> Tensor:
    """(Bq, Bk) bool, True where query row i may attend key j under the causal rule j ≤ i + offset."""
    rows = torch.arange(q0, q1, device=device)[:, None]
    cols = torch.arange(k0, k1, device=device)[None, :]
    return cols <= rows + offset


def flash_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float,
    block_q: int = 64,
    block_k: int = 64,
) -> tuple[Tensor, Tensor]:
    """Tiled forward pass (FlashAttention-2 Algorithm 1, Book of LLMs §2.7 “FlashAttention tiling” five steps).

    q: (B, N, T, H); k, v: (B, K, S, H). Returns O (B, N, T, H) in q.dtype and the
    log-sum-exp L = m + log ℓ (B, N, T) in the compute dtype. Peak extra memory is one
    (B, N, Bq, Bk) score tile plus O(B·N·T·H) accumulators — linear in S.
    """
    B, N, K, T, S, H = _check_shapes(q, k, v)
    G = N // K
    cdt = _compute_dtype(q.dtype)
    offset = S - T
    out = torch.empty(B, N, T, H, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, N, T, dtype=cdt, device=q.device)
    kg = k.unsqueeze(2)  # (B, K, 1, S, H): one kv head serves its G query heads by broadcasting
    vg = v.unsqueeze(2)  # (B, K, 1, S, H)
    for q0 in range(0, T, block_q):  # step 1: load a Q tile
        q1 = min(q0 + block_q, T)
        qi = q[:, :, q0:q1].to(cdt).unflatten(1, (K, G))  # (B, K, G, Bq, H)
        m = torch.full(
            qi.shape[:-1], -math.inf, dtype=cdt, device=q.device
        )  # running max (B, K, G, Bq)
        l = torch.zeros_like(m)  # running sum ℓ (B, K, G, Bq)
        acc = torch.zeros_like(qi)  # unnormalised output (B, K, G, Bq, H)
        # causal tile skipping: keys beyond the last visible one of this tile are never loaded
        k_end = min(S, q1 + offset) if causal else S
        for k0 in range(0, max(k_end, 0), block_k):  # step 2: load a K/V tile
            k1 = min(k0 + block_k, k_end)
            kj = kg[:, :, :, k0:k1].to(cdt)  # (B, K, 1, Bk, H)
            vj = vg[:, :, :, k0:k1].to(cdt)  # (B, K, 1, Bk, H)
            s = (qi @ kj.transpose(-1, -2)) * scale  # step 3: scores of this tile (B, K, G, Bq, Bk)
            if causal and k1 - 1 > q0 + offset:  # only tiles that cross the diagonal need a mask
                s = s.masked_fill(~_tile_mask(q0, q1, k0, k1, offset, q.device), -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1))  # (B, K, G, Bq)
            m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)  # rows with no visible key yet
            p = torch.exp(s - m_safe[..., None])  # (B, K, G, Bq, Bk)
            alpha = torch.exp(m - m_safe)  # rescales what earlier tiles accumulated
            l = alpha * l + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ vj  # (B, K, G, Bq, H)
            m = m_new
        # step 4: normalise once and write the tile back; rows that saw no key give O = 0, L = -inf
        o = acc / l.clamp_min(torch.finfo(cdt).tiny)[..., None]
        out[:, :, q0:q1] = o.flatten(1, 2).to(q.dtype)
        lse[:, :, q0:q1] = (m + torch.log(l)).flatten(1, 2)
    return out, lse


def flash_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    block_q: int = 64,
    block_k: int = 64,
) -> tuple[Tensor, Tensor, Tensor]:
    """Tiled backward (FlashAttention-2 Algorithm 2): P is recomputed tile by tile from L.

    With D = rowsum(dO ∘ O) (B, N, T), for every tile: P = exp(QKᵀ·scale − L), dV += Pᵀ dO,
    dP = dO Vᵀ, dS = P ∘ (dP − D), dQ += dS K·scale, dK += dSᵀ Q·scale. For GQA the G query
    heads of one kv head add into the same dK, dV. Returns dQ, dK, dV in the input dtypes.
    """
    B, N, K, T, S, H = _check_shapes(q, k, v)
    G = N // K
    cdt = lse.dtype
    offset = S - T
    delta = (dout.to(cdt) * out.to(cdt)).sum(dim=-1).unflatten(1, (K, G))  # D (B, K, G, T)
    lse_g = lse.unflatten(1, (K, G))  # (B, K, G, T)
    qg = q.unflatten(1, (K, G))  # (B, K, G, T, H)
    dog = dout.unflatten(1, (K, G))  # (B, K, G, T, H)
    dq = torch.zeros(B, K, G, T, H, dtype=cdt, device=q.device)
    dk = torch.zeros(B, K, S, H, dtype=cdt, device=q.device)
    dv = torch.zeros(B, K, S, H, dtype=cdt, device=q.device)
    for k0 in range(0, S, block_k):  # outer loop over K/V tiles, as FlashAttention-2 does
        k1 = min(k0 + block_k, S)
        kj = k[:, :, k0:k1].to(cdt).unsqueeze(2)  # (B, K, 1, Bk, H)
        vj = v[:, :, k0:k1].to(cdt).unsqueeze(2)  # (B, K, 1, Bk, H)
        dkj = torch.zeros(B, K, G, k1 - k0, H, dtype=cdt, device=q.device)
        dvj = torch.zeros_like(dkj)
        # causal: query rows before k0 - offset cannot see this tile
        q_start = max(0, k0 - offset) // block_q * block_q if causal else 0
        for q0 in range(q_start, T, block_q):
            q1 = min(q0 + block_q, T)
            qi = qg[:, :, :, q0:q1].to(cdt)  # (B, K, G, Bq, H)
            doi = dog[:, :, :, q0:q1].to(cdt)  # (B, K, G, Bq, H)
            s = (qi @ kj.transpose(-1, -2)) * scale  # (B, K, G, Bq, Bk)
            p = torch.exp(s - lse_g[..., q0:q1, None])  # recomputed probabilities
            if causal and k1 - 1 > q0 + offset:
                p = p.masked_fill(~_tile_mask(q0, q1, k0, k1, offset, q.device), 0.0)
            dvj += p.transpose(-1, -2) @ doi  # (B, K, G, Bk, H)
            dp = doi @ vj.transpose(-1, -2)  # (B, K, G, Bq, Bk)
            ds = p * (dp - delta[..., q0:q1, None])  # (B, K, G, Bq, Bk)
            dq[:, :, :, q0:q1] += (ds @ kj) * scale
            dkj += (ds.transpose(-1, -2) @ qi) * scale
        dk[:, :, k0:k1] = dkj.sum(dim=2)  # GQA: the G query heads share this kv head
        dv[:, :, k0:k1] = dvj.sum(dim=2)
    return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def make_flash_function(
    name: str,
    forward_impl,
    backward_impl,
    doc: str,
    default_blocks: tuple[int | None, int | None] = (None, None),
) -> type[torch.autograd.Function]:
    """An autograd.Function around a FlashAttention-2 pair (Book of LLMs §2.7 “FlashAttention tiling”) shared by every implementation.

    ``forward_impl(q, k, v, causal, scale, block_q, block_k) -> (O, L)``;
    ``backward_impl(dO, q, k, v, O, L, causal, scale, block_q, block_k) -> (dQ, dK, dV)``.
    Only Q, K, V, O and the log-sum-exp L (B, N, T) are saved; backward recomputes P tile by tile
    (CS336 notes "优化技巧 / 重计算").
    """

    def forward(
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        scale: float | None = None,
        block_q: int | None = None,
        block_k: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        block_q = default_blocks[0] if block_q is None else block_q
        block_k = default_blocks[1] if block_k is None else block_k
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        out, lse = forward_impl(q, k, v, causal, scale, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.blocks = causal, scale, (block_q, block_k)
        ctx.mark_non_differentiable(lse)
        return out, lse

    def backward(ctx, dout: Tensor, dlse: Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward_impl(dout, q, k, v, out, lse, ctx.causal, ctx.scale, *ctx.blocks)
        return dq, dk, dv, None, None, None, None

    return type(
        name,
        (torch.autograd.Function,),
        {"__doc__": doc, "forward": staticmethod(forward), "backward": staticmethod(backward)},
    )


FlashAttentionPyTorch = make_flash_function(
    "FlashAttentionPyTorch",
    flash_attention_forward,
    flash_attention_backward,
    "O = softmax(Q Kᵀ · scale [+ causal mask]) V without the (T, S) matrix, in tiled PyTorch (Book of LLMs §2.7 “FlashAttention tiling”).",
    default_blocks=(64, 64),
)


def flash_attention_pytorch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 64,
    block_k: int = 64,
    return_lse: bool = False,
):
    """FlashAttention-2 in PyTorch. q (B, N, T, H), k/v (B, K, S, H) -> O (B, N, T, H) [, L (B, N, T)]."""
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block_q={block_q}, block_k={block_k}: tile sizes must be positive")
    out, lse = FlashAttentionPyTorch.apply(q, k, v, causal, scale, block_q, block_k)
    return (out, lse) if return_lse else out
