"""Fused Triton RMSNorm forward / backward (dx, dγ) vs the formula with autograd (seed 000 §1.10)."""

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")

from lmstack.kernels.triton_rmsnorm import rmsnorm_triton  # noqa: E402


def reference(x, w, eps):
    """y = γ ⊙ (x / sqrt(mean(x²) + eps)) computed in fp32, cast back before γ (as the model does)."""
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("shape,block_d", [((3, 5, 37), None), ((19, 300), None), ((10, 300), 64), ((2, 7, 64), 16)],
                         ids=["3d-D37", "D300", "D300-tiles64", "D64-tiles16"])
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
def test_low_precision_matches_model_layer(dtype):
    from lmstack.model.layers import RMSNorm

    norm = RMSNorm(96, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96))
    x = torch.randn(4, 9, 96).to(dtype).requires_grad_()
    y = rmsnorm_triton(x, norm.weight, 1e-6)
    ref = norm(x)
    assert y.dtype == dtype
    # fp16: at most one rounding step apart. bf16: the interpreter casts fp32 -> bf16 by truncation
    # (a GPU rounds to nearest), which adds up to one more step.
    ulp = 2 * 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    torch.testing.assert_close(y.float(), ref.float(), atol=ulp, rtol=ulp)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    (rdx,) = torch.autograd.grad(ref, x, dy)
    torch.testing.assert_close(dx.float(), rdx.float(), atol=4 * ulp, rtol=2 * ulp)


def test_model_rmsnorm_backend_switch():
    from lmstack.model.layers import RMSNorm

    norm = RMSNorm(40)
    x = torch.randn(3, 40)
    y_torch = norm(x)
    norm.backend = "triton"
    torch.testing.assert_close(norm(x), y_torch, atol=1e-6, rtol=1e-6)


def test_clear_errors():
    with pytest.raises(ValueError, match="does not match"):
        rmsnorm_triton(torch.randn(2, 8), torch.ones(7))
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        rmsnorm_triton(torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64))
