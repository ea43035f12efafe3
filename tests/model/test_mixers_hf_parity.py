"""HF transformers parity for the new mixers: tiny random-weight instances built from configs, no download.

- an interleaved local/global model (Qwen2 with per-layer ``layer_types``: sliding / full attention), whole model;
- Mamba-2 (HF ``Mamba2Mixer``, the mixer of ``Mamba2ForCausalLM``), layer level;
- Gated DeltaNet (HF ``Qwen3_5GatedDeltaNet``, the linear-attention layer of Qwen3.5's 3:1 hybrid), layer level.

The two recurrent mixers are compared layer by layer because lmstack's ``Block`` always has a feed-forward
half and Mamba2 has none; Qwen3.5's full-attention layers (output-gated attention, partial RoPE, (1+γ) norms)
are not lmstack layers either.
"""

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="HF transformers is the reference for parity tests"
)

from lmstack.inference.kv_cache import MixerCache  # noqa: E402
from lmstack.model.config import ModelConfig  # noqa: E402
from lmstack.model.deltanet import GatedDeltaNet  # noqa: E402
from lmstack.model.hf import load_hf, save_hf  # noqa: E402
from lmstack.model.mamba2 import Mamba2Mixer  # noqa: E402
from lmstack.model.seam import AttentionMetadata  # noqa: E402
from lmstack.model.transformer import Transformer  # noqa: E402


def _needs(name):
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name} (it arrived in 5.x)")


def _randomise(model, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


@pytest.fixture
def local_global_hf(tmp_path):
    cfg = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=160,
        rope_theta=1000.0,
        max_position_embeddings=256,
        use_sliding_window=True,
        sliding_window=5,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    )
    hf = _randomise(transformers.Qwen2ForCausalLM(cfg).eval())
    hf.save_pretrained(tmp_path / "hf")
    return hf, tmp_path


@pytest.mark.slow
def test_local_global_qwen2_matches_hf(local_global_hf):
    hf, tmp = local_global_hf
    model = load_hf(tmp / "hf")
    assert (
        model.config.layer_types == ["local_attention"] * 3 + ["attention"]
        and model.config.local_window == 5
    )
    tokens = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        out = model(tokens)
        full = Transformer(
            model.config.replace(layer_types=None)
        )  # same weights, every layer global:
        full.load_state_dict(model.state_dict())  # the windows must matter
        assert (full(tokens)[:, 5:] - ref[:, 5:]).abs().max() > 1e-3
    assert (out - ref).abs().max().item() < 1e-4
    save_hf(model, tmp / "out")  # and back: HF reads the per-layer windows lmstack writes
    again = transformers.Qwen2ForCausalLM.from_pretrained(tmp / "out").eval()
    with torch.no_grad():
        assert (again(tokens).logits - ref).abs().max().item() < 1e-4


@pytest.mark.slow
def test_local_global_decode_keeps_only_the_window(local_global_hf):
    """Decoding with the cache == the full forward, and a local layer holds only W − 1 keys (Book of LLMs §2.5 “shrinking the KV cache”)."""
    hf, tmp = local_global_hf
    model = load_hf(tmp / "hf")
    tokens = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    cache = MixerCache()
    with torch.no_grad():
        ref = hf(tokens).logits
        outs = [model(tokens[:, :9], positions=torch.arange(9), kv_cache=cache)]
        for i in range(9, 16):
            outs.append(model(tokens[:, i : i + 1], positions=torch.tensor([i]), kv_cache=cache))
    assert (torch.cat(outs, 1) - ref).abs().max().item() < 1e-4
    assert [cache.kv[i][0].shape[2] for i in range(4)] == [4, 4, 4, 16]


def _meta(T):
    return AttentionMetadata(torch.arange(T), is_causal=True)


