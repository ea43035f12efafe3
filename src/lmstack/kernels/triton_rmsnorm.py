"""Fused RMSNorm in Triton, forward and backward (dx and dγ).

Book of LLMs §1.10 (RMSNorm: y = x / sqrt(mean(x²) + eps) ⊙ γ); CS336 notes "优化技巧 / 算子混合"
(one kernel instead of square, mean, rsqrt, multiply, multiply: x is read from HBM once per
pass, y written once) and "Triton Kernel" (the block-pointer style the seed shows: a grid of
programs over row tiles, each walking the D dimension tile by tile with ``advance``, partial
tiles zero-padded by ``boundary_check``).

Shapes: x (M, D) with M = product of the leading dims; γ (D,); rstd r = 1/sqrt(mean(x²) + eps)
(M,) fp32 is the only thing saved for backward besides x and γ.

Backward, with g = dy ⊙ γ and x̂ = x·r:
    dx = r · (g − x̂ · mean(g ⊙ x̂))        dγ = Σ_rows dy ⊙ x̂
Each program writes its row tile's partial dγ; the partials are summed afterwards in fp32.
Numerics follow ``lmstack.model.layers.RMSNorm``: compute in fp32, cast x̂ to x's dtype,
then multiply by γ.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rmsnorm_fwd_kernel(
    X,
    W,
    Y,
    R,
    stride_xm,
    stride_xd,
    stride_ym,
    stride_yd,
    M,
    D,
    eps,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    X_DTYPE: tl.constexpr,
):
    row0 = tl.program_id(0) * ROWS
    x_ptr = tl.make_block_ptr(
        X,
        shape=(M, D),
        strides=(stride_xm, stride_xd),
        offsets=(row0, 0),
        block_shape=(ROWS, BLOCK_D),
        order=(1, 0),
    )
    # pass 1: sum of squares over D, tile by tile
    sumsq = tl.zeros((ROWS,), dtype=tl.float32)
    for _ in range(0, tl.cdiv(D, BLOCK_D)):
        x = tl.load(x_ptr, boundary_check=(0, 1), padding_option="zero").to(
            tl.float32
        )  # (ROWS, BLOCK_D)
        sumsq += tl.sum(x * x, axis=1)
        x_ptr = tl.advance(x_ptr, (0, BLOCK_D))
    r = 1.0 / tl.sqrt(sumsq / D + eps)  # rstd (ROWS,)
    rows = row0 + tl.arange(0, ROWS)
    tl.store(R + rows, r, mask=rows < M)
    # pass 2: y = (x·r cast to x's dtype) · γ
    x_ptr = tl.make_block_ptr(
        X,
        shape=(M, D),
        strides=(stride_xm, stride_xd),
        offsets=(row0, 0),
        block_shape=(ROWS, BLOCK_D),
        order=(1, 0),
    )
    w_ptr = tl.make_block_ptr(
        W, shape=(D,), strides=(1,), offsets=(0,), block_shape=(BLOCK_D,), order=(0,)
    )
    y_ptr = tl.make_block_ptr(
        Y,
        shape=(M, D),
        strides=(stride_ym, stride_yd),
        offsets=(row0, 0),
        block_shape=(ROWS, BLOCK_D),
        order=(1, 0),
    )
    for _ in range(0, tl.cdiv(D, BLOCK_D)):
        x = tl.load(x_ptr, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        w = tl.load(w_ptr, boundary_check=(0,), padding_option="zero").to(tl.float32)
        xhat = (x * r[:, None]).to(X_DTYPE).to(tl.float32)
        tl.store(y_ptr, (xhat * w[None, :]).to(Y.dtype.element_ty), boundary_check=(0, 1))
        x_ptr = tl.advance(x_ptr, (0, BLOCK_D))
        w_ptr = tl.advance(w_ptr, (BLOCK_D,))
        y_ptr = tl.advance(y_ptr, (0, BLOCK_D))


@triton.jit
def _rmsnorm_bwd_kernel(
    X,
    W,
    DY,
    R,
    DX,
    DW_PARTIAL,
    stride_xm,
    stride_xd,
    stride_dym,
    stride_dyd,
    stride_dxm,
    stride_dxd,
    M,
    D,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    row0 = pid * ROWS
    rows = row0 + tl.arange(0, ROWS)
    r = tl.load(R + rows, mask=rows < M, other=0.0)  # (ROWS,)
    # pass 1: c = mean over D of (dy ⊙ γ) ⊙ x̂
    x_ptr = tl.make_block_ptr(
        X,
        shape=(M, D),
        strides=(stride_xm, stride_xd),
        offsets=(row0, 0),
        block_shape=(ROWS, BLOCK_D),
        order=(1, 0),
    )
    dy_ptr = tl.make_block_ptr(
        DY,
        shape=(M, D),
        strides=(stride_dym, stride_dyd),
        offsets=(row0, 0),
        block_shape=(ROWS, BLOCK_D),
        order=(1, 0),
    )
    w_ptr = tl.make_block_ptr(
        W, shape=(D,), strides=(1,), offsets=(0,), block_shape=(BLOCK_D,), order=(0,)
    )
    c = tl.zeros((ROWS,), dtype=tl.float32)
    for _ in range(0, tl.cdiv(D, BLOCK_D)):
        x = tl.load(x_ptr, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        dy = tl.load(dy_ptr, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        w = tl.load(w_ptr, boundary_check=(0,), padding_option="zero").to(tl.float32)
        c += tl.sum(dy * w[None, :] * x * r[:, None], axis=1)
        x_ptr = tl.advance(x_ptr, (0, BLOCK_D))
        dy_ptr = tl.advance(dy_ptr, (0, BLOCK_D))
        w_ptr = tl.advance(w_ptr, (BLOCK_D,))
    c = c / D
    # pass 2: dx = r·(dy⊙γ − x̂·c); partial dγ of this row tile = Σ_rows dy ⊙ x̂
    x_ptr = tl.make_block_ptr(
        X,
        shape=(M, D),
        strides=(stride_xm, stride_xd),
        offsets=(row0, 0),
        block_shape=(ROWS, BLOCK_D),
        order=(1, 0),
    )
    dy_ptr = tl.make_block_ptr(
        DY,
        shape=(M, D),
        strides=(stride_dym, stride_dyd),
        offsets=(row0, 0),
        block_shape=(ROWS, BLOCK_D),
        order=(1, 0),
    )
    w_ptr = tl.make_block_ptr(
        W, shape=(D,), strides=(1,), offsets=(0,), block_shape=(BLOCK_D,), order=(0,)
    )
    dx_ptr = tl.make_block_ptr(
        DX,
        shape=(M, D),
        strides=(stride_dxm, stride_dxd),
        offsets=(row0, 0),
        block_shape=(ROWS, BLOCK_D),
        order=(1, 0),
    )
    dw_ptr = tl.make_block_ptr(
        DW_PARTIAL + pid * D,
        shape=(D,),
        strides=(1,),
        offsets=(0,),
        block_shape=(BLOCK_D,),
        order=(0,),
    )
    for _ in range(0, tl.cdiv(D, BLOCK_D)):
        x = tl.load(x_ptr, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        dy = tl.load(dy_ptr, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        w = tl.load(w_ptr, boundary_check=(0,), padding_option="zero").to(tl.float32)
        xhat = x * r[:, None]
        dx = r[:, None] * (dy * w[None, :] - xhat * c[:, None])
        tl.store(dx_ptr, dx.to(DX.dtype.element_ty), boundary_check=(0, 1))
        tl.store(dw_ptr, tl.sum(dy * xhat, axis=0), boundary_check=(0,))
        x_ptr = tl.advance(x_ptr, (0, BLOCK_D))
        dy_ptr = tl.advance(dy_ptr, (0, BLOCK_D))
        w_ptr = tl.advance(w_ptr, (BLOCK_D,))
        dx_ptr = tl.advance(dx_ptr, (0, BLOCK_D))
        dw_ptr = tl.advance(dw_ptr, (BLOCK_D,))


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _tiles(D: int, block_d: int | None = None) -> tuple[int, int]:
    """Rows per program and the D tile: one D tile up to 4096 (then x stays in registers between
    passes in practice), 16 rows per program on a GPU; 8 rows under the interpreter."""
    block_d = block_d or min(4096, triton.next_power_of_2(D))
    if block_d & (block_d - 1):
        raise ValueError(f"block_d={block_d} must be a power of two")
    rows = 8 if os.environ.get("TRITON_INTERPRET", "0") == "1" else max(1, min(16, 8192 // block_d))
    return rows, block_d


def _check(x: Tensor, weight: Tensor) -> None:
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"RMSNorm weight {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}"
        )
    if x.dtype not in _TL_DTYPES or weight.dtype not in _TL_DTYPES:
        raise ValueError(
            f"rmsnorm_triton supports fp32/fp16/bf16; got x {x.dtype}, weight {weight.dtype}"
        )
    if x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("rmsnorm_triton needs a CUDA device, or TRITON_INTERPRET=1 to run on CPU")


class RMSNormTriton(torch.autograd.Function):
    """y = x / sqrt(mean(x²) + eps) ⊙ γ with one fused kernel each way (Book of LLMs §1.10 “RMSNorm”)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, block_d: int | None = None) -> Tensor:
        _check(x, weight)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, D)
        M, D = x2.shape
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty(M, D, dtype=out_dtype, device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        rows, block_d = _tiles(D, block_d)
        _rmsnorm_fwd_kernel[(triton.cdiv(M, rows),)](
            x2,
            weight,
            y,
            rstd,
            *x2.stride(),
            *y.stride(),
            M,
            D,
            eps,
            ROWS=rows,
            BLOCK_D=block_d,
            X_DTYPE=_TL_DTYPES[x.dtype],
        )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape, ctx.block_d = shape, block_d
        return y.view(*shape[:-1], D)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2, weight, rstd = ctx.saved_tensors
        M, D = x2.shape
        dy2 = dy.reshape(M, D)
        dx = torch.empty_like(x2)
        rows, block_d = _tiles(D, ctx.block_d)
        n_prog = triton.cdiv(M, rows)
        dw_partial = torch.empty(
            n_prog, D, dtype=torch.float32, device=x2.device
        )  # one row per program
        _rmsnorm_bwd_kernel[(n_prog,)](
            x2,
            weight,
            dy2,
            rstd,
            dx,
            dw_partial,
            *x2.stride(),
            *dy2.stride(),
            *dx.stride(),
            M,
            D,
            ROWS=rows,
            BLOCK_D=block_d,
        )
        dw = dw_partial.sum(dim=0).to(weight.dtype)
        return dx.view(ctx.shape), dw, None, None


def rmsnorm_triton(
    x: Tensor, weight: Tensor, eps: float = 1e-5, block_d: int | None = None
) -> Tensor:
    """Fused RMSNorm: x (..., D), γ (D,) -> (..., D). ``block_d`` overrides the D tile (tests)."""
    return RMSNormTriton.apply(x, weight, eps, block_d)
