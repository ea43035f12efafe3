"""Issue #31: a per-expert HF tensor is checked like every other weight before the experts are stacked —
an int32 expert (a safetensors F32 header changed to I32: same byte size) was promoted to float by
``torch.stack`` and loaded, while an int32 ``q_proj`` was refused; an expert of the wrong shape was a raw
``torch.stack`` error naming no tensor."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="a tiny HF Mixtral checkpoint")

from lmstack.model.hf import WeightsError, load_hf  # noqa: E402

EXPERT = (
    "model.layers.0.block_sparse_moe.experts.2.w1.weight"  # Mixtral w1 = gate: (F, D) = (48, 32)
)


@pytest.fixture(scope="module")
def mixtral_state(tmp_path_factory):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    d = tmp_path_factory.mktemp("mixtral")
    transformers.MixtralForCausalLM(cfg).save_pretrained(d)
    return d, load_file(str(d / "model.safetensors"))


def _save(d, state):
    from safetensors.torch import save_file

    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "name", [EXPERT, "model.layers.0.self_attn.q_proj.weight"], ids=["expert", "q_proj"]
)
def test_an_int32_expert_is_refused_like_an_int32_q_proj(mixtral_state, name):
    d, state = mixtral_state
    _save(d, {**state, name: state[name].view(torch.int32)})  # the same bytes read as I32
    with pytest.raises(WeightsError, match=r"has dtype torch\.int32.*expected a floating-point"):
        load_hf(d)


def test_an_expert_of_the_wrong_shape_names_tensor_and_shapes(mixtral_state):
    d, state = mixtral_state
    _save(d, {**state, EXPERT: state[EXPERT][:, :-1].contiguous()})
    with pytest.raises(WeightsError, match=rf"'{EXPERT}'.*shape \(48, 31\).*shape \(48, 32\)"):
        load_hf(d)
    _save(d, state)
    load_hf(d)  # the untouched checkpoint loads
