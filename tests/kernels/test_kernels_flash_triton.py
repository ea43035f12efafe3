"""Triton FlashAttention-2 (forward, dK/dV and dQ kernels) under TRITON_INTERPRET=1 vs plain attention."""

import pytest
import torch
from kernel_refs import reference_attention

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")

from lmstack.kernels.flash_triton import flash_attention_triton  # noqa: E402

# (B, N, K, T, S, H, causal, block_q, block_k)
SHAPES = [
    (1, 2, 2, 64, 64, 16, True, 16, 16),  # tile multiples
    (1, 4, 2, 37, 37, 32, True, 16, 16),  # partial tiles, GQA G = 2
    (2, 3, 1, 50, 70, 16, True, 32, 16),  # MQA, T < S (offset causal), diagonal band inside a tile
    (1, 2, 1, 33, 65, 24, False, 16, 32),  # non-causal, H not a power of two (padded to 32)
    (1, 2, 2, 45, 30, 16, True, 16, 16),  # T > S: the first causal rows see no key
]


@pytest.fixture(params=["atomic", "split"])
def bwd_mode(request, monkeypatch):
    """Both backward schedules: one pass with atomic dQ (default) and dK/dV + dQ kernels."""
    monkeypatch.setenv("LMSTACK_FLASH_BWD", request.param)
    return request.param


@pytest.mark.parametrize(
    "shape",
    SHAPES,
    ids=lambda s: "B{}N{}K{}T{}S{}H{}{}q{}k{}".format(*s[:6], "c" if s[6] else "f", *s[7:]),
)
def test_matches_reference_fp32(check, shape, bwd_mode):
    # ieee fp32 dots; differences are fp32 rounding only
    *dims, causal, bq, bk = shape
    check(
        flash_attention_triton,
        *dims,
        causal,
        torch.float32,
        atol=5e-6,
        rtol=1e-5,
        block_q=bq,
        block_k=bk,
    )


@pytest.mark.parametrize("H", [64, 80, 128])
def test_head_dims(check, H):
    check(flash_attention_triton, 1, 2, 1, 24, 24, H, True, torch.float32, atol=5e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(check, dtype, bwd_mode):
    # loaded in bf16/fp16, computed in fp32 (interpreter), rounded once on store
    tol = 2**-7 if dtype == torch.bfloat16 else 2**-10
    check(flash_attention_triton, 1, 4, 2, 40, 40, 32, True, dtype, atol=4 * tol, rtol=2 * tol)


def test_agrees_with_pytorch_tiles():
    from lmstack.kernels import flash_attention_pytorch

    q, k, v = (torch.randn(1, 2, 33, 16) for _ in range(3))
    torch.testing.assert_close(
        flash_attention_triton(q, k, v, causal=True),
        flash_attention_pytorch(q, k, v, causal=True),
        atol=2e-6,
        rtol=1e-5,
    )


def test_non_contiguous_inputs(check):
    # the model passes q/k/v as transposed views of (B, T, N, H); block pointers take any strides
    x = torch.randn(1, 21, 2, 16)
    q = x.transpose(1, 2)
    assert not q.is_contiguous()
    out = flash_attention_triton(q, q, q, causal=True)
    torch.testing.assert_close(out, reference_attention(q, q, q, True)[0], atol=2e-6, rtol=1e-5)


def test_clear_errors():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="supports fp32/fp16/bf16"):
        flash_attention_triton(q.double(), q.double(), q.double())
    with pytest.raises(ValueError, match="head dim H=8"):
        flash_attention_triton(q[..., :8], q[..., :8], q[..., :8])
    with pytest.raises(ValueError, match="powers of two"):
        flash_attention_triton(q, q, q, block_q=24)


def test_backward_mode_choice(monkeypatch):
    from lmstack.kernels.flash_triton import backward_mode

    monkeypatch.delenv("LMSTACK_FLASH_BWD", raising=False)
    assert backward_mode() == "atomic"
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert backward_mode() == "split"  # atomics add in a varying order: not deterministic
    finally:
        torch.use_deterministic_algorithms(was)
    monkeypatch.setenv("LMSTACK_FLASH_BWD", "fast")
    with pytest.raises(ValueError, match="LMSTACK_FLASH_BWD='fast'"):
        backward_mode()
