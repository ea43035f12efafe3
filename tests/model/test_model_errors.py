"""Bad files give errors that name the file and the problem; nothing is unpickled."""

import json

import pytest
import torch
from lmstack_gguf_writer import write_llama_gguf
from safetensors.torch import load_file, save_file

from lmstack.model.config import ConfigError
from lmstack.model.gguf import load_gguf
from lmstack.model.hf import WeightsError, load_hf
from lmstack.model.io import load_model


@pytest.fixture
def hf_dir(tmp_path, tiny_hf_llama):
    tiny_hf_llama.save_pretrained(tmp_path)
    return tmp_path


def test_truncated_safetensors(hf_dir):
    f = hf_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(WeightsError, match="model.safetensors: cannot read safetensors file"):
        load_hf(hf_dir)


def test_corrupted_safetensors(hf_dir):
    (hf_dir / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(WeightsError, match="model.safetensors"):
        load_hf(hf_dir)


def test_missing_tensor(hf_dir):
    state = load_file(hf_dir / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, hf_dir / "model.safetensors")
    with pytest.raises(
        WeightsError, match=r"missing tensor\(s\) \['blocks.1.ffn.up_proj.weight'\]"
    ):
        load_hf(hf_dir)


def test_wrong_shape(hf_dir):
    state = load_file(hf_dir / "model.safetensors")
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(state, hf_dir / "model.safetensors")
    with pytest.raises(
        WeightsError,
        match=r"'blocks.0.attn.k_proj.weight' has shape \(16, 64\), expected \(32, 64\)",
    ):
        load_hf(hf_dir)


def test_unexpected_tensor(hf_dir):
    state = load_file(hf_dir / "model.safetensors")
    state["model.layers.0.self_attn.rotary_extra.weight"] = torch.zeros(2)
    save_file(state, hf_dir / "model.safetensors")
    with pytest.raises(
        WeightsError, match="unexpected tensor 'model.layers.0.self_attn.rotary_extra.weight'"
    ):
        load_hf(hf_dir)


def test_unknown_architecture_in_config(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="config.json: unknown architecture model_type='gpt2'"):
        load_hf(hf_dir)


def test_pickle_checkpoint_is_refused(tmp_path, tiny_hf_llama):
    tiny_hf_llama.config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(WeightsError, match="only pickle"):
        load_hf(tmp_path)


def test_unknown_gguf_architecture(tmp_path, tiny_hf_llama):
    write_llama_gguf(tmp_path / "m.gguf", tiny_hf_llama, "F32", arch="gpt2")
    with pytest.raises(
        ConfigError, match=r"m.gguf: unknown architecture general.architecture='gpt2'"
    ):
        load_gguf(tmp_path / "m.gguf")


def test_truncated_gguf(tmp_path, tiny_hf_llama):
    f = tmp_path / "m.gguf"
    write_llama_gguf(f, tiny_hf_llama, "Q8_0")
    f.write_bytes(f.read_bytes()[: f.stat().st_size * 2 // 3])
    with pytest.raises(WeightsError, match="m.gguf"):
        load_gguf(f)


def test_missing_path_and_unknown_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model("no-such-model")
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(WeightsError, match="expected a .gguf file"):
        load_model(tmp_path / "x.bin")
