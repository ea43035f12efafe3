"""Attention for CPU training: matmuls in the input dtype, scores and softmax in fp32.

Seed 000 §1.2 (scaled scores, softmax, P V), §1.3 (mask: True = may attend), §2.7 (the backward
of attention: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ⊙ (dP − rowsum(P ⊙ dP)), dQ = dS K·s, dK = dSᵀ Q·s).

Why it exists: on CPU the bf16 *backward* of ``F.scaled_dot_product_attention`` (its flash
kernel) costs about six times its forward and ~20–25% of a small model's training step
(docs/training.md). For the sequence lengths a CPU trains at, the (T, S) matrix fits in memory,
so the plain formula with four batched matmuls each way runs on the AMX bf16 matmul units and the
backward reuses the saved probabilities P instead of recomputing them tile by tile.

Precision: Q Kᵀ, P V and the four backward matmuls take inputs in q's dtype (bf16 under autocast)
and accumulate in fp32 inside the matmul; the scaled scores, the mask, the softmax, P saved for
backward and the softmax backward are fp32 — the precision HF's eager attention uses
(bf16 scores upcast before the softmax). In fp32 everything is fp32.

GQA (K kv heads, N = K·G query heads): the G query heads sharing a kv head are stacked along the
rows, (B, K, G·T, H), so one matmul per kv head serves the whole group and dK, dV come out summed
over the group without expanding K or V. A query row that sees no key gives NaN (as softmax over
an empty set); causal, window and document masks always let a token see itself.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_CAUSAL_BIAS: dict[tuple[int, int, torch.device], Tensor] = {}


def causal_bias(T: int, S: int, device: torch.device) -> Tensor:
    """fp32 (T, S) additive mask: 0 where key j <= i + S - T (bottom-right aligned), -inf after."""
    key = (T, S, torch.device(device))
    if key not in _CAUSAL_BIAS:
        i = torch.arange(T, device=device)[:, None]
        j = torch.arange(S, device=device)[None, :]
        _CAUSAL_BIAS[key] = torch.zeros(T, S, device=device).masked_fill_(j > i + (S - T), -math.inf)
    return _CAUSAL_BIAS[key]


def mask_bias(mask: Tensor) -> Tensor:
    """Boolean mask (True = may attend), any shape broadcastable to (B, N, T, S) -> fp32 0 / -inf."""
    if mask.dtype != torch.bool:
        raise TypeError(f"mask dtype={mask.dtype}; expected torch.bool (True = may attend)")
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, -math.inf)


# Rows of scores handled at once: (chunk of B)·K·G·T·S fp32 values near 1 MB, so the matmul, add,
# softmax, conversions and softmax backward of one chunk run in the L2 cache, in scratch buffers
# reused from chunk to chunk. Nothing of size (B, ·, T, S) is kept: the first touch of fresh
# whole-batch P buffers (page faults) cost more here than recomputing P chunk by chunk in backward.
CHUNK_SCORES = 1 << 18
_SCRATCH: dict[tuple, Tensor] = {}


def _scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A chunk-sized buffer kept between calls (fresh ~1 MB allocations page-fault on every call here).

    Only ever used inside one forward or backward call and never saved, so reuse across calls and
    layers is safe. One flat buffer per (name, dtype, device), grown when a larger chunk asks, so
    varying sequence lengths never pile up buffers.
    """
    key = (name, dtype, torch.device(device))
    n = math.prod(shape)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n].view(shape)


