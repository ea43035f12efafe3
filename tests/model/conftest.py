"""Fixtures for the model tests."""

import pytest
import torch


@pytest.fixture
def tiny_hf_llama():
    transformers = pytest.importorskip("transformers", reason="HF transformers is the reference")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        rope_theta=1000.0,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model
