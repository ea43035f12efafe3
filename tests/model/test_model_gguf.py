"""GGUF loading: tiny llama.cpp-layout files of every supported tensor type vs transformers' GGUF loader."""

import pytest
import torch
from lmstack_gguf_writer import write_llama_gguf

from lmstack.model.gguf import load_gguf

pytest.importorskip("gguf", reason="the gguf package reads GGUF files")
transformers = pytest.importorskip("transformers", reason="HF transformers is the reference")


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_logits_match_transformers(qtype, tmp_path, tiny_hf_llama):
    write_llama_gguf(tmp_path / "tiny.gguf", tiny_hf_llama, qtype)
    model = load_gguf(tmp_path / "tiny.gguf").model
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf"
    ).eval()
    tokens = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(tokens).logits
        out = model(tokens)
        exact = tiny_hf_llama(tokens).logits
    assert (out - ref).abs().max().item() < 1e-4
    # quantization error is visible but bounded: the model is still the original one
    err = (out - exact).abs().max().item()
    assert err < (1e-5 if qtype == "F32" else 0.2), err


def test_interleaved_layout_keeps_gguf_rows_and_gives_same_logits(tmp_path, tiny_hf_llama):
    write_llama_gguf(tmp_path / "tiny.gguf", tiny_hf_llama, "F32")
    half = load_gguf(tmp_path / "tiny.gguf", rope_layout="half").model
    inter = load_gguf(tmp_path / "tiny.gguf", rope_layout="interleaved").model
    assert not torch.equal(half.blocks[0].attn.q_proj.weight, inter.blocks[0].attn.q_proj.weight)
    torch.testing.assert_close(
        half.blocks[0].attn.q_proj.weight, tiny_hf_llama.model.layers[0].self_attn.q_proj.weight
    )
    tokens = torch.randint(0, 96, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(half(tokens), inter(tokens), rtol=1e-5, atol=1e-5)


def test_gguf_metadata_is_kept(tmp_path, tiny_hf_llama):
    write_llama_gguf(tmp_path / "tiny.gguf", tiny_hf_llama, "F32")
    g = load_gguf(tmp_path / "tiny.gguf")
    assert g.metadata["general.architecture"] == "llama"
    assert g.metadata["tokenizer.ggml.tokens"][:2] == ["tok0", "tok1"]
    assert g.model.config.tie_embeddings is False
