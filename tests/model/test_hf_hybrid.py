"""Whole-model HF parity for the recurrent / hybrid / interleaved families (CS336 notes "注意力机制"):
Mamba2ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM (text) and Qwen3NextForCausalLM — tiny random-weight
instances built from configs, no download. Each: logits within 1e-4 (fp32) of transformers, lmstack's cached decode
(MixerCache: K/V for attention layers, conv + recurrent state for Mamba-2 / Gated DeltaNet layers) == HF's full
forward, batch-1 greedy ``generate`` == greedy argmax over HF's full forward, and HF-format save -> HF load.
Bad checkpoints and configs: errors naming the layer, the tensor / field and both shapes.
"""

import json

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="HF transformers is the reference for parity tests"
)

from lmstack.inference.generate import generate  # noqa: E402
from lmstack.inference.kv_cache import MixerCache  # noqa: E402
from lmstack.inference.sampling import SamplingParams  # noqa: E402
from lmstack.model.config import ConfigError, ModelConfig  # noqa: E402
from lmstack.model.hf import WeightsError, load_hf, save_hf  # noqa: E402
from lmstack.model.transformer import Transformer  # noqa: E402

V = 64


def _randomise(model, std=0.1, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model


def _mamba2(**extra):
    cfg = transformers.Mamba2Config(
        hidden_size=32,
        num_heads=8,
        head_dim=8,
        expand=2,
        n_groups=2,
        state_size=6,
        conv_kernel=4,
        chunk_size=16,
        num_hidden_layers=3,
        vocab_size=V,
        layer_norm_epsilon=1e-5,
        **extra,
    )
    hf = _randomise(transformers.Mamba2ForCausalLM(cfg).eval(), std=0.2)
    with torch.no_grad():  # realistic decays: A in [1, 16], Δ around softplus(−1..1)
        for layer in hf.backbone.layers:
            layer.mixer.A_log.copy_(torch.linspace(0.0, 2.77, 8))
            layer.mixer.dt_bias.copy_(torch.linspace(-1.0, 1.0, 8))
    return hf


def _gemma2(**extra):
    cfg = transformers.Gemma2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=5,
        query_pre_attn_scalar=12,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=3.0,
        max_position_embeddings=128,
        **extra,
    )
    return _randomise(transformers.Gemma2ForCausalLM(cfg).eval())


def _gemma3(**extra):
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    }
    cfg = transformers.Gemma3TextConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=5,
        query_pre_attn_scalar=12,
        rope_parameters=rope,
        max_position_embeddings=128,
        **extra,
    )
    return _randomise(transformers.Gemma3ForCausalLM(cfg).eval())


def _qwen3_next(**extra):
    cfg = transformers.Qwen3NextConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        decoder_sparse_step=2,
        max_position_embeddings=128,
        **extra,
    )
    hf = _randomise(transformers.Qwen3NextForCausalLM(cfg).eval())
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.copy_(torch.linspace(-1.0, 1.0, 4))
    return hf


FAMILIES = {"mamba2": _mamba2, "gemma2": _gemma2, "gemma3": _gemma3, "qwen3_next": _qwen3_next}
KINDS = {
    "mamba2": ["mamba2"] * 3,
    "gemma2": ["local_attention", "attention"] * 2,
    "gemma3": ["local_attention"] * 5 + ["attention", "local_attention"],
    "qwen3_next": ["gated_deltanet"] * 3 + ["attention"],
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """(family, HF model, lmstack model loaded from the HF checkpoint, checkpoint dir)."""
    hf = FAMILIES[request.param]()
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d / "hf")
    return request.param, hf, load_hf(d / "hf"), d


def _tokens(B, S, seed=1):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def test_logits_match_hf(pair):
    family, hf, model, _ = pair
    assert model.config.mixer_types == KINDS[family]
    tokens = _tokens(2, 37)  # 37: not a multiple of the chunk sizes; > the window of 5
    with torch.no_grad():
        ref, out = hf(tokens).logits, model(tokens)
    assert ref.abs().max() > 0.2  # the logits carry signal
    assert (out - ref).abs().max().item() < 1e-4


def test_parameter_count_matches_hf_and_accounting(pair):
    """lmstack's model and ``accounting.mixers.model_params`` count what transformers' model holds."""
    from lmstack.accounting.mixers import model_params

    _, hf, model, _ = pair
    n_hf = sum(p.numel() for p in hf.parameters())
    assert model.num_params() == n_hf == model_params(model.config)


