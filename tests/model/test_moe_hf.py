"""Parity with HF transformers for the MoE / MLA families: tiny random-weight models built from configs
(no download) with peaked attention, fp32 logits within 2e-5 of the logits' scale; MLA layer by layer
against HF's attention module; HF-format save -> load round trips, and bad-input errors."""

import json

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="HF transformers is the reference for parity tests"
)

from lmstack.kernels.backends import attention_impl  # noqa: E402
from lmstack.model.config import ConfigError  # noqa: E402
from lmstack.model.hf import WeightsError, load_hf, save_hf  # noqa: E402
from lmstack.model.io import load_model  # noqa: E402

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=256,
    rope_theta=1000.0,
)
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
)

FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, clip_qkv=0.9, pad_token_id=0, eos_token_id=1),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=2,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            head_dim=24,
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=2,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
            **MLA,
        ),
    ),
    "deepseek_v2_lite": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",  # V2-Lite: full-rank q, greedy routing
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            **{**MLA, "q_lora_rank": None},
        ),
    ),
    "deepseek_v2_yarn": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",  # YaRN as in the real V2 configs
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.9,
            },
            **MLA,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            **MLA,
        ),
    ),
}


def _hf_model(family: str, **extra):
    cfg_name, model_name, kw = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(
        getattr(transformers, cfg_name)(**{**SMALL, **kw, **extra})
    ).eval()
    with torch.no_grad():  # random everything (HF zero-inits some), so every weight matters
        for _name, p in model.named_parameters():
            p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def _peak_attention(hf, layers=None):
    """Make attention peaked: the gains of the attention's input norm and of every norm inside it ~1 (not
    N(0, 0.1)), the query/key-side projections ×4 (v and o untouched). Measured, the mean of each query's
    largest attention weight becomes 0.7-0.86 (olmoe 0.14: clip_qkv; qwen3_moe 0.23: q/k norms) instead of
    0.08, where softmax is nearly uniform and a wrong query scale or an unrotated RoPE part moves the logits
    by less than any tolerance."""
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            if layers is not None and i not in layers:
                continue
            layer.input_layernorm.weight.add_(1.0)
            for name, p in layer.self_attn.named_parameters():
                if "norm" in name:
                    p.add_(1.0)
                elif not name.startswith(("o_proj", "v_proj")):
                    p.mul_(4.0)
    return hf


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, tmp_path):
    hf = _peak_attention(_hf_model(family))
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        scale = ref.abs().max().item()
        out = model(tokens)  # measured: at most 5.6e-6 of the scale (mixtral); 2e-7 before peaking
        assert (out - ref).abs().max().item() < 2e-5 * scale
        model.set_attention(attention_impl("reference"))
        assert (model(tokens) - ref).abs().max().item() < 2e-5 * scale


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_roundtrip_lmstack_to_hf_format(family, tmp_path):
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path / "src")
    model = load_hf(tmp_path / "src")
    save_hf(model, tmp_path / "out", max_shard_bytes=200_000)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "src" / "model.safetensors"), "pt") as f:
        hf_names = set(f.keys())
    assert (
        set(
            json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())[
                "weight_map"
            ]
        )
        == hf_names
    )
    reloaded = getattr(transformers, FAMILIES[family][1]).from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, 128, (1, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (reloaded(tokens).logits - model(tokens)).abs().max().item() < 1e-4
        again = load_model(tmp_path / "out").model
        torch.testing.assert_close(again(tokens), model(tokens))


def test_config_fields_translate(tmp_path):
    from lmstack.model.hf import config_from_hf

    _hf_model("deepseek_v3").save_pretrained(tmp_path)
    c = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (
        c.n_experts,
        c.n_experts_per_token,
        c.d_ff_expert,
        c.n_shared_experts,
        c.moe_first_dense,
    ) == (8, 2, 32, 1, 1)
    assert (c.kv_lora_rank, c.q_lora_rank, c.qk_rope_head_dim, c.router_score, c.router_groups) == (
        16,
        24,
        8,
        "sigmoid",
        4,
    )
    assert c.router_aux_free_bias and c.router_scale == 2.5 and c.is_mla


def test_bad_hf_configs_name_field_and_value(tmp_path):
    hf = _hf_model("qwen2_moe")
    hf.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    from lmstack.model.hf import config_from_hf

    with pytest.raises(ConfigError, match=r"mlp_only_layers=\[1\] is not supported"):
        config_from_hf({**d, "mlp_only_layers": [1]})
    with pytest.raises(ConfigError, match="n_experts_per_token=7 exceeds n_experts=6"):
        config_from_hf({**d, "num_experts_per_tok": 7})
    with pytest.raises(
        ConfigError, match="topk_method='noaux_tc' is not supported for deepseek_v2"
    ):
        config_from_hf(
            {
                **d,
                "model_type": "deepseek_v2",
                "topk_method": "noaux_tc",
                "n_routed_experts": 4,
                "moe_intermediate_size": 8,
                **MLA,
            }
        )
    with pytest.raises(ConfigError, match="missing required field 'num_local_experts'"):
        config_from_hf({**d, "model_type": "mixtral", "sliding_window": None})


def test_missing_expert_weights_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _hf_model("mixtral").save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        WeightsError,
        match=r"layer 1 expert weight down_proj is missing for experts \[3\], but "
        r"the config says n_experts=4",
    ):
        load_hf(tmp_path)


