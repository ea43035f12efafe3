"""ModelConfig validation and presets against published numbers."""

import pytest
import torch

from lmstack.model.config import PRESETS, ConfigError, ModelConfig
from lmstack.model.transformer import Transformer

# Published totals: the model cards / safetensors index totals of each checkpoint.
PUBLISHED_PARAMS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-0.5b": 494_032_768,
    "smollm2-135m": 134_515_008,
}


def test_every_required_preset_exists():
    assert set(PUBLISHED_PARAMS) <= set(PRESETS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_param_count_on_meta_device(name):
    cfg = ModelConfig.from_preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name]


def test_param_count_formula_of_seed_for_mha():
    """P = 2VD + L(4D² + 2D + 3DF) + D (final norm) for untied MHA (Book of LLMs §1.4 “parameter count”)."""
    V, D, L, F = 1000, 64, 3, 176
    cfg = ModelConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=4, d_ff=F)
    assert Transformer(cfg).num_params() == 2 * V * D + L * (4 * D * D + 2 * D + 3 * D * F) + D


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=1000, n_heads=12), "n_heads=12 does not divide d_model=1000"),
        (dict(d_model=36, n_heads=4), "head_dim=9 is odd"),
        (dict(d_model=64, n_heads=12, head_dim=7), "head_dim=7 is odd"),
        (dict(n_heads=12, n_kv_heads=5, d_model=96), "n_kv_heads=5 does not divide n_heads=12"),
        (dict(vocab_size=0), "vocab_size=0 must be a positive integer"),
        (dict(n_layers=2.5), "n_layers=2.5 must be a positive integer"),
        (dict(rope_layout="spiral"), "rope_layout='spiral'"),
        (dict(sliding_window=0), "sliding_window=0"),
        (dict(norm_eps=0.0), "norm_eps=0.0"),
        (dict(architecture="gpt2"), "architecture='gpt2'"),
    ],
)
def test_bad_configs_give_clear_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**kwargs)


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError, match="unknown model preset 'gpt5'.*llama2-7b"):
        ModelConfig.from_preset("gpt5")


def test_gqa_symbols():
    c = ModelConfig.from_preset("llama3-8b")
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.group_size) == (32, 8, 128, 4)
    mqa = ModelConfig(d_model=64, n_heads=8, n_kv_heads=1, d_ff=128, vocab_size=10)
    assert mqa.group_size == 8


def test_json_roundtrip_and_unknown_field(tmp_path):
    c = ModelConfig.from_preset("mistral-7b")
    c.save(tmp_path / "c.json")
    assert ModelConfig.load(tmp_path / "c.json") == c
    (tmp_path / "bad.json").write_text('{"d_model": 64, "n_head": 4}')
    with pytest.raises(ConfigError, match=r"bad.json: unknown ModelConfig field\(s\) \['n_head'\]"):
        ModelConfig.load(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text('{"d_model": ')
    with pytest.raises(ConfigError, match="broken.json: not valid JSON"):
        ModelConfig.load(tmp_path / "broken.json")