def test_cached_decode_equals_full_forward(pair):
    """Prefill 9 tokens (longer than the window W = 5) in two chunks of 4 and 5 (the second continues the conv and
    recurrent states), then decode one token at a time with the MixerCache."""
    family, hf, model, _ = pair
    tokens = _tokens(1, 20, seed=2)
    cache = MixerCache()
    with torch.no_grad():
        ref = hf(tokens).logits
        outs = [
            model(tokens[:, :4], positions=torch.arange(4), kv_cache=cache),
            model(tokens[:, 4:9], positions=torch.arange(4, 9), kv_cache=cache),
        ]
        for i in range(9, 20):
            outs.append(model(tokens[:, i : i + 1], positions=torch.tensor([i]), kv_cache=cache))
    assert (torch.cat(outs, 1) - ref).abs().max().item() < 1e-4
    if family.startswith(
        "gemma"
    ):  # local layers keep only their last W − 1 = 4 keys (Book of LLMs §2.5 “shrinking the KV cache”)
        held = {i: cache.kv[i][0].shape[2] for i in cache.kv}
        assert {held[i] for i, k in enumerate(KINDS[family]) if k == "local_attention"} == {4}
    if family != "mamba2":
        held = {i: cache.kv[i][0].shape[2] for i in cache.kv}
        assert {held[i] for i, k in enumerate(KINDS[family]) if k == "attention"} == {20}
    if family in ("mamba2", "qwen3_next"):
        assert len(cache.states) == sum(k in ("mamba2", "gated_deltanet") for k in KINDS[family])


@pytest.mark.slow
def test_generate_matches_hf_greedy(pair):
    """lmstack's batch-1 generate (state cache) emits HF's greedy tokens, recomputed by full forwards."""
    _, hf, model, _ = pair
    prompt = _tokens(1, 7, seed=3)[0].tolist()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    got = list(generate(model, prompt, SamplingParams(temperature=0.0, max_tokens=8)))
    assert got == ids[len(prompt) :]


def test_save_hf_round_trip(pair):
    family, hf, model, d = pair
    save_hf(model, d / "out")
    again_hf = type(hf).from_pretrained(d / "out").eval()
    again = load_hf(d / "out")
    tokens = _tokens(1, 15, seed=4)
    with torch.no_grad():
        ref = hf(tokens).logits
        assert (again_hf(tokens).logits - ref).abs().max().item() < 1e-5
        assert (again(tokens) - ref).abs().max().item() < 1e-4
    assert again.config == model.config


def test_gemma2_softcaps_and_windows_matter(tmp_path):
    _gemma2().save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    tokens = _tokens(1, 30, seed=5)
    with torch.no_grad():
        out = model(tokens)
        assert out.abs().max() < 3.0  # final_logit_softcapping = 3
        for change in (dict(attn_softcap=None), dict(layer_types=["attention"] * 4)):
            other = Transformer(model.config.replace(**change))
            other.load_state_dict(model.state_dict())
            assert (other(tokens) - out).abs().max() > 1e-3


def test_gemma3_linear_rope_scaling_on_global_layers(tmp_path):
    """Gemma-3 4B+ scale the global layers' RoPE linearly (positions / 8); the local layers keep theirs."""
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    }
    cfg = transformers.Gemma3TextConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=5,
        query_pre_attn_scalar=12,
        rope_parameters=rope,
        max_position_embeddings=128,
    )
    hf = _randomise(transformers.Gemma3ForCausalLM(cfg).eval())
    hf.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    assert model.config.rope_linear_factor == 8.0
    tokens = _tokens(2, 30, seed=7)
    with torch.no_grad():
        ref = hf(tokens).logits
        assert (model(tokens) - ref).abs().max().item() < 1e-4
        plain = Transformer(model.config.replace(rope_linear_factor=None))
        plain.load_state_dict(model.state_dict())
        assert (plain(tokens) - ref).abs().max() > 1e-3
    save_hf(model, tmp_path / "out")
    with torch.no_grad():
        again = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / "out").eval()
        assert (again(tokens).logits - ref).abs().max().item() < 1e-5


def test_mamba2_time_step_limit(tmp_path):
    """HF's time_step_limit clamps Δ after the softplus; a tight limit changes the logits and lmstack follows."""
    hf = _mamba2(time_step_limit=(0.0, 0.4))
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert model.config.ssm_dt_limit == [0.0, 0.4]
    tokens = _tokens(2, 21, seed=6)
    with torch.no_grad():
        ref = hf(tokens).logits
        assert (model(tokens) - ref).abs().max().item() < 1e-4
        free = Transformer(model.config.replace(ssm_dt_limit=None))
        free.load_state_dict(model.state_dict())
        assert (free(tokens) - ref).abs().max() > 1e-3


