"""Parameter counts vs published totals, HF models and the lmstack model (Book of LLMs §1.4 “parameter count”)."""

import pytest

from lmstack.accounting.params import (
    matmul_params,
    moe_params,
    param_counts,
    seed_total_params,
    total_params,
)
from lmstack.model.config import PRESETS, ModelConfig

# Totals published on each model's Hugging Face page / safetensors index (parameter count).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama3-8b": 8_030_261_248,
    "smollm2-135m": 134_515_008,
    "qwen2.5-0.5b": 494_032_768,
    "mistral-7b": 7_241_732_096,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_totals(name):
    assert total_params(ModelConfig.from_preset(name)) == PUBLISHED[name]


def test_llama2_70b_and_llama3_70b_hand_count():
    # Hand count: 2VD + L(2D² + 2D·KH + 3DF + 2D) + D with V=32000/128256, D=8192, L=80, K·H=1024, F=28672.
    D, L, KH, F = 8192, 80, 8 * 128, 28672
    per_layer = 2 * D * D + 2 * D * KH + 3 * D * F + 2 * D
    assert (
        total_params(ModelConfig.from_preset("llama2-70b"))
        == 2 * 32000 * D + L * per_layer + D
        == 68_976_648_192
    )
    assert (
        total_params(ModelConfig.from_preset("llama3-70b"))
        == 2 * 128256 * D + L * per_layer + D
        == 70_553_706_496
    )


def test_seed_formula_for_mha():
    # Book of LLMs §1.4 “parameter count”: P = 2VD + L(4D² + 2D + 3DF), plus the final norm D that the formula leaves out.
    cfg = ModelConfig.from_preset("llama2-7b")
    assert seed_total_params(32000, 4096, 32, 11008) + 4096 == total_params(cfg)


def test_seed001_param_llama2_13b():
    # CS336 notes "性能指标分析" table: num_params 13,015,449,600 (matrices only, no norms).
    assert matmul_params(ModelConfig.from_preset("llama2-13b")) == 13_015_449_600


def test_components_llama3_8b():
    pc = param_counts(ModelConfig.from_preset("llama3-8b"))
    # by hand: V·D = 128256·4096; attention 32·(2·4096² + 2·4096·1024); FFN 32·3·4096·14336
    assert pc.embedding == pc.unembedding == 525_336_576
    assert pc.attention == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024) == 1_342_177_280
    assert pc.ffn == 5_637_144_576
    assert pc.norms == 32 * 2 * 4096 + 4096
    assert pc.non_embedding == pc.total - 2 * 525_336_576


def test_tied_has_no_unembedding():
    pc = param_counts(ModelConfig.from_preset("smollm2-135m"))
    assert pc.unembedding == 0 and pc.embedding == 49152 * 576


def test_mixtral_moe_total_and_active():
    # Mixtral-8x7B (HF config: Mistral-7B dims, 8 experts, top-2): 46,702,792,704 parameters
    # published; ~12.9B active per token (Mixtral paper: "13B active").
    cfg = ModelConfig.from_preset("mistral-7b")
    m = moe_params(cfg, n_experts=8, top_k=2)
    assert m.total == 46_702_792_704
    assert m.active == 12_879_925_248
    with pytest.raises(ValueError, match="top_k=9"):
        moe_params(cfg, n_experts=8, top_k=9)


def _hf_cases():
    return sorted(PRESETS)


@pytest.mark.parametrize("name", _hf_cases())
def test_equals_hf_model_numel(name):
    from accounting_hf_ref import hf_numel_meta

    cfg = ModelConfig.from_preset(name)
    assert total_params(cfg) == hf_numel_meta(cfg)


def test_qk_norm_and_odd_shapes_vs_formula():
    # H ≠ D/N, MQA, tied, biases, QK-norm: count by hand.
    cfg = ModelConfig(
        vocab_size=100,
        d_model=48,
        n_layers=3,
        n_heads=4,
        n_kv_heads=1,
        head_dim=16,
        d_ff=80,
        tie_embeddings=True,
        qkv_bias=True,
        qk_norm=True,
    )
    attn = 48 * 64 + 2 * 48 * 16 + 64 * 48 + (64 + 2 * 16)
    per_layer = attn + 3 * 48 * 80 + 2 * 48 + 2 * 16
    assert total_params(cfg) == 100 * 48 + 3 * per_layer + 48


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_equals_lmstack_model_numel(name):
    import torch

    from lmstack.model.transformer import Transformer

    cfg = ModelConfig.from_preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert total_params(cfg) == sum(p.numel() for p in model.parameters())


def test_lmstack_model_numel_with_bias_and_qk_norm():
    import torch

    from lmstack.model.transformer import Transformer

    cfg = ModelConfig(
        vocab_size=100,
        d_model=48,
        n_layers=3,
        n_heads=4,
        n_kv_heads=1,
        head_dim=16,
        d_ff=80,
        tie_embeddings=True,
        qkv_bias=True,
        qk_norm=True,
    )
    with torch.device("meta"):
        model = Transformer(cfg)
    assert total_params(cfg) == sum(p.numel() for p in model.parameters())
