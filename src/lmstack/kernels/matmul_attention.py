"""Attention for CPU training: matmuls in the input dtype, scores and softmax in fp32.

Book of LLMs §1.2 (scaled scores, softmax, P V), §1.3 (mask: True = may attend), §2.7 (the backward
of attention: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ⊙ (dP − rowsum(P ⊙ dP)), dQ = dS K·s, dK = dSᵀ Q·s).

Why it exists: on CPU the bf16 *backward* of ``F.scaled_dot_product_attention`` (its flash
kernel) costs about six times its forward and ~20–25% of a small model's training step
(docs/training.md). For the sequence lengths a CPU trains at, a block of the (T, S) matrix fits in
cache, so the plain formula with batched matmuls runs on the AMX bf16 matmul units.

Causal (block-triangular): the queries are cut into row blocks (``row_blocks``); row block
[t0, t1) is multiplied only against keys [0, e), e = t1 + S − T (bottom-right aligned: query i
sees key j iff j <= i + S − T), so the fully masked blocks right of the diagonal are never
computed, forward or backward. With an explicit mask, e is the last key any row of the block may
see (a causal document mask skips the same blocks). Backward recomputes P block by block; dQ of a
row block is one matmul, dK and dV add each row block's Pᵀ dO / dSᵀ Q over keys [0, e) into fp32
sums. Every matmul operand is a contiguous tensor (per-block copies of Q and dO, prefixes of K and
V): the CPU bf16 batched matmul copies any other layout on every call.

Precision: Q Kᵀ, P V and the four backward matmuls take inputs in q's dtype (bf16 under autocast)
and accumulate in fp32 inside the matmul; the scaled scores, the mask, the softmax, P recomputed
for backward and the softmax backward are fp32 — the precision HF's eager attention uses (bf16
scores upcast before the softmax). In fp32 everything is fp32.

GQA (K kv heads, N = K·G query heads): the G query heads sharing a kv head are stacked along the
rows, (B, K, T·G, H) with row t·G + g = query t of head g, so one matmul per kv head serves the
whole group, a row block is a contiguous run of rows, and dK, dV come out summed over the group
without expanding K or V. A query row that sees no key gives NaN (as softmax over an empty set;
such inputs skip SDPA's forward, which would give 0); causal, window and document masks always
let a token see itself.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

_CAUSAL_BIAS: dict[tuple[int, int, torch.device], Tensor] = {}


def causal_bias(T: int, S: int, device: torch.device) -> Tensor:
    """fp32 (T, 1, S) additive mask: 0 where key j <= i + S - T (bottom-right aligned), -inf after.

    The middle axis broadcasts over the G query heads of a kv head (rows are laid out (T, G)).
    """
    key = (T, S, torch.device(device))
    if key not in _CAUSAL_BIAS:
        i = torch.arange(T, device=device)[:, None]
        j = torch.arange(S, device=device)[None, :]
        bias = torch.zeros(T, S, device=device).masked_fill_(j > i + (S - T), -math.inf)
        _CAUSAL_BIAS[key] = bias[:, None, :]
    return _CAUSAL_BIAS[key]


def mask_bias(mask: Tensor) -> Tensor:
    """Boolean mask (True = may attend), any shape broadcastable to (B, N, T, S) -> fp32 0 / -inf."""
    if mask.dtype != torch.bool:
        raise TypeError(f"mask dtype={mask.dtype}; expected torch.bool (True = may attend)")
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, -math.inf)


# Rows of scores handled at once: (chunk of B)·K·G·(row block)·S fp32 values near 1 MB, so the
# matmul, add, softmax, conversions and softmax backward of one block run in the L2 cache, in
# scratch buffers reused from block to block. Nothing of size (B, ·, T, S) is kept between forward
# and backward: the first touch of fresh whole-batch P buffers (page faults) cost more here than
# recomputing P block by block in backward.
CHUNK_SCORES = 1 << 18
# Query rows per block for causal (and mask-limited) attention: row block [t0, t1) is multiplied
# only against keys [0, e) with e = t1 + S - T, the last key any of its rows may see; the fully
# masked blocks right of it are never computed (the block-triangular scheme). Blocks are
# max(ROW_BLOCK, T / ROW_BLOCKS) rows: the CPU bf16 batched matmul costs ~10 µs per matrix, so
# many thin blocks lose more than the skipped scores save (docs/training.md: at T = 1024, 4 blocks
# of 256 beat 8 of 128 and 16 of 64; at T = 256, 2 blocks of 128 and 4 of 64 are within a few %,
# both ~15% faster than one block). Below MIN_BLOCKED_T query rows the whole (T, S) matrix is one
# block.
ROW_BLOCK = 128
ROW_BLOCKS = 4
MIN_BLOCKED_T = 256
# Forward through F.scaled_dot_product_attention (its CPU flash kernel: fp32 scores and online
# softmax, skips the masked blocks; faster than the blocked forward, docs/training.md);
# the backward needs only q, k, v, as it recomputes P.
SDPA_FORWARD = True
_SCRATCH: dict[tuple, Tensor] = {}


def _scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A block-sized buffer kept between calls (fresh ~1 MB allocations page-fault on every call here).

    Only ever used inside one forward or backward call and never saved, so reuse across calls and
    layers is safe. One flat buffer per (name, dtype, device), grown when a larger block asks, so
    varying sequence lengths never pile up buffers.
    """
    key = (name, dtype, torch.device(device))
    n = math.prod(shape)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n].view(shape)


