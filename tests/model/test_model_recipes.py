"""The recipe "add a token mixer" (docs/architecture.md) done from outside the package: a toy causal
mean-pooling mixer registered with ``model.mixers.register_mixer`` (its spec and its module, no lmstack file
edited) is built by ``Transformer`` from ``layer_types``, matches a hand formula, is counted by accounting as
``sum(p.numel())``, and is accepted or refused by tensor / context parallelism and the paged engine as its
spec declares."""

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lmstack.accounting.flops import forward_flops
from lmstack.accounting.params import total_params
from lmstack.inference.engine import LLMEngine
from lmstack.model import mixer_spec
from lmstack.model.config import ConfigError, ModelConfig
from lmstack.model.mixer_spec import SPECS, MixerSpec, UnsupportedMixer
from lmstack.model.mixers import MODULES, register_mixer
from lmstack.model.transformer import Transformer
from lmstack.parallel.context import context_parallel
from lmstack.parallel.tensor import tensor_parallel, tensor_parallel_plan


class CausalMean(nn.Module):
    """y_t = W_O · (1/t) Σ_{s ≤ t} W_V x_s: each token mixes the mean of the values so far."""

    def __init__(self, config, layer_idx, rope=None, device=None, dtype=None):
        super().__init__()
        D = config.d_model
        self.layer_idx = layer_idx
        self.v_proj = nn.Linear(D, D, bias=False, device=device, dtype=dtype)
        self.o_proj = nn.Linear(D, D, bias=False, device=device, dtype=dtype)

    def forward(self, x, meta):  # x (B, T, D)
        v = self.v_proj(x)
        t = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)
        return self.o_proj(v.cumsum(1) / t[:, None])


TOY = MixerSpec(
    "toy_mean",
    "causal mean",
    "state",
    softmax=False,
    params=lambda c: 2 * c.d_model * c.d_model,
    norm_params=lambda c: 0,
    flops=lambda c, B, T, S, window: (2 * B * T * 2 * c.d_model**2, 2 * B * T * c.d_model),
    cache_bytes=lambda c, S, p, ps: c.d_model * ps,
    tp_plan=lambda c: (("v_proj", "column"), ("o_proj", "row")),  # the mean is per feature
    context_parallel="the running mean needs every earlier chunk",
    paged="no paged state for the toy",
    speculation=None,
)


@pytest.fixture
def toy():
    register_mixer(TOY, lambda c, i, rope, **kw: CausalMean(c, i, rope, **kw))
    yield TOY
    del SPECS[TOY.name], MODULES[TOY.name]


def _config(**kw):
    return ModelConfig(
        vocab_size=32,
        d_model=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        d_ff=32,
        max_seq_len=32,
        **{"layer_types": ["toy_mean", "attention"], **kw},
    )


def test_a_registered_mixer_is_built_counted_and_matches_its_formula(toy):
    torch.manual_seed(0)
    model = Transformer(_config()).eval()
    mix = model.blocks[0].attn
    assert isinstance(mix, CausalMean)
    x = torch.randn(2, 5, 16)
    y = mix(x, None)
    Wv, Wo = mix.v_proj.weight, mix.o_proj.weight
    for t in range(5):  # the hand formula, token by token
        ref = (x[:, : t + 1] @ Wv.T).mean(1) @ Wo.T
        torch.testing.assert_close(y[:, t], ref)
    # accounting reads the spec: the count equals the built model's
    assert total_params(model.config) == sum(p.numel() for p in model.parameters())
    # layer 0's FLOPs are the toy's own formula: 4·B·T·D² + 2·B·T·D against a plain-attention model
    plain = _config(layer_types=None)
    D, B, S = 16, 1, 8
    attn = sum(SPECS["attention"].flops(plain, B, S, S, None))
    assert forward_flops(model.config, B, S) - forward_flops(plain, B, S) == (
        4 * B * S * D * D + 2 * B * S * D - attn
    )
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 32)


def test_a_registered_mixer_is_refused_or_sharded_as_its_spec_declares(toy):
    model = Transformer(_config()).eval()
    with pytest.raises(UnsupportedMixer, match="layer 0 is a causal mean layer.*paged"):
        LLMEngine(model)
    with pytest.raises(UnsupportedMixer, match="context parallelism: layer 0.*every earlier chunk"):
        context_parallel(model, None)
    assert tensor_parallel_plan(model)[0] == (model.blocks[0].attn, TOY.tp_plan(model.config))
    if dist.is_initialized():
        pytest.skip("a process group is already up")
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    ref = model(tokens)
    with tempfile.TemporaryDirectory() as d:  # a one-rank group: the wrappers, not the arithmetic
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            tensor_parallel(model, None)
            torch.testing.assert_close(model(tokens), ref)
            assert type(model.blocks[0].attn.v_proj).__name__ == "ColumnParallelLinear"
        finally:
            dist.destroy_process_group()


def test_register_refuses_a_taken_name_and_unregistered_names_stay_unknown(toy):
    with pytest.raises(ValueError, match="'attention' is already declared"):
        mixer_spec.register(MixerSpec(**{**TOY.__dict__, "name": "attention"}))
    with pytest.raises(ConfigError, match="'toy_sum'.*not a known mixer"):
        _config(layer_types=["toy_sum", "attention"])
