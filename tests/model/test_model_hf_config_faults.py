"""Corrupt HF ``config.json`` files, one class of fault at a time, across every family: each is a
ConfigError (never a TypeError, a KeyError or a model with a silently wrong shape) whose message names the
HF field at fault. The configs start from the tiny ones transformers writes (``fixtures/families``)."""

import json
from pathlib import Path

import pytest

from lmstack.model.config import ConfigError
from lmstack.model.hf import config_from_hf, load_config

CASES = {
    p.stem: json.loads(p.read_text())["hf_config"]
    for p in sorted((Path(__file__).parent / "fixtures" / "families").glob("*.json"))
}
#: the field holding the query head count, and whether the family reads num_key_value_heads
HEADS = {"mamba2": "num_heads"}
NO_KV = ("mamba2", "deepseek_v2", "deepseek_v3")  # MLA: K = N whatever num_key_value_heads says
READS_LAYER_TYPES = ("qwen2_local_global", "gemma2", "gemma3", "qwen3_next")


def _set(d, **kw):
    return {**d, **kw}


def _without(d, key):
    return {k: v for k, v in d.items() if k != key}


def missing(case, d, field):
    return (_without(d, field), field) if field in d else None


def faults(case, d):
    """(fault class, corrupt config, the field its error must name) for one family's config."""
    heads = HEADS.get(d["model_type"], "num_attention_heads")
    out = []
    required = ("vocab_size", "hidden_size", "num_hidden_layers")
    if (
        heads == "num_attention_heads"
    ):  # Mamba-2's num_heads defaults to expand x hidden_size / head_dim
        required += (heads,)
    for field in required:
        out.append(("missing", *missing(case, d, field)))
    for field, bad in (
        ("hidden_size", "64"),
        ("hidden_size", 64.5),
        ("hidden_size", None),
        ("num_hidden_layers", [3]),
        ("vocab_size", True),
        ("tie_word_embeddings", "false"),
    ):
        out.append(("wrong type", _set(d, **{field: bad}), field))
    if "rms_norm_eps" in d:
        out.append(("wrong type", _set(d, rms_norm_eps="1e-6"), "rms_norm_eps"))
    for field, bad in (
        ("hidden_size", 0),
        ("num_hidden_layers", -2),
        ("vocab_size", 0),
        (heads, 0),
    ):
        out.append(("size <= 0", _set(d, **{field: bad}), field))
    if "intermediate_size" in d:
        out.append(("size <= 0", _set(d, intermediate_size=-5), "intermediate_size"))
    if d["model_type"] == "mamba2":  # heads x head_dim must be expand x hidden_size
        out.append(("heads do not divide", _set(d, num_heads=3), "num_heads"))
    elif d["model_type"] not in NO_KV:
        n = d[heads]
        out.append(
            ("heads do not divide", _set(d, num_key_value_heads=n - 1), "num_key_value_heads")
        )
        if "head_dim" not in d:  # head_dim = hidden_size / heads
            out.append(("heads do not divide", _set(d, **{heads: 3}), heads))
    out.append(("unknown model_type", _set(d, model_type="llama9"), "model_type"))
    out.append(("unknown model_type", _set(d, model_type=None), "model_type"))
    if case in READS_LAYER_TYPES:
        kinds = d.get("layer_types")
        out.append(("layer_types length", _set(d, layer_types=kinds[:-1]), "layer_types"))
        out.append(("layer_types length", _set(d, layer_types=kinds + kinds[:1]), "layer_types"))
        out.append(
            ("layer_types kind", _set(d, layer_types=["mystery"] * len(kinds)), "layer_types")
        )
    out.append(("bad rope_scaling", _set(d, rope_scaling="linear"), "rope_scaling"))
    out.append(
        ("bad rope_scaling", _set(d, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope")
    )
    return [f for f in out if f[1] is not None]


ALL = [
    pytest.param(d, field, id=f"{case}-{kind}-{field}-{i}")
    for case, hf in CASES.items()
    for i, (kind, d, field) in enumerate(faults(case, hf))
]


@pytest.mark.parametrize("d, field", ALL)
def test_corrupt_config_is_a_config_error_naming_the_field(d, field, tmp_path):
    with pytest.raises(ConfigError) as e:
        config_from_hf(d)
    assert field in str(e.value), str(e.value)
    path = tmp_path / "config.json"  # through the file, the error names the file too
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=str(path)):
        load_config(path)


def test_every_family_and_fault_class_is_covered():
    kinds = {
        (hf["model_type"], kind) for case, hf in CASES.items() for kind, *_ in faults(case, hf)
    }
    assert {t for t, _ in kinds} == {hf["model_type"] for hf in CASES.values()}
    for needed in ("missing", "wrong type", "size <= 0", "unknown model_type", "bad rope_scaling"):
        assert all((hf["model_type"], needed) in kinds for hf in CASES.values()), needed
    assert sum(kind == "layer_types length" for _, kind in kinds) == 4
