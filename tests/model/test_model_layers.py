"""Each layer against an independent reference: the seed's formulas computed in float64 numpy/torch."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmstack.model.attention import attention_mask, reference_attention
from lmstack.model.layers import (
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    rope_frequencies,
)


def test_linear_matches_matmul_with_bias():
    torch.manual_seed(0)
    lin = Linear(7, 5, bias=True)
    with torch.no_grad():
        lin.bias.normal_()
    x = torch.randn(3, 4, 7)
    ref = x.double() @ lin.weight.double().T + lin.bias.double()
    torch.testing.assert_close(lin(x).double(), ref, rtol=1e-6, atol=1e-6)
    assert Linear(7, 5).bias is None


def test_embedding_is_one_hot_matmul():
    emb = Embedding(11, 6)
    tokens = torch.tensor([[0, 3, 10], [5, 5, 1]])
    ref = F.one_hot(tokens, 11).double() @ emb.weight.double()
    torch.testing.assert_close(emb(tokens).double(), ref)


def test_rmsnorm_matches_formula():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 16) * 3
    xn = x.double().numpy()
    ref = (
        xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-5) * norm.weight.detach().double().numpy()
    )
    np.testing.assert_allclose(norm(x).detach().double().numpy(), ref, rtol=1e-5, atol=1e-6)
    # unit RMS before γ
    y = RMSNorm(16)(x)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(2, 3), rtol=1e-4, atol=1e-4)


def test_rmsnorm_computes_in_fp32_for_bf16_input():
    x = (torch.randn(4, 64) * 100).bfloat16()
    norm = RMSNorm(64).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    x32 = x.float()
    ref = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_swiglu_matches_formula():
    torch.manual_seed(0)
    ffn = SwiGLU(8, 12)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    ffn = ffn.double()
    g = x @ ffn.gate_proj.weight.T
    u = x @ ffn.up_proj.weight.T
    swish = g * (1.0 / (1.0 + torch.exp(-g)))  # Swish(g) = g·σ(g)
    ref = (swish * u) @ ffn.down_proj.weight.T
    torch.testing.assert_close(ffn(x), ref)


def _rotation_matrix(m: int, H: int, theta: float) -> np.ndarray:
    """Block-diagonal R_m of Book of LLMs §1.2 “the forward pass layer by layer”: 2x2 blocks on pairs (2i, 2i+1) with angle m·θ_i."""
    R = np.zeros((H, H))
    for i in range(H // 2):
        a = m * theta ** (-2 * i / H)
        R[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [
            [math.cos(a), -math.sin(a)],
            [math.sin(a), math.cos(a)],
        ]
    return R


@pytest.mark.parametrize("theta", [10000.0, 100.0])
def test_rope_interleaved_equals_block_diagonal_rotation(theta):
    H = 8
    rope = RotaryEmbedding(H, 64, theta, layout="interleaved")
    x = torch.randn(1, 2, 5, H, dtype=torch.float64)
    pos = torch.tensor([0, 1, 7, 30, 63])
    out = rope(x, pos).numpy()
    for j, m in enumerate(pos.tolist()):
        ref = x[0, :, j].numpy() @ _rotation_matrix(m, H, theta).T
        np.testing.assert_allclose(out[0, :, j], ref, rtol=1e-6, atol=1e-6)


def test_rope_half_layout_is_permuted_interleaved():
    H = 16
    perm = torch.cat(
        [torch.arange(0, H, 2), torch.arange(1, H, 2)]
    )  # interleaved index -> half index
    x = torch.randn(2, 3, 9, H, dtype=torch.float64)
    pos = torch.arange(9)
    inter = RotaryEmbedding(H, 32, 500.0, "interleaved")(x, pos)
    half = RotaryEmbedding(H, 32, 500.0, "half")(x[..., perm], pos)
    torch.testing.assert_close(half, inter[..., perm])


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_inner_product_depends_only_on_relative_position(layout):
    """⟨R_m q, R_n k⟩ = qᵀ R_{n-m} k (Book of LLMs §1.12 “RoPE”)."""
    H = 32
    rope = RotaryEmbedding(H, 512, 10000.0, layout)
    torch.manual_seed(1)
    q, k = torch.randn(H, dtype=torch.float64), torch.randn(H, dtype=torch.float64)

    def dot(m, n):
        rq = rope(q.view(1, 1, 1, H), torch.tensor([m]))
        rk = rope(k.view(1, 1, 1, H), torch.tensor([n]))
        return float((rq * rk).sum())

    for delta in (0, 3, 17, 100):
        values = [dot(m, m + delta) for m in (0, 5, 41, 300)]
        assert max(values) - min(values) < 1e-9, (delta, values)
    assert abs(dot(0, 3) - dot(0, 4)) > 1e-6  # and it does depend on the offset


def test_rope_frequencies_formula():
    f = rope_frequencies(8, 10000.0)
    np.testing.assert_allclose(f.numpy(), [10000.0 ** (-2 * i / 8) for i in range(4)])


def _loop_mask(qp, kp, window):
    T, S = len(qp), len(kp)
    m = torch.zeros(T, S, dtype=torch.bool)
    for i in range(T):
        for j in range(S):
            m[i, j] = kp[j] >= 0 and kp[j] <= qp[i] and (window is None or qp[i] - kp[j] < window)
    return m


@pytest.mark.parametrize("window", [None, 1, 3])
def test_attention_mask_matches_definition(window):
    qp = torch.tensor([4, 5, 6])
    kp = torch.tensor([0, 1, 2, 3, 4, 5, 6, -1])
    torch.testing.assert_close(
        attention_mask(qp, kp, window), _loop_mask(qp.tolist(), kp.tolist(), window)
    )
    causal = attention_mask(torch.arange(6), torch.arange(6))
    torch.testing.assert_close(causal, torch.tril(torch.ones(6, 6, dtype=torch.bool)))


@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("window", [None, 3])
def test_reference_attention_matches_sdpa(N, K, window):
    torch.manual_seed(0)
    B, T, H = 2, 9, 8
    q = torch.randn(B, N, T, H)
    k = torch.randn(B, K, T, H)
    v = torch.randn(B, K, T, H)
    pos = torch.arange(T)
    mask = attention_mask(pos, pos, window)
    ref = reference_attention(q, k, v, mask)
    ke, ve = k.repeat_interleave(N // K, 1), v.repeat_interleave(N // K, 1)
    sdpa = F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)
    torch.testing.assert_close(ref, sdpa, rtol=1e-5, atol=1e-5)
    if window is None:
        torch.testing.assert_close(
            ref, F.scaled_dot_product_attention(q, ke, ve, is_causal=True), rtol=1e-5, atol=1e-5
        )


def test_rope_tables_grow_with_the_positions_used():
    """A config at the cap (max_seq_len = 2**24) allocates tables for the positions used, not 16.7M rows."""
    H = 16
    rope = RotaryEmbedding(H, 1 << 24, 10000.0)
    x = torch.randn(1, 2, 3, H, dtype=torch.float64)
    small = rope(x, torch.tensor([0, 5, 9]))
    assert rope.length == RotaryEmbedding.INITIAL_POSITIONS
    assert rope.tables("cpu", torch.float64)[0].shape == (RotaryEmbedding.INITIAL_POSITIONS, H)
    far = rope(x, torch.tensor([0, 5, 20000]))
    assert rope.length == 32768  # doubled to the next power of two
    torch.testing.assert_close(
        far[:, :, :2], small[:, :, :2]
    )  # the same rows, whatever the table size
    fresh = RotaryEmbedding(H, 32768, 10000.0)
    fresh.reserve(32768)
    torch.testing.assert_close(
        fresh(x, torch.tensor([0, 5, 20000])), far
    )  # values independent of growth
    with pytest.raises(ValueError, match="position 32768 is beyond max_seq_len=32768"):
        fresh(x, torch.tensor([0, 1, 32768]))


@pytest.mark.parametrize("rows", [1, 7, 8, 300])
def test_linear_through_onednn_equals_f_linear(rows):
    """ops.gemm.linear (every model Linear) under a policy of oneDNN from 8 rows: oneDNN's GEMM on CPU fp32
    from 8 rows, torch's F.linear below; values and both gradients equal F.linear's (fp32 rounding), and
    exactly F.linear below the threshold or under a FLOP counter (which must see the plain matmul)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lmstack.ops.gemm import GemmPolicy, linear, onednn_ok, set_gemm

    saved = set_gemm(GemmPolicy("test", 8, None))
    try:
        g = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, 3, 48, generator=g).requires_grad_(
            True
        )  # (rows, 3, in): 3·rows rows in all
        w = torch.randn(40, 48, generator=g).requires_grad_(True)
        b = torch.randn(40, generator=g).requires_grad_(True)
        y, ref = linear(x, w, b), torch.nn.functional.linear(x, w, b)
        if 3 * rows < 8 or not onednn_ok(x):
            assert torch.equal(y, ref)
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
        gy = torch.randn_like(y)
        for a, r in zip(
            torch.autograd.grad(y, (x, w, b), gy), torch.autograd.grad(ref, (x, w, b), gy)
        ):
            torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-5)
        with FlopCounterMode(display=False) as fc:
            linear(x, w)
        assert fc.get_total_flops() == 2 * 3 * rows * 48 * 40
    finally:
        set_gemm(saved)
