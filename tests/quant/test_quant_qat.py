"""QAT: the forward uses the int4 round trip, the gradient passes straight through (autograd checked against
the gradient of F.linear at the quantised weight), training moves the master weights, and converting gives
the same logits."""

import pytest
import torch
import torch.nn.functional as F

from lmstack.model.config import ModelConfig
from lmstack.model.layers import Linear
from lmstack.model.transformer import Transformer
from lmstack.quant import Int4Linear, dequantize_int4, quantize_int4
from lmstack.quant.qat import QATLinear, convert_qat, fake_quant_int4, prepare_qat

pytestmark = pytest.mark.usefixtures("one_thread")


def test_straight_through_gradient():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(16, 64, generator=g, requires_grad=True)
    x = torch.randn(5, 64, generator=g)
    gy = torch.randn(5, 16, generator=g)
    w_hat = dequantize_int4(*quantize_int4(W.detach(), 32))
    y = F.linear(x, fake_quant_int4(W, 32))
    torch.testing.assert_close(y, F.linear(x, w_hat))  # forward: the quantised weight
    y.backward(gy)
    # backward: dL/dW = dL/dŴ = gyᵀ x (the rounding is the identity for the gradient)
    torch.testing.assert_close(W.grad, gy.t() @ x)
    (g_ones,) = torch.autograd.grad(fake_quant_int4(W, 32).sum(), W)
    assert torch.equal(g_ones, torch.ones_like(W))  # ∂Ŵ/∂W := I


def small_model():
    cfg = ModelConfig(
        vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
    )
    return Transformer(cfg, seed=3)


def test_prepare_train_convert():
    model = small_model()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-2
    )  # built before prepare_qat: the same Parameters
    names = [n for n, _ in model.named_parameters()]
    prepare_qat(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert sum(isinstance(m, QATLinear) for m in model.modules()) == 2 * 7
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    w0 = model.blocks[0].ffn.up_proj.weight.detach().clone()
    for _ in range(3):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not torch.equal(model.blocks[0].ffn.up_proj.weight, w0)  # the master weights moved
    model.eval()
    with torch.no_grad():
        qat_logits = model(tokens)
        convert_qat(model, compute_dtype=torch.float32)
        out = model(tokens)
    assert isinstance(model.blocks[0].attn.q_proj, Int4Linear)
    assert not any(type(m) in (Linear, QATLinear) for m in model.blocks.modules())
    torch.testing.assert_close(out, qat_logits, atol=1e-4, rtol=1e-4)


def test_bad_qat_inputs():
    with pytest.raises(ValueError, match="int8"):
        prepare_qat(small_model(), "int8")
    with pytest.raises(ValueError, match="group_size=48"):
        prepare_qat(small_model(), group_size=48)
