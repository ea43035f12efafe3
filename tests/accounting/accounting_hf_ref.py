"""Build HF transformers models from an lmstack ModelConfig by hand-mapping the fields.

HF's Llama/Mistral/Qwen2 implementations are the independent reference for parameter counts
and matmul FLOPs (seed 000 §1.4, §1.6). The mapping is written here, not imported from
lmstack, so a mistake in lmstack's own HF conversion cannot hide one in accounting.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")


def hf_model(cfg, attn: str = "eager"):
    import torch

    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attn_implementation=attn,
    )
    if cfg.qkv_bias:
        hf_cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif cfg.sliding_window is not None:
        hf_cfg = transformers.MistralConfig(sliding_window=cfg.sliding_window, **common)
        cls = transformers.MistralForCausalLM
    else:
        hf_cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    return cls(hf_cfg)


def hf_numel_meta(cfg) -> int:
    import torch

    with torch.device("meta"):
        m = hf_model(cfg)
    # tied weights appear once in parameters()
    return sum(p.numel() for p in m.parameters())
