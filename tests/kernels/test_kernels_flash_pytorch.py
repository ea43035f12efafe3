"""Tiled PyTorch FlashAttention-2 vs plain attention (Book of LLMs §2.7 “FlashAttention tiling”: exact, O(S) memory)."""

import math

import pytest
import torch

from lmstack.kernels import flash_attention_pytorch
from lmstack.kernels.bench import peak_tensor_bytes

# (B, N, K, T, S, H, causal, block_q, block_k): tile multiples and not, GQA (K < N), MQA (K = 1),
# T < S (queries after a prefix), T > S (causal rows that see nothing), tiles larger than S.
SHAPES = [
    (2, 4, 4, 64, 64, 16, True, 16, 16),
    (1, 4, 2, 37, 37, 32, True, 16, 16),
    (2, 6, 2, 50, 70, 8, True, 32, 16),
    (1, 2, 1, 33, 65, 24, False, 16, 32),
    (1, 3, 1, 20, 20, 16, False, 64, 64),
    (1, 2, 2, 45, 30, 16, True, 16, 8),
    (1, 2, 1, 1, 40, 16, True, 16, 16),  # one decoding query
]


@pytest.mark.parametrize(
    "shape",
    SHAPES,
    ids=lambda s: "B{}N{}K{}T{}S{}H{}{}q{}k{}".format(*s[:6], "c" if s[6] else "f", *s[7:]),
)
def test_matches_reference_fp64(check, shape):
    # fp64 in, fp64 compute: the tiling and online softmax change nothing but rounding order
    *dims, causal, bq, bk = shape
    check(
        flash_attention_pytorch,
        *dims,
        causal,
        torch.float64,
        atol=1e-12,
        rtol=1e-10,
        block_q=bq,
        block_k=bk,
    )


@pytest.mark.parametrize("shape", SHAPES[:4], ids=str)
def test_matches_reference_fp32(check, shape):
    *dims, causal, bq, bk = shape
    check(
        flash_attention_pytorch,
        *dims,
        causal,
        torch.float32,
        atol=5e-6,
        rtol=1e-5,
        block_q=bq,
        block_k=bk,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(check, dtype):
    # fp32 tiles, output and gradients rounded once to the input dtype
    tol = 2**-7 if dtype == torch.bfloat16 else 2**-10
    check(
        flash_attention_pytorch,
        1,
        4,
        2,
        40,
        40,
        32,
        True,
        dtype,
        atol=4 * tol,
        rtol=2 * tol,
        block_q=16,
        block_k=16,
    )


def test_default_scale_and_custom_scale():
    (q, k, v), _ = [
        [t.double() for t in x] if isinstance(x, list) else x
        for x in [[torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)], None]
    ]
    ref = torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v
    torch.testing.assert_close(
        flash_attention_pytorch(q, k, v, scale=0.3, block_q=4, block_k=4), ref
    )


def test_saves_only_linear_state():
    # What autograd keeps for backward: Q, K, V, O (B·N·S·H each) and L (B·N·S) — nothing S×S.
    B, N, S, H = 1, 2, 256, 16
    q, k, v = (torch.randn(B, N, S, H, requires_grad=True) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        flash_attention_pytorch(q, k, v, causal=True)
    assert sum(saved) == 4 * B * N * S * H + B * N * S
    assert max(saved) < S * S


@pytest.mark.slow
def test_peak_memory_grows_linearly_in_S():
    """Peak tensor bytes of forward + backward, measured from the allocator (Book of LLMs §2.7 “FlashAttention tiling”:
    O(S²) -> O(S)). Doubling S twice: ×4 for the tiled path, ×16 for materialised attention."""
    B, N, H = 1, 1, 16

    def peak(fn, S):
        q, k, v = (torch.randn(B, N, S, H, requires_grad=True) for _ in range(3))
        return peak_tensor_bytes(lambda: fn(q, k, v).sum().backward())

    def materialised(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(H)
        return torch.softmax(s, dim=-1) @ v

    flash = [
        peak(
            lambda q, k, v: flash_attention_pytorch(q, k, v, causal=True, block_q=64, block_k=64), S
        )
        for S in (256, 512, 1024)
    ]
    plain = [peak(materialised, S) for S in (256, 512, 1024)]
    assert all(p > 0 for p in flash + plain)
    flash_ratio, plain_ratio = flash[2] / flash[0], plain[2] / plain[0]
    assert 3.0 <= flash_ratio <= 5.0, flash  # linear: 4× the S -> about 4× the bytes
    assert plain_ratio >= 12.0, plain  # quadratic: about 16×
    # and in absolute terms: a few (S, H) tensors, not an (S, S) matrix
    assert flash[2] < 1024 * 1024 * 4 / 4


def test_rejects_bad_shapes():
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match="does not divide"):
        flash_attention_pytorch(q, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"\(B, N, T, H\)"):
        flash_attention_pytorch(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="tile sizes"):
        flash_attention_pytorch(q, q, q, block_q=0)