# ---- bad checkpoints and configs ------------------------------------------------------------------------
def _rewrite_tensor(d, name, fn):
    from safetensors.torch import load_file, save_file

    state = load_file(str(d / "model.safetensors"))
    state[name] = fn(state[name])
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "family,name,fn,expect",
    [
        (
            "mamba2",
            "backbone.layers.1.mixer.conv1d.weight",
            lambda t: t[..., :3].contiguous(),
            r"layer 1 \(mamba2\): tensor 'backbone.layers.1.mixer.conv1d.weight' has shape \(88, 1, 3\), but the config "
            r"makes it \(88, 1, 4\) \(fields: conv_kernel",
        ),
        (
            "mamba2",
            "backbone.layers.2.mixer.A_log",
            lambda t: t[:6].contiguous(),
            r"layer 2 \(mamba2\): tensor 'backbone.layers.2.mixer.A_log' has shape \(6,\), but the config makes it "
            r"\(8,\) \(fields: num_heads",
        ),
        (
            "qwen3_next",
            "model.layers.1.linear_attn.conv1d.weight",
            lambda t: t[:50].contiguous(),
            r"layer 1 \(gated_deltanet\): tensor 'model.layers.1.linear_attn.conv1d.weight' has shape \(50, 1, 4\), but "
            r"the config makes it \(56, 1, 4\)",
        ),
        (
            "qwen3_next",
            "model.layers.2.linear_attn.in_proj_qkvz.weight",
            lambda t: t[:60].contiguous(),
            r"layer 2 \(gated_deltanet.*in_proj_qkvz.weight has 60 rows; n_k=2 groups",
        ),
        (
            "gemma3",
            "model.layers.5.self_attn.k_norm.weight",
            lambda t: t[:6].contiguous(),
            r"layer 5 \(attention\): tensor 'model.layers.5.self_attn.k_norm.weight' has shape \(6,\), but the config "
            r"makes it \(8,\) \(fields: head_dim",
        ),
    ],
)
def test_shape_mismatch_names_layer_field_and_shapes(tmp_path, family, name, fn, expect):
    FAMILIES[family]().save_pretrained(tmp_path)
    _rewrite_tensor(tmp_path, name, fn)
    with pytest.raises(WeightsError, match=expect):
        load_hf(tmp_path)


@pytest.mark.parametrize(
    "family,name,expect",
    [
        (
            "mamba2",
            "backbone.layers.2.mixer.D",
            r"layer 2 \(mamba2\): missing tensor 'backbone.layers.2.mixer.D'",
        ),
        (
            "gemma2",
            "model.layers.1.post_feedforward_layernorm.weight",
            r"layer 1 \(attention\): missing tensor 'model.layers.1.post_feedforward_layernorm.weight'",
        ),
        (
            "qwen3_next",
            "model.layers.3.self_attn.q_norm.weight",
            r"layer 3 \(attention\): missing tensor 'model.layers.3.self_attn.q_norm.weight'",
        ),
    ],
)
def test_missing_tensor_names_layer_and_hf_name(tmp_path, family, name, expect):
    from safetensors.torch import load_file, save_file

    FAMILIES[family]().save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state[name]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=expect):
        load_hf(tmp_path)


@pytest.mark.parametrize(
    "family,change,expect",
    [
        (
            "mamba2",
            {"use_bias": True},
            r"use_bias=True is not supported by lmstack's Mamba2ForCausalLM loader",
        ),
        (
            "mamba2",
            {"residual_scale": 0.5},
            r"field\(s\) \['residual_scale'\] are not supported by lmstack's "
            r"Mamba2ForCausalLM loader",
        ),
        (
            "mamba2",
            {"num_heads": 4},
            r"num_heads=4 x head_dim=8 must equal expand x hidden_size = 64",
        ),
        (
            "gemma2",
            {"attention_bias": True},
            r"attention_bias=True is not supported by lmstack's Gemma2ForCausalLM",
        ),
        ("gemma2", {"hidden_activation": "gelu"}, r"hidden_activation='gelu' is not supported"),
        (
            "gemma3",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            r"rope_parameters.full_attention.rope_type='yarn' is not supported",
        ),
        (
            "gemma3",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                }
            },
            r"rope_parameters.sliding_attention.rope_type='linear' is not supported",
        ),
        ("qwen3_next", {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\] is not supported"),
        (
            "qwen3_next",
            {"layer_types": ["linear_attention"] * 3 + ["mamba"]},
            r"layer_types\[3\]='mamba' \(layer 3\)",
        ),
    ],
)
def test_unsupported_config_fields_are_named(tmp_path, family, change, expect):
    FAMILIES[family]().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    d = json.loads(path.read_text())
    d.update(change)
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=expect):
        load_hf(tmp_path)


def test_llama_family_refuses_to_export_hybrid_fields():
    from lmstack.model.hf import config_to_hf

    cfg = ModelConfig(
        vocab_size=V,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        sandwich_norm=True,
        final_softcap=5.0,
    )
    with pytest.raises(
        ConfigError, match=r"\['sandwich_norm', 'final_softcap'\] set on architecture='llama'"
    ):
        config_to_hf(cfg)


