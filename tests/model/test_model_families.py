"""The HF family adapters (``lmstack.model.families``) translate exactly as the translators they replaced:
every fixture under ``fixtures/families`` holds a tiny HF config as transformers writes it, and what the
previous ``model/hf.py`` (commit 1d479cc, ``fixtures/make_family_fixtures.py``) made of it — the lmstack
config, the HF config written back, and the HF tensor names and shapes of a saved model. The registry lists
every family ``ModelConfig`` accepts, each under the class name transformers has."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lmstack.model.config import ARCHITECTURES, ModelConfig
from lmstack.model.families import FAMILIES, family_for, family_of
from lmstack.model.hf import config_from_hf, config_to_hf, load_hf, save_hf
from lmstack.model.transformer import Transformer

FIXTURES = Path(__file__).parent / "fixtures"
CASES = sorted(p.stem for p in (FIXTURES / "families").glob("*.json"))


def _case(name):
    return json.loads((FIXTURES / "families" / f"{name}.json").read_text())


def test_every_family_is_registered_and_has_a_fixture():
    assert sorted(FAMILIES) == sorted(ARCHITECTURES)
    covered = {_case(n)["hf_config"]["model_type"] for n in CASES}
    assert covered == set(FAMILIES)
    for model_type, family in FAMILIES.items():
        assert family.model_type == model_type


@pytest.mark.slow  # transformers imports each of the 13 model classes: ~18 s
def test_every_family_is_named_as_transformers_names_it():
    transformers = pytest.importorskip("transformers")
    for family in FAMILIES.values():
        assert hasattr(transformers, family.hf_class), family.hf_class


@pytest.mark.parametrize("case", CASES)
def test_config_both_ways_as_before(case):
    rec = _case(case)
    c = config_from_hf(rec["hf_config"])
    assert c.to_dict() == rec["lmstack"]
    assert family_for(rec["hf_config"]) is family_of(c)
    assert config_to_hf(ModelConfig.from_dict(rec["lmstack"])) == rec["to_hf"]
    # what lmstack writes reads back to the same config
    assert config_from_hf(json.loads(json.dumps(rec["to_hf"]))).to_dict() == rec["lmstack"]


@pytest.mark.parametrize("case", CASES)
def test_tensor_names_both_ways_as_before(case, tmp_path):
    rec = _case(case)
    c = ModelConfig.from_dict(rec["lmstack"])
    torch.manual_seed(0)
    model = Transformer(c)
    save_hf(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = {n: list(f.get_slice(n).get_shape()) for n in f.keys()}
    assert names == rec["hf_tensors"]
    back = load_hf(tmp_path)
    want = dict(model.named_parameters())
    got = dict(back.named_parameters())
    assert sorted(got) == sorted(want)
    for n, p in want.items():
        assert torch.equal(got[n], p), n


@pytest.mark.parametrize(
    "path", sorted((FIXTURES / "configs").glob("*.json")), ids=lambda p: p.stem
)
def test_config_files_written_before_still_load(path):
    stored = json.loads(path.read_text())
    c = ModelConfig.load(path)
    assert c.to_dict() == stored
    assert ModelConfig(**stored) == c


def test_config_groups_partition_the_flat_fields():
    import dataclasses

    from lmstack.model.config import GROUPS

    flat = [f.name for f in dataclasses.fields(ModelConfig)]
    grouped = [f.name for g in GROUPS.values() for f in dataclasses.fields(g)]
    assert sorted(grouped) == sorted(flat) and len(grouped) == len(set(grouped)) == 83
    assert flat[:3] == ["vocab_size", "d_model", "n_layers"]  # the decoder first, as stored before


def test_config_groups_are_typed_views_and_set_whole():
    from lmstack.model.config import MLAConfig, MoEConfig

    tiny = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=48)
    c = ModelConfig(**tiny, n_experts=4, n_experts_per_token=1, router_scale=2.0)
    assert c.moe == MoEConfig(n_experts=4, n_experts_per_token=1, router_scale=2.0)
    assert c.mla == MLAConfig() and c.decoder.d_model == 32 and c.variants.qk_norm is False
    c2 = c.replace(moe=MoEConfig(n_experts=8))
    assert (c2.n_experts, c2.n_experts_per_token, c2.router_scale) == (8, 2, 1.0)
    mla = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    built = ModelConfig.from_groups(MLAConfig(**mla), MoEConfig(n_experts=4), **tiny)
    assert built == ModelConfig(**tiny, **mla, n_experts=4)
    with pytest.raises(Exception, match="moe=.* must be a MoEConfig"):
        c.replace(moe=MLAConfig())


def test_moe_and_mla_groups_check_their_own_fields():
    from lmstack.model.config import ConfigError, MLAConfig, MoEConfig

    with pytest.raises(ConfigError, match="n_experts_per_token=5 exceeds n_experts=4"):
        MoEConfig(n_experts=4, n_experts_per_token=5)
    with pytest.raises(ConfigError, match="needs qk_nope_head_dim >= 1"):
        MLAConfig(kv_lora_rank=8)
    with pytest.raises(ConfigError, match="router_groups=3 does not divide n_experts=8"):
        ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=48).replace(
            moe=MoEConfig(n_experts=8), router_groups=3
        )


def test_adding_a_family_is_one_adapter_and_one_registry_line(tmp_path, monkeypatch):
    """The recipe of docs/architecture.md done in a test: a toy family (Llama under other tensor names)
    is a Family subclass, registered, and its name in ARCHITECTURES; it then loads and saves."""
    import lmstack.model.config as config_module
    from lmstack.model.families import register_family
    from lmstack.model.families.llama import Llama

    class Toy(Llama):
        model_type = "toy_llama"
        hf_class = "ToyForCausalLM"
        layer_prefix = "transformer.h"
        top_names = {
            "embed.weight": "transformer.wte.weight",
            "norm.weight": "transformer.ln_f.weight",
            "lm_head.weight": "lm_head.weight",
        }
        block_names = {
            lm: hf.replace("self_attn.", "attn.").replace("mlp.", "ffn.")
            for lm, hf in Llama.block_names.items()
        }

    monkeypatch.setattr(config_module, "ARCHITECTURES", (*ARCHITECTURES, "toy_llama"))
    register_family(Toy())
    try:
        c = ModelConfig(
            vocab_size=64,
            d_model=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_ff=48,
            architecture="toy_llama",
        )
        torch.manual_seed(0)
        model = Transformer(c)
        save_hf(model, tmp_path)
        written = json.loads((tmp_path / "config.json").read_text())
        assert written["architectures"] == ["ToyForCausalLM"]
        with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert "transformer.h.1.attn.q_proj.weight" in names and "transformer.wte.weight" in names
        back = load_hf(tmp_path)
        assert back.config == c
        for n, p in model.named_parameters():
            assert torch.equal(dict(back.named_parameters())[n], p), n
    finally:
        FAMILIES.pop("toy_llama")