MLA_FAMILIES = sorted(f for f in FAMILIES if f.startswith("deepseek"))


def _peaked_mla(family, tmp_path):
    """An HF DeepSeek model whose first attention layer has peaked attention: latent norms ~1 (not N(0, 0.1))
    and the projections ×4, so the mean of each query's largest attention weight is 0.7-0.85 (measured; 0.1
    with the plain weights, where softmax is nearly uniform and the query scale hardly shows)."""
    hf = _peak_attention(_hf_model(family), layers={0})
    hf.config._attn_implementation = "eager"  # HF's own softmax(q kᵀ · scaling + mask) v
    hf.save_pretrained(tmp_path)
    return hf, load_hf(tmp_path)


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_mla_layer_equals_hf_attention_with_peaked_weights(family, tmp_path):
    """lmstack's MLA layer (expanded form without a cache, absorbed form with a latent cache) against HF's
    DeepseekV2/V3Attention module on the same weights and inputs; the query scale against HF's ``scaling``
    (1/sqrt(H_n + d_R), times YaRN's mscale(factor, mscale_all_dim)² when the config has YaRN)."""
    from lmstack.inference.kv_cache import LatentKVCache
    from lmstack.model.seam import AttentionMetadata

    hf, model = _peaked_mla(family, tmp_path)
    hf_attn, attn = hf.model.layers[0].self_attn, model.blocks[0].attn
    assert attn.q_scale / attn.h_qk**0.5 == pytest.approx(hf_attn.scaling, rel=1e-12)
    B, T = 2, 17
    x = torch.randn(B, T, SMALL["hidden_size"], generator=torch.Generator().manual_seed(0))
    pos = torch.arange(T)
    mask = torch.full((T, T), float("-inf")).triu(1)[
        None, None
    ]  # (1, 1, T, T) additive causal mask
    with torch.no_grad():
        ref, weights = hf_attn(
            x, attention_mask=mask, position_embeddings=hf.model.rotary_emb(x, pos[None])
        )
        assert weights.max(-1).values[..., 8:].mean() > 0.6  # peaked: the test sees the query scale
        scale = ref.abs().max().item()
        out = attn(x, AttentionMetadata(pos, is_causal=True))
        assert (out - ref).abs().max().item() < 1e-5 * scale  # measured: 2e-7 to 5e-7 relative
        cache = LatentKVCache(
            model.config, batch_size=B, max_len=T
        )  # absorbed: prefill 12, then 5 decodes
        parts = [attn(x[:, :12], AttentionMetadata(pos[:12], cache=cache))]
        parts += [
            attn(x[:, t : t + 1], AttentionMetadata(pos[t : t + 1], cache=cache))
            for t in range(12, T)
        ]
        assert (torch.cat(parts, dim=1) - ref).abs().max().item() < 1e-5 * scale