# ---- initialisation -----------------------------------------------------------------------------------
def test_init_weights_sets_recurrent_reference_values_and_offset_norms():
    """Transformer(cfg) draws the recurrent parameters from their reference ranges (A ∈ [1, 16], Δ = softplus(dt_bias)
    ∈ [1e-3, 1e-1], D = 1) and zero-centred norms start at w = 0 (γ = 1)."""
    cfg = ModelConfig(
        vocab_size=V,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        layer_types=["mamba2", "attention"],
        ssm_head_dim=8,
        ssm_state_size=6,
        norm_offset=True,
        qk_norm=True,
    )
    model = Transformer(cfg, seed=3)
    mixer = model.blocks[0].attn
    A = mixer.A_log.exp()
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert A.min() >= 1.0 and A.max() <= 16.0 and A.std() > 0.5
    assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 1e-1 + 1e-7
    assert torch.equal(mixer.D, torch.ones_like(mixer.D))
    for name in ("attn_norm", "ffn_norm"):
        assert torch.equal(getattr(model.blocks[1], name).weight, torch.zeros(32))
    assert torch.equal(model.blocks[1].attn.q_norm.weight, torch.zeros(8))
    x = torch.randn(3, 32)
    assert torch.allclose(
        model.norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps), atol=1e-6
    )


if (
    __name__ == "__main__"
):  # the figures in docs/model.md: max |Δ logits| vs transformers per family
    import tempfile
    from pathlib import Path

    for _fam, build in FAMILIES.items():
        hf = build()
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp)
            model = load_hf(Path(tmp))
        tokens = _tokens(2, 37)
        with torch.no_grad():
            ref = hf(tokens).logits
            full = (model(tokens) - ref).abs().max().item()
            cache = MixerCache()
            steps = [model(tokens[:1, :9], positions=torch.arange(9), kv_cache=cache)]
            steps += [
                model(tokens[:1, i : i + 1], positions=torch.tensor([i]), kv_cache=cache)
                for i in range(9, 37)
            ]
            dec = (torch.cat(steps, 1) - ref[:1]).abs().max().item()
        print(
            f"{type(hf).__name__:24s} layers {model.config.mixer_types}  max|Δ| full {full:.1e}  decode {dec:.1e}  "
            f"(|logits| max {ref.abs().max().item():.2f})"
        )


def test_gemma2_softcap_reaches_every_logits_path(tmp_path):
    """The final soft-cap is part of ``unembed``: paths that unembed hidden states themselves (the engine's
    runner, perplexity, the trainer's loss) give HF's logits, and the trainer's loss is HF's cross-entropy."""
    import contextlib
    from types import SimpleNamespace

    from lmstack.inference import LLM
    from lmstack.train.trainer import Trainer

    hf = _gemma2()
    hf.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    tokens = _tokens(1, 12, seed=7)
    with torch.no_grad():
        ref = hf(tokens).logits
        assert (model.unembed(model(tokens, return_hidden=True)) - ref).abs().max().item() < 1e-4
        out = LLM(model, block_size=4, num_blocks=32).generate(
            [tokens[0].tolist()], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        )[0]
        want = torch.log_softmax(ref[0, :-1].double(), -1).gather(-1, tokens[0, 1:, None])[:, 0]
        got = torch.tensor([lp for lp, _ in out.prompt_logprobs[1:]], dtype=torch.float64)
        assert (got - want).abs().max().item() < 1e-4
        hf_loss = torch.nn.functional.cross_entropy(ref[0, :-1], tokens[0, 1:]).item()
    # the trainer's loss with fused_loss on: Trainer.forward_loss reads only these attributes
    fake = SimpleNamespace(
        config=SimpleNamespace(fused_loss=True, z_loss=0.0),
        parallel_model=None,
        _parallelize_fn=None,
        raw_model=model,
        model=model,
        autocast=contextlib.nullcontext,
    )
    batch = SimpleNamespace(x=tokens[:, :-1], y=tokens[:, 1:], positions=None, document_ids=None)
    loss, _ = Trainer.forward_loss(fake, batch)
    assert abs(loss.item() - hf_loss) < 1e-4


def test_layers_own_rope_tables_are_reserved_for_the_static_decoder(tmp_path, monkeypatch):
    """Gemma-3's local layers keep their own RoPE tables; the static (compiled) decoder cannot grow tables inside
    its graph, so it reserves every table the model reads (Transformer.ropes), not just the shared one."""
    from lmstack.inference.static import StaticDecoder
    from lmstack.model.layers import RotaryEmbedding

    monkeypatch.setattr(RotaryEmbedding, "INITIAL_POSITIONS", 16)
    _gemma3().save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    ropes = model.ropes()
    assert len(ropes) > 1 and all(r.length == 16 for r in ropes)
    StaticDecoder(model, max_seq_len=100)
    assert all(r.length >= 100 for r in ropes)
