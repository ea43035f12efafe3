"""Parity with HF transformers: models built from small configs with random weights, no download."""

import json

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="HF transformers is the reference for parity tests"
)

from lmstack.kernels.backends import attention_impl  # noqa: E402
from lmstack.model.hf import load_config, load_hf, save_hf  # noqa: E402
from lmstack.model.io import load_model  # noqa: E402

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=160,
    rope_theta=1000.0,
    max_position_embeddings=256,
)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 6}),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {"tie_word_embeddings": True},
    ),
}


def _hf_model(family: str, **extra):
    cfg_cls, model_cls, kw = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**SMALL, **kw, **extra})).eval()
    with torch.no_grad():  # HF zero-inits biases; random everything so every weight matters
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_logits_match_transformers(family, backend, tmp_path):
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    model.set_attention(attention_impl(backend))
    tokens = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        out = model(tokens)
    assert out.shape == (2, 21, 128)
    assert (out - ref).abs().max().item() < 1e-4


def test_sliding_window_is_applied(tmp_path):
    """Mistral with W=6 matches HF, and differs from the same weights without a window."""
    hf = _hf_model("mistral")
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert model.config.sliding_window == 6
    tokens = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        windowed = model(tokens)
        model.config.sliding_window = (
            None  # the window reaches attention through the forward's metadata
        )
        full = model(tokens)
    assert torch.allclose(
        windowed[:, :6], full[:, :6], atol=1e-6
    )  # inside the window nothing changes
    assert (windowed[:, 6:] - full[:, 6:]).abs().max() > 1e-3


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("shard", [None, 30_000])
def test_roundtrip_lmstack_to_hf_format(family, shard, tmp_path):
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path / "src")
    model = load_hf(tmp_path / "src")
    save_hf(model, tmp_path / "out", max_shard_bytes=shard)
    if shard:
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    reloaded_hf = FAMILIES[family][1].from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, 128, (1, 15), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (reloaded_hf(tokens).logits - model(tokens)).abs().max().item() < 1e-5
    # and back into lmstack through the generic loader
    again = load_model(tmp_path / "out").model
    with torch.no_grad():
        torch.testing.assert_close(again(tokens), model(tokens))


def test_sharded_hf_checkpoint_loads(tmp_path):
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = load_hf(tmp_path)
    tokens = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (hf(tokens).logits - model(tokens)).abs().max().item() < 1e-4


def test_config_roundtrip_through_hf_dict(tmp_path):
    hf = _hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    c = load_config(tmp_path / "config.json")
    assert (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.d_ff, c.vocab_size) == (
        64,
        2,
        4,
        2,
        160,
        128,
    )
    assert c.qkv_bias and c.tie_embeddings and c.rope_theta == 1000.0 and c.architecture == "qwen2"


def test_bf16_load_is_close(tmp_path):
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    tokens = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(tokens).logits
        out = model(tokens).float()
    assert (out - ref).abs().max().item() < 0.1 * ref.abs().max().item()
