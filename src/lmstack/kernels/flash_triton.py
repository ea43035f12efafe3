"""FlashAttention-2 as Triton kernels: forward, and backward split into a dK/dV and a dQ kernel.

Book of LLMs §2.7 (tiling, online softmax, exactness), §4.1 (tiles live in on-chip SRAM, HBM is read
once per tile); CS336 notes "Triton Kernel" (block pointers: ``tl.make_block_ptr`` + ``advance``,
zero padding of partial tiles via ``boundary_check``), "优化技巧" (masks instead of branches,
fusion, recomputation, tiling), "FlashAttention" (online tiled attention).

This module imports Triton at import time; ``lmstack.kernels`` only imports it on first use.
Shapes: q (B, N, T, H), k/v (B, K, S, H), G = N // K query heads per kv head; L (B, N, T).
Causal masking is aligned bottom-right exactly as in ``flash_pytorch`` (query i sees key j when
j ≤ i + S - T).

Grid (forward and dQ): one program per (query tile, b·n); it walks the K/V tiles of kv head
n // G (GQA without copying K/V). Grid (dK/dV): one program per (key tile, b·kv head); it walks
the query tiles of all G query heads that share that kv head, so dK/dV need no atomics.
Scores are kept in log2 units (qk_scale = scale·log2 e) so that exp2 is used; L is stored in
natural-log units so it equals ``torch.logsumexp`` of the scaled scores.

``TRITON_INTERPRET=1`` runs the kernels on CPU (numpy). The interpreter mishandles bf16/fp16
arithmetic, so there the tiles are loaded in their dtype and up-cast to fp32 before any math
(``UPCAST``); on a GPU the dots take fp16/bf16 inputs with fp32 accumulation, fp32 inputs use
exact ``ieee`` dots (no TF32).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmstack.kernels.flash_pytorch import make_flash_function

LOG2E = 1.4426950408889634  # log2(e)
LN2 = 0.6931471805599453  # ln(2)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _attn_fwd_kernel(
    Q,
    Kt,
    V,
    O,
    L,
    stride_qb,
    stride_qn,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_on,
    stride_ot,
    stride_oh,
    stride_lb,
    stride_ln,
    stride_lt,
    N,
    G,
    T,
    S,
    H,
    offset,
    qk_scale,
    CAUSAL: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_q = (
        tl.num_programs(0) - 1 - tl.program_id(0)
    )  # which query tile; causal: the longest rows first
    pid_bn = tl.program_id(1)  # which (batch, query head)
    b = pid_bn // N
    n = pid_bn % N
    kv = n // G  # GQA: the kv head this query head reads
    q0 = pid_q * BLOCK_Q

    q_ptr = tl.make_block_ptr(
        Q + b * stride_qb + n * stride_qn,
        shape=(T, H),
        strides=(stride_qt, stride_qh),
        offsets=(q0, 0),
        block_shape=(BLOCK_Q, BLOCK_H),
        order=(1, 0),
    )
    # Kᵀ tile (H, Bk): the transposed view of K is just other strides, no copy
    kt_ptr = tl.make_block_ptr(
        Kt + b * stride_kb + kv * stride_kn,
        shape=(H, S),
        strides=(stride_kh, stride_ks),
        offsets=(0, 0),
        block_shape=(BLOCK_H, BLOCK_K),
        order=(0, 1),
    )
    v_ptr = tl.make_block_ptr(
        V + b * stride_vb + kv * stride_vn,
        shape=(S, H),
        strides=(stride_vs, stride_vh),
        offsets=(0, 0),
        block_shape=(BLOCK_K, BLOCK_H),
        order=(1, 0),
    )

    q = tl.load(q_ptr, boundary_check=(0, 1), padding_option="zero")  # (Bq, H), stays in SRAM
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l = tl.zeros((BLOCK_Q,), dtype=tl.float32)  # running sum ℓ
    acc = tl.zeros((BLOCK_Q, BLOCK_H), dtype=tl.float32)  # unnormalised O tile
    rows = q0 + tl.arange(0, BLOCK_Q)

    # Tiles every row of this query tile fully sees need no mask; the rest (the diagonal band
    # and a partial last tile) are masked. Causal tiles past the diagonal are never loaded.
    if CAUSAL:
        hi = tl.minimum(q0 + BLOCK_Q + offset, S)
        n_full = tl.maximum(tl.minimum(q0 + offset + 1, S), 0) // BLOCK_K
    else:
        hi = S
        n_full = S // BLOCK_K

    for _ in range(0, n_full):
        kt = tl.load(kt_ptr, boundary_check=(0,), padding_option="zero")  # (H, Bk)
        v = tl.load(v_ptr, boundary_check=(1,), padding_option="zero")  # (Bk, H)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (Bq, Bk) scores, log2 units
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)  # rescale what earlier tiles accumulated
        l = alpha * l + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
        kt_ptr = tl.advance(kt_ptr, (0, BLOCK_K))
        v_ptr = tl.advance(v_ptr, (BLOCK_K, 0))

    for k0 in range(n_full * BLOCK_K, hi, BLOCK_K):
        kt = tl.load(kt_ptr, boundary_check=(0, 1), padding_option="zero")
        v = tl.load(v_ptr, boundary_check=(0, 1), padding_option="zero")
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        cols = k0 + tl.arange(0, BLOCK_K)
        visible = cols[None, :] < S
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = alpha * l + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
        kt_ptr = tl.advance(kt_ptr, (0, BLOCK_K))
        v_ptr = tl.advance(v_ptr, (BLOCK_K, 0))

    l_safe = tl.where(l == 0.0, 1.0, l)  # rows that saw no key: O = 0, L = -inf
    o = acc / l_safe[:, None]
    o_ptr = tl.make_block_ptr(
        O + b * stride_ob + n * stride_on,
        shape=(T, H),
        strides=(stride_ot, stride_oh),
        offsets=(q0, 0),
        block_shape=(BLOCK_Q, BLOCK_H),
        order=(1, 0),
    )
    tl.store(o_ptr, o.to(O.dtype.element_ty), boundary_check=(0, 1))
    lse = (m + tl.log2(l)) * 0.6931471805599453  # back to natural log
    tl.store(L + b * stride_lb + n * stride_ln + rows * stride_lt, lse, mask=rows < T)


@triton.jit
def _attn_bwd_delta_kernel(
    O,
    DO,
    Dl,
    stride_ob,
    stride_on,
    stride_ot,
    stride_oh,
    stride_gb,
    stride_gn,
    stride_gt,
    stride_gh,  # dO
    stride_lb,
    stride_ln,
    stride_lt,
    N,
    T,
    H,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The backward's preprocessing: D = rowsum(dO ∘ O) (B, N, T) in fp32, one pass over O and dO."""
    pid_t = tl.program_id(0)
    pid_bn = tl.program_id(1)
    b = pid_bn // N
    n = pid_bn % N
    o_ptr = tl.make_block_ptr(
        O + b * stride_ob + n * stride_on,
        shape=(T, H),
        strides=(stride_ot, stride_oh),
        offsets=(pid_t * BLOCK_T, 0),
        block_shape=(BLOCK_T, BLOCK_H),
        order=(1, 0),
    )
    g_ptr = tl.make_block_ptr(
        DO + b * stride_gb + n * stride_gn,
        shape=(T, H),
        strides=(stride_gt, stride_gh),
        offsets=(pid_t * BLOCK_T, 0),
        block_shape=(BLOCK_T, BLOCK_H),
        order=(1, 0),
    )
    o = tl.load(o_ptr, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    do = tl.load(g_ptr, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tl.store(
        Dl + b * stride_lb + n * stride_ln + rows * stride_lt, tl.sum(o * do, axis=1), mask=rows < T
    )


@triton.jit
def _bwd_kv_tiles(
    k,
    v,
    dk,
    dv,
    qt_ptr,
    do_ptr,
    l_base,
    d_base,
    dq_base,
    q_lo,
    q_hi,
    cols,
    T,
    S,
    H,
    offset,
    qk_scale,
    scale,
    stride_lt,
    stride_dqt,
    stride_dqh,
    MASKED: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Query tiles [q_lo, q_hi) against one K/V tile: dV += Pᵀ dO, dK += dSᵀ Q [, dQ += dS K atomically].

    ``MASKED`` tiles (the causal diagonal band) apply the visibility mask; the others skip it: a
    zero-padded query row (≥ T) or key column (≥ S) contributes nothing because dO, Q, K or V is
    zero there, so no mask is needed outside the band.
    """
    for q0 in range(q_lo, q_hi, BLOCK_Q):
        qt = tl.load(qt_ptr, boundary_check=(0, 1), padding_option="zero")  # Qᵀ (H, Bq)
        do = tl.load(do_ptr, boundary_check=(0, 1), padding_option="zero")  # dO (Bq, H)
        if UPCAST:
            qt = qt.to(tl.float32)
            do = do.to(tl.float32)
        rows = q0 + tl.arange(0, BLOCK_Q)
        lse = tl.load(l_base + rows * stride_lt, mask=rows < T, other=0.0)  # (Bq,)
        delta = tl.load(d_base + rows * stride_lt, mask=rows < T, other=0.0)  # D (Bq,)
        st = tl.dot(k, qt, input_precision=PRECISION) * qk_scale  # Sᵀ (Bk, Bq), log2 units
        pt = tl.exp2(st - lse[None, :] * 1.4426950408889634)  # Pᵀ recomputed
        if MASKED:
            visible = (cols[:, None] < S) & (rows[None, :] < T)
            if CAUSAL:
                visible = visible & (cols[:, None] <= rows[None, :] + offset)
            pt = tl.where(visible, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)  # dV += Pᵀ dO
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # dPᵀ = V dOᵀ (Bk, Bq)
        dst = pt * (dpt - delta[None, :])  # dSᵀ = Pᵀ ∘ (dPᵀ − D)
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PRECISION)  # dK += dSᵀ Q
        if (
            ATOMIC_DQ
        ):  # FlashAttention-2's single pass: this tile's share of dQ = dS K, added in fp32
            dq = tl.dot(tl.trans(dst).to(k.dtype), k, input_precision=PRECISION) * scale  # (Bq, H)
            hcols = tl.arange(0, BLOCK_H)
            dq_ptrs = dq_base + rows[:, None] * stride_dqt + hcols[None, :] * stride_dqh
            tl.atomic_add(dq_ptrs, dq, mask=(rows[:, None] < T) & (hcols[None, :] < H))
        qt_ptr = tl.advance(qt_ptr, (0, BLOCK_Q))
        do_ptr = tl.advance(do_ptr, (BLOCK_Q, 0))
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    L,
    Dl,
    DK,
    DV,
    DQ,
    stride_qb,
    stride_qn,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_on,
    stride_ot,
    stride_oh,  # dO
    stride_lb,
    stride_ln,
    stride_lt,  # L and D share one layout
    stride_dqb,
    stride_dqn,
    stride_dqt,
    stride_dqh,  # the fp32 dQ accumulator (ATOMIC_DQ only)
    KH,
    G,
    T,
    S,
    H,
    offset,
    qk_scale,
    scale,
    CAUSAL: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):
    pid_k = tl.program_id(0)  # which key tile
    pid_bk = tl.program_id(1)  # which (batch, kv head)
    b = pid_bk // KH
    kv = pid_bk % KH
    k0 = pid_k * BLOCK_K
    k_ptr = tl.make_block_ptr(
        K + b * stride_kb + kv * stride_kn,
        shape=(S, H),
        strides=(stride_ks, stride_kh),
        offsets=(k0, 0),
        block_shape=(BLOCK_K, BLOCK_H),
        order=(1, 0),
    )
    v_ptr = tl.make_block_ptr(
        V + b * stride_vb + kv * stride_vn,
        shape=(S, H),
        strides=(stride_vs, stride_vh),
        offsets=(k0, 0),
        block_shape=(BLOCK_K, BLOCK_H),
        order=(1, 0),
    )
    k = tl.load(k_ptr, boundary_check=(0, 1), padding_option="zero")  # (Bk, H)
    v = tl.load(v_ptr, boundary_check=(0, 1), padding_option="zero")  # (Bk, H)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros((BLOCK_K, BLOCK_H), dtype=tl.float32)
    dv = tl.zeros((BLOCK_K, BLOCK_H), dtype=tl.float32)
    cols = k0 + tl.arange(0, BLOCK_K)
    # Causal: query tiles before q_start never see this key tile; from q_full on, every row of a
    # tile sees every key of it (no mask); between them lies the masked diagonal band.
    if CAUSAL:
        q_start = (tl.maximum(k0 - offset, 0) // BLOCK_Q) * BLOCK_Q
        q_full = tl.minimum(
            tl.cdiv(tl.maximum(k0 + BLOCK_K - 1 - offset, 0), BLOCK_Q) * BLOCK_Q,
            tl.cdiv(T, BLOCK_Q) * BLOCK_Q,
        )
        q_full = tl.maximum(q_full, q_start)
    else:
        q_start = 0
        q_full = 0
    # a partial last key tile stays masked throughout: its zero-padded keys score 0, and exp2(0 − L)
    # must not reach the atomically added dQ (an overflow there would be inf · 0)
    q_full = tl.where(k0 + BLOCK_K > S, tl.cdiv(T, BLOCK_Q) * BLOCK_Q, q_full)
    for g in range(0, G):  # the G query heads that share kv head `kv`
        n = kv * G + g
        l_base = L + b * stride_lb + n * stride_ln
        d_base = Dl + b * stride_lb + n * stride_ln
        dq_base = DQ + b * stride_dqb + n * stride_dqn
        qt_ptr = tl.make_block_ptr(
            Q + b * stride_qb + n * stride_qn,
            shape=(H, T),
            strides=(stride_qh, stride_qt),
            offsets=(0, q_start),
            block_shape=(BLOCK_H, BLOCK_Q),
            order=(0, 1),
        )
        do_ptr = tl.make_block_ptr(
            DO + b * stride_ob + n * stride_on,
            shape=(T, H),
            strides=(stride_ot, stride_oh),
            offsets=(q_start, 0),
            block_shape=(BLOCK_Q, BLOCK_H),
            order=(1, 0),
        )
        dk, dv = _bwd_kv_tiles(
            k,
            v,
            dk,
            dv,
            qt_ptr,
            do_ptr,
            l_base,
            d_base,
            dq_base,
            q_start,
            q_full,
            cols,
            T,
            S,
            H,
            offset,
            qk_scale,
            scale,
            stride_lt,
            stride_dqt,
            stride_dqh,
            True,
            ATOMIC_DQ,
            CAUSAL,
            BLOCK_Q,
            BLOCK_H,
            UPCAST,
            PRECISION,
        )
        qt_ptr = tl.advance(qt_ptr, (0, q_full - q_start))
        do_ptr = tl.advance(do_ptr, (q_full - q_start, 0))
        dk, dv = _bwd_kv_tiles(
            k,
            v,
            dk,
            dv,
            qt_ptr,
            do_ptr,
            l_base,
            d_base,
            dq_base,
            q_full,
            T,
            cols,
            T,
            S,
            H,
            offset,
            qk_scale,
            scale,
            stride_lt,
            stride_dqt,
            stride_dqh,
            False,
            ATOMIC_DQ,
            CAUSAL,
            BLOCK_Q,
            BLOCK_H,
            UPCAST,
            PRECISION,
        )
    dk = dk * scale
    dk_ptr = tl.make_block_ptr(
        DK + b * stride_kb + kv * stride_kn,
        shape=(S, H),
        strides=(stride_ks, stride_kh),
        offsets=(k0, 0),
        block_shape=(BLOCK_K, BLOCK_H),
        order=(1, 0),
    )
    dv_ptr = tl.make_block_ptr(
        DV + b * stride_vb + kv * stride_vn,
        shape=(S, H),
        strides=(stride_vs, stride_vh),
        offsets=(k0, 0),
        block_shape=(BLOCK_K, BLOCK_H),
        order=(1, 0),
    )
    tl.store(dk_ptr, dk.to(DK.dtype.element_ty), boundary_check=(0, 1))
    tl.store(dv_ptr, dv.to(DV.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _bwd_q_tiles(
    q,
    do,
    dq,
    lse,
    delta,
    kt_ptr,
    vt_ptr,
    rows,
    k_lo,
    k_hi,
    S,
    offset,
    qk_scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Key tiles [k_lo, k_hi) against one query tile: dQ += dS K (unscaled). ``MASKED`` as in
    ``_bwd_kv_tiles``: only the diagonal band and a partial last key tile need the mask."""
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kt = tl.load(kt_ptr, boundary_check=(0, 1), padding_option="zero")  # Kᵀ (H, Bk)
        vt = tl.load(vt_ptr, boundary_check=(0, 1), padding_option="zero")  # Vᵀ (H, Bk)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (Bq, Bk)
        p = tl.exp2(s - lse[:, None] * 1.4426950408889634)
        if MASKED:
            cols = k0 + tl.arange(0, BLOCK_K)
            visible = cols[None, :] < S
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + offset)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, vt, input_precision=PRECISION)  # dP = dO Vᵀ (Bq, Bk)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION)  # dQ += dS K
        kt_ptr = tl.advance(kt_ptr, (0, BLOCK_K))
        vt_ptr = tl.advance(vt_ptr, (0, BLOCK_K))
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    L,
    Dl,
    DQ,
    stride_qb,
    stride_qn,
    stride_qt,
    stride_qh,  # Q and dQ share one layout
    stride_kb,
    stride_kn,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_on,
    stride_ot,
    stride_oh,
    stride_lb,
    stride_ln,
    stride_lt,
    N,
    G,
    T,
    S,
    H,
    offset,
    qk_scale,
    scale,
    CAUSAL: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_q = tl.num_programs(0) - 1 - tl.program_id(0)  # causal: the longest rows start first
    pid_bn = tl.program_id(1)
    b = pid_bn // N
    n = pid_bn % N
    kv = n // G
    q0 = pid_q * BLOCK_Q
    q_ptr = tl.make_block_ptr(
        Q + b * stride_qb + n * stride_qn,
        shape=(T, H),
        strides=(stride_qt, stride_qh),
        offsets=(q0, 0),
        block_shape=(BLOCK_Q, BLOCK_H),
        order=(1, 0),
    )
    do_ptr = tl.make_block_ptr(
        DO + b * stride_ob + n * stride_on,
        shape=(T, H),
        strides=(stride_ot, stride_oh),
        offsets=(q0, 0),
        block_shape=(BLOCK_Q, BLOCK_H),
        order=(1, 0),
    )
    kt_ptr = tl.make_block_ptr(
        K + b * stride_kb + kv * stride_kn,
        shape=(H, S),
        strides=(stride_kh, stride_ks),
        offsets=(0, 0),
        block_shape=(BLOCK_H, BLOCK_K),
        order=(0, 1),
    )
    vt_ptr = tl.make_block_ptr(
        V + b * stride_vb + kv * stride_vn,
        shape=(H, S),
        strides=(stride_vh, stride_vs),
        offsets=(0, 0),
        block_shape=(BLOCK_H, BLOCK_K),
        order=(0, 1),
    )
    q = tl.load(q_ptr, boundary_check=(0, 1), padding_option="zero")  # (Bq, H)
    do = tl.load(do_ptr, boundary_check=(0, 1), padding_option="zero")  # (Bq, H)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    rows = q0 + tl.arange(0, BLOCK_Q)
    lse = tl.load(L + b * stride_lb + n * stride_ln + rows * stride_lt, mask=rows < T, other=0.0)
    delta = tl.load(Dl + b * stride_lb + n * stride_ln + rows * stride_lt, mask=rows < T, other=0.0)
    dq = tl.zeros((BLOCK_Q, BLOCK_H), dtype=tl.float32)
    # Key tiles that the tile's first row already sees in full need no mask (as in the forward).
    if CAUSAL:
        hi = tl.minimum(q0 + BLOCK_Q + offset, S)
        n_full = tl.maximum(tl.minimum(q0 + offset + 1, S), 0) // BLOCK_K
    else:
        hi = S
        n_full = S // BLOCK_K
    dq = _bwd_q_tiles(
        q,
        do,
        dq,
        lse,
        delta,
        kt_ptr,
        vt_ptr,
        rows,
        0,
        n_full * BLOCK_K,
        S,
        offset,
        qk_scale,
        False,
        CAUSAL,
        BLOCK_K,
        UPCAST,
        PRECISION,
    )
    kt_ptr = tl.advance(kt_ptr, (0, n_full * BLOCK_K))
    vt_ptr = tl.advance(vt_ptr, (0, n_full * BLOCK_K))
    dq = _bwd_q_tiles(
        q,
        do,
        dq,
        lse,
        delta,
        kt_ptr,
        vt_ptr,
        rows,
        n_full * BLOCK_K,
        hi,
        S,
        offset,
        qk_scale,
        True,
        CAUSAL,
        BLOCK_K,
        UPCAST,
        PRECISION,
    )
    dq = dq * scale
    dq_ptr = tl.make_block_ptr(
        DQ + b * stride_qb + n * stride_qn,
        shape=(T, H),
        strides=(stride_qt, stride_qh),
        offsets=(q0, 0),
        block_shape=(BLOCK_Q, BLOCK_H),
        order=(1, 0),
    )
    tl.store(dq_ptr, dq.to(DQ.dtype.element_ty), boundary_check=(0, 1))


def _gpu_configs(pairs: list[tuple[int, int, int, int]]) -> list:
    return [
        triton.Config({"BLOCK_Q": bq, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bq, bk, w, st in pairs
    ]


# On a GPU the tile sizes are autotuned per (T, S, H, causal) among the usual FlashAttention-2
# choices; a config that does not fit the SM's shared memory is skipped by the autotuner.
# (BLOCK_Q, BLOCK_K, num_warps, num_stages)
_FWD_CONFIGS = _gpu_configs(
    [
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 32, 4, 3),
        (64, 64, 4, 3),
        (128, 128, 8, 2),
        (64, 32, 4, 4),
    ]
)
_DKDV_CONFIGS = _gpu_configs(
    [
        (32, 128, 8, 2),
        (32, 128, 8, 3),
        (32, 64, 4, 3),
        (32, 64, 8, 3),
        (64, 64, 8, 2),
        (64, 64, 8, 3),
        (64, 128, 8, 2),
        (16, 64, 4, 3),
    ]
)
_DQ_CONFIGS = _gpu_configs(
    [(128, 32, 4, 3), (64, 32, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2), (64, 16, 4, 3)]
)
# fp32 tiles are twice the bytes and take ieee dots: large tiles spill registers and take minutes
# to compile, so fp32 (and H > 64 in any dtype, for the largest tiles) gets small tiles only.
_FP32_CONFIGS = _gpu_configs([(32, 32, 4, 2), (64, 32, 4, 2)])
_KEY = ["T", "S", "H", "CAUSAL"]


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    if named_args["Q"].dtype == torch.float32:
        return _FP32_CONFIGS
    if named_args["H"] > 64:
        return [
            c for c in configs if c.kwargs["BLOCK_Q"] * c.kwargs["BLOCK_K"] <= 128 * 64
        ] or configs[:1]
    return configs


def _autotune(kernel, configs, reset_to_zero=None):
    return triton.autotune(
        configs=configs,
        key=_KEY,
        prune_configs_by={"early_config_prune": _prune},
        reset_to_zero=reset_to_zero,
    )(kernel)


_attn_fwd_tuned = _autotune(_attn_fwd_kernel, _FWD_CONFIGS)
# two autotuned twins of the K/V-tile kernel: with atomic dQ the best tiles differ, and a tuner
# must not time a config with one mode and run it with the other. The tuner runs each candidate on
# the real buffers, so the atomic twin zeroes the dQ accumulator before every trial and after.
_attn_bwd_kv_tuned = {
    False: _autotune(_attn_bwd_dkdv_kernel, _DKDV_CONFIGS),
    True: _autotune(_attn_bwd_dkdv_kernel, _DKDV_CONFIGS, reset_to_zero=["DQ"]),
}
_attn_bwd_dq_tuned = _autotune(_attn_bwd_dq_kernel, _DQ_CONFIGS)


def _launch(
    kernel,
    tuned,
    grid_of,
    args: tuple,
    q: Tensor,
    causal: bool,
    block_q: int | None,
    block_k: int | None,
    **constexprs,
) -> None:
    """Launch ``kernel`` with fixed tiles (interpreter, or tiles given by the caller) or its autotuned
    twin (GPU). ``grid_of(BLOCK_Q, BLOCK_K)`` gives the grid."""
    H = q.shape[-1]
    fixed = dict(
        CAUSAL=causal,
        BLOCK_H=max(16, triton.next_power_of_2(H)),
        UPCAST=_interpreting(),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **constexprs,
    )
    for name, val in (("block_q", block_q), ("block_k", block_k)):
        if val is not None and (val < 16 or val & (val - 1)):
            raise ValueError(f"{name}={val}: Triton tiles must be powers of two ≥ 16")
    if _interpreting() or block_q or block_k:
        # the interpreter runs one numpy step per tile: 32 × 32 tiles keep the tests quick
        bq, bk = (
            block_q or (32 if _interpreting() else 64),
            block_k or (32 if _interpreting() else 64),
        )
        kernel[grid_of(bq, bk)](*args, BLOCK_Q=bq, BLOCK_K=bk, **fixed)
    else:
        tuned[lambda meta: grid_of(meta["BLOCK_Q"], meta["BLOCK_K"])](*args, **fixed)


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    if (
        q.dim() != 4
        or k.shape != v.shape
        or k.dim() != 4
        or q.shape[0] != k.shape[0]
        or q.shape[3] != k.shape[3]
    ):
        raise ValueError(
            f"expected q (B, N, T, H) and k, v (B, K, S, H); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"n_kv_heads K={k.shape[1]} does not divide n_heads N={q.shape[1]}")
    if (
        q.dtype not in (torch.float32, torch.float16, torch.bfloat16)
        or k.dtype != q.dtype
        or v.dtype != q.dtype
    ):
        raise ValueError(
            f"flash_triton supports fp32/fp16/bf16 with one dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (16 <= q.shape[-1] <= 256):
        raise ValueError(f"head dim H={q.shape[-1]}; flash_triton supports 16 ≤ H ≤ 256")
    if q.device.type == "cpu" and not _interpreting():
        raise ValueError(
            "flash_triton needs a CUDA device, or TRITON_INTERPRET=1 (set before triton is "
            "imported) to run the kernels on CPU"
        )


def triton_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel. Returns O (B, N, T, H) in q.dtype and L (B, N, T) fp32."""
    _check(q, k, v)
    B, N, T, H = q.shape
    K, S = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(B, N, T, dtype=torch.float32, device=q.device)
    args = (
        q,
        k,
        v,
        out,
        lse,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        *lse.stride(),
        N,
        N // K,
        T,
        S,
        H,
        S - T,
        scale * LOG2E,
    )
    _launch(
        _attn_fwd_kernel,
        _attn_fwd_tuned,
        lambda bq, bk: (triton.cdiv(T, bq), B * N),
        args,
        q,
        causal,
        block_q,
        block_k,
    )
    return out, lse


def backward_mode() -> str:
    """Which backward runs: ``atomic`` (FlashAttention-2's one pass over K/V tiles; dQ is added into
    an fp32 buffer with atomics, so its bits depend on the order of the adds, as with SDPA's flash
    backward) or ``split`` (a dK/dV kernel, then a dQ kernel that recomputes P again: two more
    matmuls per tile pair, but every output is written once and the result is deterministic).

    ``LMSTACK_FLASH_BWD=atomic|split`` chooses; the default is ``atomic``, and ``split`` whenever
    ``torch.use_deterministic_algorithms(True)`` is on.
    """
    mode = os.environ.get("LMSTACK_FLASH_BWD", "auto")
    if mode not in ("auto", "atomic", "split"):
        raise ValueError(f"LMSTACK_FLASH_BWD={mode!r}; expected 'atomic', 'split' or 'auto'")
    if mode == "auto":
        return "split" if torch.are_deterministic_algorithms_enabled() else "atomic"
    return mode


def triton_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """D = rowsum(dO ∘ O), then the backward kernels (``backward_mode()``). Returns dQ, dK, dV."""
    B, N, T, H = q.shape
    K, S = k.shape[1], k.shape[2]
    atomic = backward_mode() == "atomic"
    dout = dout.contiguous() if dout.stride(-1) != 1 else dout
    lse = lse.contiguous()
    delta = torch.empty_like(lse)  # D = rowsum(dO ∘ O) (B, N, T), fp32
    block_h = max(16, triton.next_power_of_2(H))
    block_t = (
        32 if _interpreting() else max(16, 8192 // block_h)
    )  # two (Bt, H) fp32 tiles fit in registers
    _attn_bwd_delta_kernel[(triton.cdiv(T, block_t), B * N)](
        out,
        dout,
        delta,
        *out.stride(),
        *dout.stride(),
        *delta.stride(),
        N,
        T,
        H,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
    )
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    # atomic: an fp32 accumulator, zeroed, cast to q.dtype at the end; split: dQ written with Q's strides
    dq_acc = torch.zeros(B, N, T, H, dtype=torch.float32, device=q.device) if atomic else dk
    common = (T, S, H, S - T, scale * LOG2E, scale)
    args = (
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dk,
        dv,
        dq_acc,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dout.stride(),
        *lse.stride(),
        *(dq_acc.stride() if atomic else (0, 0, 0, 0)),
        K,
        N // K,
        *common,
    )
    _launch(
        _attn_bwd_dkdv_kernel,
        _attn_bwd_kv_tuned[atomic],
        lambda bq, bk: (triton.cdiv(S, bk), B * K),
        args,
        q,
        causal,
        block_q,
        block_k,
        ATOMIC_DQ=atomic,
    )
    if atomic:
        return dq_acc.to(q.dtype), dk, dv
    dq = torch.empty_like(q)
    if dq.stride() != q.stride():  # the dQ kernel writes dQ with Q's strides
        q = q.contiguous()
        dq = torch.empty_like(q)
    args = (
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dq,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dout.stride(),
        *lse.stride(),
        N,
        N // K,
        *common,
    )
    _launch(
        _attn_bwd_dq_kernel,
        _attn_bwd_dq_tuned,
        lambda bq, bk: (triton.cdiv(T, bq), B * N),
        args,
        q,
        causal,
        block_q,
        block_k,
    )
    return dq, dk, dv


FlashAttentionTriton = make_flash_function(
    "FlashAttentionTriton",
    triton_attention_forward,
    triton_attention_backward,
    "FlashAttention-2 with Triton kernels; saves Q, K, V, O and L (B, N, T) only.",
)


def flash_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
):
    """FlashAttention-2 (Triton). q (B, N, T, H), k/v (B, K, S, H) -> O (B, N, T, H) [, L (B, N, T)]."""
    out, lse = FlashAttentionTriton.apply(q, k, v, causal, scale, block_q, block_k)
    return (out, lse) if return_lse else out