def _probs(qg: Tensor, kt: Tensor, bias: Tensor, scale: float, s_buf: Tensor, p_buf: Tensor) -> Tensor:
    """P = softmax(Q Kᵀ·s + bias) of one chunk, fp32, written into p_buf. qg (b, K, G·T, H), kt (b, K, H, S)."""
    b, K, GT, S = p_buf.shape
    T = bias.shape[-2]
    torch.matmul(qg, kt, out=s_buf)  # scores in q's dtype (fp32 accumulation inside the matmul)
    # fp32 scores: bias + s·scale in one pass (type promotion upcasts s), broadcast over K and G
    torch.add(bias, s_buf.view(b, K, GT // T, T, S), alpha=scale, out=p_buf.view(b, K, GT // T, T, S))
    return torch._softmax(p_buf, -1, False, out=p_buf)  # in place, fp32


class MatmulAttention(torch.autograd.Function):
    """O = softmax(Q Kᵀ·s + bias) V with fp32 scores; backward recomputes P (fp32) chunk by chunk."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
        B, N, T, H = q.shape
        K, S = k.shape[1], k.shape[2]
        G = N // K
        qg = q.reshape(B, K, G * T, H)  # (B, K, G·T, H): the group's heads stacked along rows
        k, v = k.contiguous(), v.contiguous()  # per-chunk matmuls on strided (B, S, K, H) views copy each time
        kt = k.transpose(-2, -1)  # (B, K, H, S), a transposed operand for the matmul (no copy)
        step = max(1, CHUNK_SCORES // (K * G * T * S))
        shape = (min(step, B), K, G * T, S)
        s_buf = _scratch("s", shape, q.dtype, q.device)
        p_buf = _scratch("p", shape, torch.float32, q.device)
        p_lp = p_buf if v.dtype == torch.float32 else _scratch("p_lp", shape, v.dtype, q.device)
        out = torch.empty(B, K, G * T, H, dtype=v.dtype, device=q.device)
        for b0 in range(0, B, step):
            b1 = min(B, b0 + step)
            n = b1 - b0
            bc = bias[b0:b1] if bias.dim() == 5 and bias.shape[0] > 1 else bias  # per-row masks: (B, 1, 1, T, S)
            pc = _probs(qg[b0:b1], kt[b0:b1], bc, scale, s_buf[:n], p_buf[:n])
            if p_lp is not p_buf:
                p_lp[:n].copy_(pc)
            torch.matmul(p_lp[:n], v[b0:b1], out=out[b0:b1])  # O = P V, (b, K, G·T, H)
        ctx.save_for_backward(qg, k, v, bias)
        ctx.scale, ctx.shape, ctx.step = scale, (B, N, T, H), step
        return out.view(B, N, T, H)

    @staticmethod
    def backward(ctx, d_out: Tensor):
        qg, k, v, bias = ctx.saved_tensors
        B, N, T, H = ctx.shape
        K, S, step = k.shape[1], k.shape[2], ctx.step
        kt = k.transpose(-2, -1)
        d_out = d_out.to(v.dtype).reshape(B, K, (N // K) * T, H).contiguous()  # (B, K, G·T, H)
        dq, dk, dv = torch.empty_like(qg), torch.empty_like(k), torch.empty_like(v)
        shape = (min(step, B), K, qg.shape[2], S)
        s_buf = _scratch("s", shape, qg.dtype, qg.device)
        p_buf = _scratch("p", shape, torch.float32, qg.device)
        p_lp = p_buf if v.dtype == torch.float32 else _scratch("p_lp", shape, v.dtype, qg.device)
        dp32 = _scratch("dp32", shape, torch.float32, qg.device)
        ds32 = _scratch("ds32", shape, torch.float32, qg.device)
        for b0 in range(0, B, step):
            b1 = min(B, b0 + step)
            n = b1 - b0
            bc = bias[b0:b1] if bias.dim() == 5 and bias.shape[0] > 1 else bias
            pc = _probs(qg[b0:b1], kt[b0:b1], bc, ctx.scale, s_buf[:n], p_buf[:n])  # the forward's P, recomputed
            if p_lp is not p_buf:
                p_lp[:n].copy_(pc)
            do = d_out[b0:b1]
            torch.matmul(p_lp[:n].transpose(-2, -1), do, out=dv[b0:b1])  # dV = Pᵀ dO, summed over the group
            dp = torch.matmul(do, v[b0:b1].transpose(-2, -1), out=s_buf[:n])  # dP = dO Vᵀ (b, K, G·T, S)
            if dp.dtype != torch.float32:
                dp = dp32[:n].copy_(dp)
            ds = torch._softmax_backward_data(dp, pc, -1, torch.float32, grad_input=ds32[:n])  # P ⊙ (dP − rowsum(P ⊙ dP))
            if ds.dtype != qg.dtype:
                ds = p_lp[:n].copy_(ds)  # dS in the matmul dtype (P's low-precision copy is no longer needed)
            torch.matmul(ds, k[b0:b1], out=dq[b0:b1])  # dQ = dS K (·s below)
            torch.matmul(ds.transpose(-2, -1), qg[b0:b1], out=dk[b0:b1])  # dK = dSᵀ Q (·s below)
        return dq.mul_(ctx.scale).view(B, N, T, H), dk.mul_(ctx.scale), dv, None, None


def matmul_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False,
                     scale: float | None = None) -> Tensor:
    """softmax(Q Kᵀ/√H + mask) V with fp32 scores/softmax and matmuls in q's dtype.

    q: (B, N, T, H); k, v: (B, K, S, H) with N a multiple of K; mask: bool, True = may attend,
    broadcastable to (B, 1, T, S) (it is broadcast over heads) — or ``causal=True`` for the
    bottom-right-aligned causal mask. Under autocast the inputs are cast to the autocast dtype.
    -> (B, N, T, H) in q's (compute) dtype.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, heads, seq, H); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, N, T, H = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != H or N % k.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {tuple(q.shape)}: expected (B, K, S, H) "
                         "with N a multiple of K")
    if mask is not None and causal:
        raise ValueError("give either mask or causal=True, not both")
    S = k.shape[2]
    dtype = q.dtype
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if mask is not None:
        bias = mask_bias(mask)
        bias = bias.reshape(bias.shape[:-2] + (1,) * (4 - bias.dim()) + bias.shape[-2:]) if bias.dim() < 4 else bias
        if bias.shape[1] != 1:
            raise ValueError(f"mask shape {tuple(mask.shape)}: expected one mask for all heads, (B, 1, T, S) or (T, S)")
        bias = bias[:, :, None]  # (B, 1, 1, T, S): broadcast over K and G
    elif causal:
        bias = causal_bias(T, S, q.device)
    else:
        bias = torch.zeros(T, S, device=q.device)
    scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
    with torch.autocast(q.device.type, enabled=False):
        return MatmulAttention.apply(q, k, v, bias, scale)
