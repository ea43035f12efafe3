"""The recipe "add a weight-only quant format" (docs/architecture.md) done from outside the package: a toy
format (weights rounded to fp16, one class with ``from_linear`` / ``from_weight``) registered with
``quant.register_format`` is what ``quantize_model(model, "toy")``, ``load_for_inference(dtype="toy")`` and the
``--dtype`` choices then use, checked against a hand-rounded copy of the model."""

import argparse
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmstack.inference import LLM, loader
from lmstack.kernels.runtime import WEIGHT_FORMATS, RuntimeConfig
from lmstack.model.config import ModelConfig
from lmstack.model.layers import Linear
from lmstack.model.transformer import Transformer
from lmstack.quant import FORMATS, QUANT_METHODS, WeightFormat, quantize_model, register_format


class HalfLinear(nn.Module):
    """y = x W̃ᵀ + b with W̃ = fp16(W): the toy format."""

    def __init__(self, weight, bias, compute_dtype):
        super().__init__()
        self.register_buffer("w16", weight.detach().to(torch.float16))
        self.bias = bias

    @classmethod
    def from_linear(cls, linear, compute_dtype=torch.float32):
        return cls(linear.weight, getattr(linear, "bias", None), compute_dtype)

    @classmethod
    def from_weight(cls, weight, compute_dtype=torch.float32):
        return cls(weight, None, compute_dtype)

    def forward(self, x):
        return F.linear(x, self.w16.to(x.dtype), self.bias)


@pytest.fixture
def toy():
    fmt = register_format(WeightFormat("toy", HalfLinear))
    yield fmt
    del FORMATS["toy"]
    WEIGHT_FORMATS.remove("toy")


def _model(tie):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=48, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=16
    )
    return Transformer(cfg.replace(tie_embeddings=tie)).eval()


@torch.no_grad()
def _rounded(model):
    """The reference: every block Linear's and the unembedding's weight rounded to fp16 by hand."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, Linear):
            m.weight.copy_(m.weight.half().float())
    if ref.lm_head is None:  # tied: the unembedding is a rounded copy of W_e, the lookup keeps W_e
        ref.lm_head = nn.Linear(16, 48, bias=False)
        ref.lm_head.weight.copy_(model.embed.weight.half().float())
    return ref


@pytest.mark.parametrize("tie", [False, True])
def test_a_registered_format_is_what_quantize_model_and_the_loader_use(toy, tie):
    tokens = torch.tensor([[5, 3, 9, 1, 44]])
    model = _model(tie)
    want = _rounded(model)(tokens)
    q = quantize_model(copy.deepcopy(model), "toy", compute_dtype=torch.float32)
    assert isinstance(q.lm_head, HalfLinear) and isinstance(q.blocks[0].ffn.up_proj, HalfLinear)
    torch.testing.assert_close(q(tokens), want)
    assert not torch.equal(model(tokens), want)  # the rounding is visible: the test can fail
    loaded, _ = loader.load_for_inference(copy.deepcopy(model), dtype="toy")
    assert loaded.quantization == "toy"
    torch.testing.assert_close(loaded(tokens), want)
    llm = LLM(copy.deepcopy(model), dtype="toy")  # the runtime's number format names it too
    assert llm.runtime == RuntimeConfig(dtype="toy") and llm.engine.model.quantization == "toy"
    torch.testing.assert_close(llm.engine.model(tokens), want)


def test_the_format_names_are_the_registry(toy):
    assert "toy" in QUANT_METHODS and "toy" in loader.QUANT
    assert loader.weight_format("toy") == (torch.float32, "toy")
    p = argparse.ArgumentParser()
    loader.add_model_arguments(p)
    assert p.parse_args(["--dtype", "toy"]).dtype == "toy"
    with pytest.raises(ValueError, match="'int4' is already registered"):
        register_format(WeightFormat("int4", HalfLinear))
    with pytest.raises(TypeError, match="has no from_linear"):
        register_format(WeightFormat("bad", nn.Linear))


def test_an_unregistered_format_is_refused_by_name():
    with pytest.raises(ValueError, match="method='toy'; expected one of"):
        quantize_model(_model(False), "toy")
