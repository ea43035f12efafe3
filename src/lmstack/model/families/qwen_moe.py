"""Qwen2MoeForCausalLM (q/k/v biases, a sigmoid-gated shared expert) and Qwen3MoeForCausalLM (per-head
QK-norm, no biases, no shared expert); dense and MoE layers interleave by ``decoder_sparse_step``."""

from __future__ import annotations

from typing import Any

from lmstack.model.config import ConfigError, ModelConfig
from lmstack.model.families.base import QK_NORM, flag, hf_int, none_or_int, shared_expert_names
from lmstack.model.families.experts import MoEDecoder


def refuse_mlp_only_layers(d: dict[str, Any], hint: str) -> None:
    only = d.get("mlp_only_layers") or []
    if only:
        raise ConfigError(f"mlp_only_layers={only!r} is not supported (expected []); {hint}")


class Qwen2Moe(MoEDecoder):
    model_type = "qwen2_moe"
    hf_class = "Qwen2MoeForCausalLM"
    block_names = {
        **MoEDecoder.block_names,
        **shared_expert_names("shared_expert"),
        "ffn.shared_gate.weight": "mlp.shared_expert_gate.weight",
    }
    shared_expert = True  # Qwen3-MoE has none

    def family_fields(self, d: dict[str, Any], source: str) -> dict[str, Any]:
        if flag(d, "use_sliding_window"):
            raise ConfigError("Qwen2 use_sliding_window=True (per-layer windows) is not supported")
        return {}

    def attention_fields(self, d: dict[str, Any]) -> dict[str, Any]:
        return {"qkv_bias": True}

    def experts_field(self, d: dict[str, Any]) -> str:
        return "num_experts"

    def moe_fields(self, d: dict[str, Any]) -> dict[str, Any]:
        refuse_mlp_only_layers(d, "use decoder_sparse_step for regular dense/MoE interleaving")
        shared = none_or_int(d, "shared_expert_intermediate_size")
        kw = self.attention_fields(d)
        if not self.shared_expert:
            shared = None
        return dict(
            kw,
            n_experts=hf_int(d, self.experts_field(d)),
            d_ff_expert=hf_int(d, "moe_intermediate_size"),
            router_norm_topk=flag(d, "norm_topk_prob"),
            moe_layer_step=hf_int(d, "decoder_sparse_step", 1),
            n_shared_experts=1 if shared else 0,
            d_ff_shared=shared,
            shared_expert_gate=bool(shared),
        )

    def moe_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(
            num_experts=c.n_experts,
            moe_intermediate_size=c.d_ff_expert or c.d_ff,
            norm_topk_prob=c.router_norm_topk,
            decoder_sparse_step=c.moe_layer_step,
            mlp_only_layers=[],
            use_sliding_window=False,
            **self.family_to_hf(c),
        )

    def family_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(shared_expert_intermediate_size=c.d_ff_shared or 0, qkv_bias=True)


class Qwen3Moe(Qwen2Moe):
    model_type = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"
    block_names = {**MoEDecoder.block_names, **QK_NORM}
    shared_expert = False

    def attention_fields(self, d: dict[str, Any]) -> dict[str, Any]:
        if flag(d, "attention_bias"):
            raise ConfigError(
                f"attention_bias={d['attention_bias']!r} is not supported for qwen3_moe "
                "(a bias on o_proj too); expected false"
            )
        return {"qk_norm": True, "qkv_bias": False}

    def experts_field(self, d: dict[str, Any]) -> str:
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the hub configs say num_experts
        return "num_experts" if "num_experts" in d else "num_local_experts"

    def family_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(head_dim=c.head_dim, attention_bias=False, num_local_experts=c.n_experts)