@pytest.mark.parametrize("S", [1, 13, 40])
def test_mamba2_mixer_matches_hf(S):
    hf_cfg = transformers.Mamba2Config(
        hidden_size=32,
        num_heads=8,
        head_dim=8,
        expand=2,
        n_groups=2,
        state_size=6,
        conv_kernel=4,
        chunk_size=16,
        layer_norm_epsilon=1e-5,
        num_hidden_layers=1,
        vocab_size=64,
    )
    hf = _randomise(
        transformers.models.mamba2.modeling_mamba2.Mamba2Mixer(hf_cfg, layer_idx=0).eval()
    )
    with torch.no_grad():  # realistic decays: A in [1, 16], Δ around softplus(−1..1)
        hf.A_log.copy_(torch.linspace(0.0, 2.77, 8))
        hf.dt_bias.copy_(torch.linspace(-1.0, 1.0, 8))
    cfg = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=1,
        n_heads=4,
        d_ff=64,
        layer_types=["mamba2"],
        ssm_expand=2,
        ssm_head_dim=8,
        ssm_n_groups=2,
        ssm_state_size=6,
        conv_kernel=4,
        mixer_chunk_size=5,
        norm_eps=1e-5,
    )
    ours = Mamba2Mixer(cfg)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, S, 32, generator=torch.Generator().manual_seed(S))
    with torch.no_grad():
        ref = hf(x)
        out = ours(x, _meta(S))
    assert (out - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("S", [1, 13, 40])
def test_gated_deltanet_matches_hf_qwen3_5(S):
    _needs("Qwen3_5TextConfig")
    hf_cfg = transformers.Qwen3_5TextConfig(
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        rms_norm_eps=1e-6,
    )
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    hf = _randomise(Qwen3_5GatedDeltaNet(hf_cfg, layer_idx=0).eval())
    with torch.no_grad():
        hf.A_log.copy_(torch.linspace(-1.0, 1.0, 4))
        hf.norm.weight.add_(1.0)
    cfg = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=1,
        n_heads=4,
        d_ff=64,
        layer_types=["gated_deltanet"],
        delta_n_heads=2,
        delta_n_v_heads=4,
        delta_head_dim=8,
        delta_v_head_dim=6,
        conv_kernel=4,
        mixer_chunk_size=7,
        norm_eps=1e-6,
    )
    ours = GatedDeltaNet(cfg)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, S, 32, generator=torch.Generator().manual_seed(S))
    with torch.no_grad():
        ref = hf(x)
        out = ours(x, _meta(S))
    assert (out - ref).abs().max().item() < 1e-4


def test_gated_deltanet_matches_hf_qwen3_next():
    """Qwen3-Next's fused in_proj_qkvz / in_proj_ba, re-laid out by hf.gated_deltanet_from_qwen3_next."""
    _needs("Qwen3NextConfig")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from lmstack.model.hf import WeightsError, gated_deltanet_from_qwen3_next

    hf_cfg = transformers.Qwen3NextConfig(
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        rms_norm_eps=1e-6,
    )
    hf = _randomise(Qwen3NextGatedDeltaNet(hf_cfg, layer_idx=0).eval(), seed=1)
    cfg = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=1,
        n_heads=4,
        d_ff=64,
        layer_types=["gated_deltanet"],
        delta_n_heads=2,
        delta_n_v_heads=4,
        delta_head_dim=8,
        delta_v_head_dim=6,
        conv_kernel=4,
        mixer_chunk_size=8,
        norm_eps=1e-6,
    )
    ours = GatedDeltaNet(cfg)
    ours.load_state_dict(gated_deltanet_from_qwen3_next(hf.state_dict(), 2, 4, 8, 6))
    x = torch.randn(2, 19, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(x, _meta(19)) - hf(x)).abs().max().item() < 1e-4
    with pytest.raises(WeightsError, match=r"in_proj_qkvz.weight has 80 rows; n_k=4 groups"):
        gated_deltanet_from_qwen3_next(hf.state_dict(), 4, 4, 8, 6)