def row_blocks(
    T: int, S: int, causal: bool, mask: Tensor | None = None, block: int | None = None
) -> list[tuple[int, int, int]]:
    """[(t0, t1, e)]: query rows [t0, t1) need keys [0, e) only; e never decreases from block to block.

    ``block`` rows per block (default: the policy above, one block below MIN_BLOCKED_T rows).

    causal: e = t1 + S - T (bottom-right aligned: query i sees key j iff j <= i + S - T); mask: e is
    one past the last key any row of the block (in any batch row) may see, made non-decreasing by a
    running maximum; neither: one block of all rows and keys. e >= 1, so a row that sees no key still
    gives NaN. Consecutive blocks with the same e are merged (one matmul instead of two).
    """
    R = max(ROW_BLOCK, -(-T // ROW_BLOCKS)) if block is None else block
    if (block is None and T < MIN_BLOCKED_T) or (not causal and mask is None):
        R = max(T, 1)
    bounds = [(t0, min(T, t0 + R)) for t0 in range(0, T, R)] if T else [(0, 0)]
    if causal:
        ends = [t1 + S - T for _, t1 in bounds]
    elif mask is not None and len(bounds) > 1:
        m = torch.broadcast_to(mask, mask.shape[:-2] + (T, S)).reshape(-1, T, S).any(0)  # (T, S)
        last = (m * torch.arange(1, S + 1, device=m.device)).amax(
            -1
        )  # (T,) one past each row's last key
        ends = torch.stack([last[t0:t1].amax() for t0, t1 in bounds]).tolist()
    else:
        ends = [S] * len(bounds)
    blocks: list[tuple[int, int, int]] = []
    e = 1
    for (t0, t1), end in zip(bounds, ends):
        e = max(e, min(S, int(end)))
        if blocks and blocks[-1][2] == e:
            blocks[-1] = (blocks[-1][0], t1, e)
        else:
            blocks.append((t0, t1, e))
    return blocks


def _row_blocks_of(x: Tensor, K: int, blocks: list[tuple[int, int, int]]) -> list[Tensor]:
    """(B, N, T, H) -> one contiguous (B, K, r·G, H) tensor per row block [t0, t1): row (t - t0)·G + g is
    query t of head g of kv head k's group. Contiguous per block because the CPU bf16 batched matmul
    copies any operand that is not (one copy of x in all, as reshaping x to the matmul layout costs anyway)."""
    B, N, T, H = x.shape
    xg = x.unflatten(1, (K, N // K)).transpose(2, 3)  # (B, K, T, G, H), a view
    return [xg[:, :, t0:t1].reshape(B, K, (t1 - t0) * (N // K), H) for t0, t1, _ in blocks]


def _prefixes(x: Tensor, blocks: list[tuple[int, int, int]]) -> list[Tensor]:
    """Contiguous x[:, :, :e] (B, K, e, H) for each block's key extent e (sliced operands would be copied
    by every matmul instead)."""
    S = x.shape[2]
    return [x if e == S else x[:, :, :e].contiguous() for _, _, e in blocks]


def _heads(y: Tensor, N: int, scale: float | None = None) -> Tensor:
    """(B, K, T·G, H) -> (B, N, T, H), a transposed view of a contiguous (B, T, N, H) buffer (what the
    model's output projection reads), optionally multiplied by ``scale`` in the same pass."""
    B, K, TG, H = y.shape
    G = N // K
    T = TG // G
    out = torch.empty(B, T, K, G, H, dtype=y.dtype, device=y.device)
    src = y.view(B, K, T, G, H).transpose(1, 2)
    if scale is None:
        out.copy_(src)
    else:
        torch.mul(src, scale, out=out)
    return out.view(B, T, N, H).transpose(1, 2)


def _bias_block(bias: Tensor | None, b0: int, b1: int, t0: int, t1: int, e: int) -> Tensor | None:
    """The bias of batch rows [b0, b1), query rows [t0, t1), keys [0, e): (r, 1, e) or (b, 1, r, 1, e)."""
    if bias is None:
        return None
    if bias.dim() == 3:  # causal (T, 1, S)
        return bias[t0:t1, :, :e]
    bb = bias[b0:b1] if bias.shape[0] > 1 else bias  # per-row masks (B, 1, T, 1, S)
    bb = bb[:, :, t0:t1] if bb.shape[2] > 1 else bb  # a (B, 1, 1, S) mask broadcasts over the rows
    return bb[..., :e] if bb.shape[-1] > 1 else bb


def _probs(
    qb: Tensor, kt: Tensor, bias: Tensor | None, scale: float, s_buf: Tensor, p_buf: Tensor
) -> Tensor:
    """P = softmax(Q Kᵀ·s + bias) of one block, fp32, written into p_buf. qb (b, K, r·G, H), kt (b, K, H, e)."""
    b, K, rG, e = p_buf.shape
    if s_buf.dtype == torch.float32:
        s_buf = p_buf
    torch.matmul(qb, kt, out=s_buf)  # scores in q's dtype (fp32 accumulation inside the matmul)
    if s_buf is not p_buf:
        p_buf.copy_(
            s_buf
        )  # fp32 scores (an add of mixed dtypes would allocate an fp32 temporary each call)
    if bias is None:
        p_buf.mul_(scale)
    else:  # bias + s·scale in one pass, broadcast over K and G
        r = bias.shape[-3]
        p5 = p_buf.view(b, K, r, rG // r, e)
        torch.add(bias, p5, alpha=scale, out=p5)
    return torch._softmax(p_buf, -1, False, out=p_buf)  # in place, fp32


def _batch_step(KG: int, blocks: list[tuple[int, int, int]]) -> int:
    """Batch rows per chunk: about CHUNK_SCORES scores in the largest row block."""
    rmax = max(t1 - t0 for t0, t1, _ in blocks)
    return max(1, CHUNK_SCORES // max(1, KG * rmax * blocks[-1][2]))


class MatmulAttention(torch.autograd.Function):
    """O = softmax(Q Kᵀ·s + bias) V with fp32 scores, block-triangular over query rows; backward
    recomputes P (fp32) block by block."""

    @staticmethod
    def forward(
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        scale: float,
        blocks: list[tuple[int, int, int]],
        sdpa: tuple[Tensor | None, bool] | None,
    ) -> Tensor:
        B, N, T, H = q.shape
        K = k.shape[1]
        G = N // K
        ctx.scale, ctx.N, ctx.blocks, ctx.sdpa = scale, N, blocks, sdpa is not None
        if sdpa is not None:  # SDPA's fused forward; backward below recomputes P from q, k, v alone
            ctx.save_for_backward(q, k, v, bias)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=sdpa[0], is_causal=sdpa[1], scale=scale, enable_gqa=G > 1
            )
        k, v = k.contiguous(), v.contiguous()
        qb = _row_blocks_of(q, K, blocks)  # per row block (B, K, r·G, H)
        kp, vp = _prefixes(k, blocks), _prefixes(v, blocks)  # per row block (B, K, e, H)
        step = _batch_step(K * G, blocks)
        out = torch.empty(B, K, T * G, H, dtype=v.dtype, device=q.device)
        for b0 in range(0, B, step):
            b1 = min(B, b0 + step)
            for i, (t0, t1, e) in enumerate(blocks):
                shape = (b1 - b0, K, (t1 - t0) * G, e)
                s_buf = _scratch("s", shape, q.dtype, q.device)
                pc = _probs(
                    qb[i][b0:b1],
                    kp[i][b0:b1].transpose(-2, -1),
                    _bias_block(bias, b0, b1, t0, t1, e),
                    scale,
                    s_buf,
                    _scratch("p", shape, torch.float32, q.device),
                )
                if v.dtype != torch.float32:
                    pc = _scratch("p_lp", shape, v.dtype, q.device).copy_(pc)
                torch.matmul(
                    pc, vp[i][b0:b1], out=out[b0:b1, :, t0 * G : t1 * G]
                )  # O = P V, (b, K, r·G, H)
        ctx.save_for_backward(k, v, bias, *qb)
        return _heads(out, N)

    @staticmethod
    def backward(ctx, d_out: Tensor):
        N, blocks, scale = ctx.N, ctx.blocks, ctx.scale
        if ctx.sdpa:
            q, k, v, bias = ctx.saved_tensors
            k, v = k.contiguous(), v.contiguous()
            qb = _row_blocks_of(q, k.shape[1], blocks)
        else:
            k, v, bias, *qb = ctx.saved_tensors
        B, K, S, H = k.shape
        G = N // K
        T = blocks[-1][1]
        step = _batch_step(K * G, blocks)
        f32 = torch.float32
        dob = _row_blocks_of(d_out.to(v.dtype), K, blocks)  # per row block (B, K, r·G, H)
        kp, vp = _prefixes(k, blocks), _prefixes(v, blocks)
        dq = torch.empty(B, K, T * G, H, dtype=qb[0].dtype, device=k.device)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        one = len(blocks) == 1
        for b0 in range(0, B, step):
            b1 = min(B, b0 + step)
            n = b1 - b0
            if not one:  # several row blocks add into dK, dV: fp32 sums of their (bf16-rounded) matmul outputs
                dk32 = _scratch("dk32", (n, K, S, H), f32, k.device)
                dv32 = _scratch("dv32", (n, K, S, H), f32, k.device)
            # the widest block first: it covers all keys any row sees, so it sets the sums instead of adding
            for i in reversed(range(len(blocks))):
                t0, t1, e = blocks[i]
                shape = (n, K, (t1 - t0) * G, e)
                s_buf = _scratch("s", shape, k.dtype, k.device)
                pc = _probs(
                    qb[i][b0:b1],
                    kp[i][b0:b1].transpose(-2, -1),
                    _bias_block(bias, b0, b1, t0, t1, e),
                    scale,
                    s_buf,
                    _scratch("p", shape, f32, k.device),
                )  # the forward's P, recomputed
                p_lp = (
                    pc if v.dtype == f32 else _scratch("p_lp", shape, v.dtype, k.device).copy_(pc)
                )
                do = dob[i][b0:b1]
                dp = torch.matmul(
                    do, vp[i][b0:b1].transpose(-2, -1), out=s_buf
                )  # dP = dO Vᵀ (b, K, r·G, e)
                if dp.dtype != f32:
                    dp = _scratch("dp32", shape, f32, k.device).copy_(dp)
                ds = torch._softmax_backward_data(
                    dp, pc, -1, f32, grad_input=_scratch("ds32", shape, f32, k.device)
                )
                if ds.dtype != qb[i].dtype:  # P ⊙ (dP − rowsum(P ⊙ dP)) in the matmul dtype
                    ds = _scratch("ds_lp", shape, qb[i].dtype, k.device).copy_(ds)
                torch.matmul(
                    ds, kp[i][b0:b1], out=dq[b0:b1, :, t0 * G : t1 * G]
                )  # dQ = dS K (·s below)
                if one:
                    torch.matmul(
                        p_lp.transpose(-2, -1), do, out=dv[b0:b1]
                    )  # dV = Pᵀ dO, summed over the group
                    torch.matmul(
                        ds.transpose(-2, -1), qb[i][b0:b1], out=dk[b0:b1]
                    )  # dK = dSᵀ Q (·s below)
                    continue
                part = _scratch("part", (n, K, e, H), v.dtype, k.device)
                for acc, a, b in ((dv32, p_lp, do), (dk32, ds, qb[i][b0:b1])):
                    torch.matmul(a.transpose(-2, -1), b, out=part)  # dV += Pᵀ dO, dK += dSᵀ Q
                    if i == len(blocks) - 1:
                        acc[:, :, :e].copy_(part)
                        acc[:, :, e:].zero_()  # keys no query sees
                    else:
                        acc[:, :, :e].add_(part)
            if not one:
                dk[b0:b1].copy_(dk32.mul_(scale))
                dv[b0:b1].copy_(dv32)
        return _heads(dq, N, scale), (dk.mul_(scale) if one else dk), dv, None, None, None, None


def matmul_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    block: int | None = None,
) -> Tensor:
    """softmax(Q Kᵀ/√H + mask) V with fp32 scores/softmax and matmuls in q's dtype.

    q: (B, N, T, H); k, v: (B, K, S, H) with N a multiple of K; mask: bool, True = may attend,
    broadcastable to (B, 1, T, S) (it is broadcast over heads) — or ``causal=True`` for the
    bottom-right-aligned causal mask. Under autocast the inputs are cast to the autocast dtype.
    ``block``: query rows per row block (default: ``row_blocks``' policy). -> (B, N, T, H) in q's
    (compute) dtype.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (B, heads, seq, H); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, N, T, H = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != H or N % k.shape[1]:
        raise ValueError(
            f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {tuple(q.shape)}: expected (B, K, S, H) "
            "with N a multiple of K"
        )
    if mask is not None and causal:
        raise ValueError("give either mask or causal=True, not both")
    S = k.shape[2]
    dtype = q.dtype
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if mask is not None:
        bias = mask_bias(mask)
        bias = (
            bias.reshape(bias.shape[:-2] + (1,) * (4 - bias.dim()) + bias.shape[-2:])
            if bias.dim() < 4
            else bias
        )
        if bias.shape[1] != 1:
            raise ValueError(
                f"mask shape {tuple(mask.shape)}: expected one mask for all heads, (B, 1, T, S) or (T, S)"
            )
        bias = bias[
            :, :, :, None
        ]  # (B, 1, T, 1, S): broadcast over K and G (rows are laid out (T, G))
    elif causal:
        bias = causal_bias(T, S, q.device)  # (T, 1, S)
    else:
        bias = None
    blocks = row_blocks(T, S, causal, mask, block=block)
    scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
    sdpa: tuple[Tensor | None, bool] | None = None
    # SDPA's forward gives 0 for a query row that sees no key where this module's backward gives NaN:
    # such inputs (T > S causal, masks with empty rows) take the matmul forward, NaN in both passes
    if SDPA_FORWARD and (T <= S if causal else mask is None or bool(mask.any(-1).all())):
        if causal and T != S:
            assert bias is not None  # causal: causal_bias above
            sdpa = (bias[:, 0] == 0, False)  # bottom-right aligned: SDPA's is_causal is top-left
        else:
            sdpa = (mask, causal)
    with torch.autocast(q.device.type, enabled=False):
        return MatmulAttention.apply(q, k, v, bias, scale, blocks, sdpa)
