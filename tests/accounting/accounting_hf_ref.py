"""Build HF transformers models from an lmstack ModelConfig by hand-mapping the fields.

HF's Llama/Mistral/Qwen2 implementations are the independent reference for parameter counts
and matmul FLOPs (Book of LLMs §1.4 “parameter count”, §1.6). The mapping is written here, not imported from
lmstack, so a mistake in lmstack's own HF conversion cannot hide one in accounting.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")


def hf_model(cfg, attn: str = "eager"):

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
    if cfg.n_experts or cfg.is_mla:  # mixture of experts / MLA families
        return _hf_moe_model(cfg, common)
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
    # tied weights appear once in parameters(); DeepSeek-V3's selection bias is an HF buffer, an lmstack
    # (frozen) parameter
    return sum(p.numel() for p in m.parameters()) + sum(
        b.numel() for n, b in m.named_buffers() if n.endswith("e_score_correction_bias")
    )


def _hf_moe_model(cfg, common):
    """Mixtral / OLMoE / Qwen2-MoE / DeepSeek-V2/V3 from the lmstack fields, mapped by hand."""
    moe = dict(num_experts_per_tok=cfg.n_experts_per_token)
    arch = cfg.architecture
    if arch == "mixtral":
        return transformers.MixtralForCausalLM(
            transformers.MixtralConfig(num_local_experts=cfg.n_experts, **moe, **common)
        )
    if arch == "olmoe":
        return transformers.OlmoeForCausalLM(
            transformers.OlmoeConfig(num_experts=cfg.n_experts, **moe, **common)
        )
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM(
            transformers.Qwen2MoeConfig(
                num_experts=cfg.n_experts,
                moe_intermediate_size=cfg.d_ff_expert,
                shared_expert_intermediate_size=cfg.d_ff_shared,
                **moe,
                **common,
            )
        )
    ds = dict(
        n_routed_experts=cfg.n_experts,
        moe_intermediate_size=cfg.d_ff_expert,
        n_shared_experts=cfg.n_shared_experts,
        first_k_dense_replace=cfg.moe_first_dense,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        **moe,
        **{**common, "head_dim": cfg.qk_rope_head_dim},
    )
    if arch == "deepseek_v2":
        return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**ds))
    return transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            n_group=cfg.router_groups, topk_group=cfg.router_topk_groups, **ds
        )
    )
