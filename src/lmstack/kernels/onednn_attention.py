"""Causal attention for CPU fp32 inference through oneDNN's GEMM, block-triangular over query rows: the attention
backend ``onednn`` (``kernels.backends``), which ``eval.perplexity``'s windows ask for (``fast_attention``).

Book of LLMs §1.2 (softmax(QKᵀ/√H + causal mask) V), §1.3 (the causal mask), §2.7 (attention is exact
whichever way it is tiled). Why it exists: SDPA's CPU flash kernel does its block products with torch's
BLAS, which on AMD CPUs runs fp32 GEMMs slower than oneDNN's (docs/kernels.md); at the perplexity
windows' T = 1024 this path is the faster one there (the figures: docs/eval.md). Its GEMM is
``ops.gemm.onednn_linear``, the one under the model's linears.

Scheme: for each batch row and kv head, the G query heads of the group are stacked along the rows
(row t·G + g = query t of head g), and the queries are cut into blocks of ``ROW_BLOCK`` rows. Block
[t0, t1) is multiplied only against keys [0, t1) — the keys right of the diagonal block are never
computed — then the diagonal block is masked, an exact fp32 softmax runs over each row, and P V gives
the block's output, written straight into a (B, T, N, H) buffer (what the output projection reads).
Scores are scaled through q: with H = 64, 1/√H = 1/8 is a power of two, so q·s is exact.

Inference only (no autograd), plain causal self-attention only (no cache, window, documents or
explicit mask: ``applies``); everything else goes to the fallback implementation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lmstack.model.seam import AttentionImpl, AttentionMetadata, SDPAAttention
from lmstack.ops.gemm import onednn_linear, onednn_ok

ROW_BLOCK = 128  # query rows a block (64, 128, 192, 256 measured: docs/eval.md)
MIN_T = 192  # shorter sequences run the fallback (SDPA's one call beats the per-block calls below ~160 tokens)
_TRIU: dict[int, Tensor] = {}


def _strict_upper(n: int) -> Tensor:
    """(n, 1, n) bool, True where key j > query i: what a diagonal block masks (broadcast over G)."""
    if n not in _TRIU:
        _TRIU[n] = torch.ones(n, n, dtype=torch.bool).triu(1)[:, None, :]
    return _TRIU[n]


@torch.no_grad()
def onednn_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, block: int = ROW_BLOCK
) -> Tensor:
    """softmax(Q Kᵀ·scale + causal mask) V. q (B, N, T, H), k/v (B, K, T, H) fp32 on the CPU, N a multiple
    of K, causal top-left aligned (query i sees keys 0..i). -> (B, N, T, H), a transposed view of a
    contiguous (B, T, N, H) tensor."""
    B, N, T, H = q.shape
    K = k.shape[1]
    if k.shape != (B, K, T, H) or v.shape != k.shape or N % K:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected (B, N, T, H) and "
            "(B, K, T, H) with N a multiple of K (self-attention, no cache)"
        )
    G = N // K
    s = 1.0 / math.sqrt(H) if scale is None else float(scale)
    qg = torch.empty(B, K, T, G, H, dtype=q.dtype)  # rows (t, g) of each kv head's group, scaled
    torch.mul(q.unflatten(1, (K, G)).transpose(2, 3), s, out=qg)
    k, v = (
        k.contiguous(),
        v.contiguous(),
    )  # oneDNN reads a strided operand ~1000x slower (a reference path)
    out = torch.empty(B, T, K, G, H, dtype=q.dtype)
    for b in range(B):
        for h in range(K):
            kk, vv, qq = k[b, h], v[b, h], qg[b, h]  # (T, H), (T, H), (T, G, H)
            for t0 in range(0, T, block):
                t1 = min(T, t0 + block)
                n = t1 - t0
                scores = onednn_linear(qq[t0:t1].reshape(n * G, H), kk[:t1])  # (n·G, t1) = Q Kᵀ·s
                scores.view(n, G, t1)[:, :, t0:].masked_fill_(_strict_upper(n), -math.inf)
                probs = torch._softmax(
                    scores, -1, False, out=scores
                )  # in place, exact fp32 softmax
                out[b, t0:t1, h] = onednn_linear(probs, vv[:t1].t()).view(n, G, H)  # P V
    return out.view(B, T, N, H).transpose(1, 2)


def applies(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> bool:
    """Whether ``onednn_causal_attention`` computes this call: plain causal self-attention (no mask, cache,
    window or documents) of at least ``MIN_T`` tokens, fp32 on the CPU where oneDNN GEMMs run (``onednn_ok``),
    nothing recording gradients."""
    return (
        meta.is_causal
        and meta.cache is None
        and meta.mask() is None
        and q.shape[2] == k.shape[2] >= MIN_T
        and k.shape == v.shape
        and q.shape[0] == k.shape[0]
        and q.shape[3] == k.shape[3]
        and q.shape[1] % k.shape[1] == 0
        and onednn_ok(q)
        and k.dtype == v.dtype == torch.float32
        and not (
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        )
    )


class OneDNNAttention:
    """``AttentionImpl``: ``onednn_causal_attention`` where it ``applies``, else ``fallback`` (SDPA)."""

    name = "onednn"

    def __init__(self, fallback: AttentionImpl | None = None):
        self.fallback = SDPAAttention() if fallback is None else fallback

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        if applies(q, k, v, meta):
            return onednn_causal_attention(q, k, v)
        return self.fallback(q, k, v, meta)
