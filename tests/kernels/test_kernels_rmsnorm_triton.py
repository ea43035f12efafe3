"""Fused Triton RMSNorm forward / backward (dx, dγ) vs the formula with autograd (Book of LLMs §1.10 “RMSNorm”)."""

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")

from lmstack.kernels.triton_rmsnorm import rmsnorm_triton  # noqa: E402


def reference(x, w, eps):
    """y = γ ⊙ (x / sqrt(mean(x²) + eps)) computed in fp32, cast back before γ (as the model does)."""
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize(
    "shape,block_d",
    [((3, 5, 37), None), ((19, 300), None), ((10, 300), 64), ((2, 7, 64), 16)],
    ids=["3d-D37", "D300", "D300-tiles64", "D64-tiles16"],
)
def test_forward_backward_fp32(shape, block_d):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).requires_grad_()
    dy = torch.randn(*shape, generator=gen)
    y = rmsnorm_triton(x, w, 1e-5, block_d=block_d)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    # reference in fp64 with autograd
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = reference(x64, w64, 1e-5)
    rdx, rdw = torch.autograd.grad(y64, (x64, w64), dy.double())
    torch.testing.assert_close(y.double(), y64, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(dx.double(), rdx, atol=5e-6, rtol=5e-6)
    torch.testing.assert_close(dw.double(), rdw, atol=2e-5, rtol=5e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_rounding_of_fp64(dtype):
    """bf16/fp16 against the fp64 formula on the same (rounded) inputs, with tolerances from the
    rounding steps: unit roundoff u = 2^-8 (bf16) or 2^-11 (fp16), each cast to ``dtype`` off by
    at most u relative — 2u for bf16 under the interpreter, which truncates instead of rounding
    to nearest. y is rounded twice (the normalised x, then γ ⊙ it, as the model does), dx and dγ
    once (fp32 inside, a few 2^-24 on top). Checked elementwise: |err| <= k·u·|ref| + 1e-6."""
    gen = torch.Generator().manual_seed(0)
    D = 96
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype).requires_grad_()
    x = torch.randn(4, 9, D, generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(4, 9, D, generator=gen).to(dtype)
    y = rmsnorm_triton(x, w, 1e-6)
    assert y.dtype == dtype
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    rdx, rdw = torch.autograd.grad(y64, (x64, w64), dy.double())
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    per_cast = 2 * u if dtype == torch.bfloat16 else u  # interpreter: bf16 truncation
    torch.testing.assert_close(y.double(), y64, atol=1e-6, rtol=1.02 * 2 * per_cast)
    torch.testing.assert_close(dx.double(), rdx, atol=1e-6, rtol=1.02 * per_cast)
    torch.testing.assert_close(dw.double(), rdw, atol=1e-6, rtol=1.02 * per_cast)


def test_model_rmsnorm_backend_switch():
    from lmstack.kernels.backends import choose_norm
    from lmstack.model.layers import RMSNorm

    norm = RMSNorm(40)
    x = torch.randn(3, 40)
    y_torch = norm(x)
    norm.impl = choose_norm("triton", "cpu")[1]
    torch.testing.assert_close(norm(x), y_torch, atol=1e-6, rtol=1e-6)


def test_clear_errors():
    with pytest.raises(ValueError, match="does not match"):
        rmsnorm_triton(torch.randn(2, 8), torch.ones(7))
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        rmsnorm_triton(torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64))
