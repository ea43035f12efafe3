"""MixtralForCausalLM: Mistral with a top-2-of-8 sparse MoE FFN (``block_sparse_moe``, experts w1/w3/w2)."""

from __future__ import annotations

from typing import Any

from lmstack.model.config import ModelConfig
from lmstack.model.families.base import LLAMA_BLOCK, hf_int
from lmstack.model.families.experts import MoEDecoder
from lmstack.model.families.mistral import sliding_window


class Mixtral(MoEDecoder):
    model_type = "mixtral"
    hf_class = "MixtralForCausalLM"
    block_names = {**LLAMA_BLOCK, "ffn.router.weight": "block_sparse_moe.gate.weight"}
    hf_aliases = {"mlp.gate.weight": "ffn.router.weight"}
    expert_module = "block_sparse_moe"
    expert_weights = {"gate": "w1", "up": "w3", "down": "w2"}
    hf_fields = {**MoEDecoder.hf_fields, "n_experts": "num_local_experts"}

    def family_fields(self, d: dict[str, Any], source: str) -> dict[str, Any]:
        return {"sliding_window": sliding_window(d)}

    def moe_fields(self, d: dict[str, Any]) -> dict[str, Any]:
        return {"n_experts": hf_int(d, "num_local_experts"), "router_norm_topk": True}

    def moe_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(
            num_local_experts=c.n_experts, head_dim=c.head_dim, sliding_window=c.sliding_window
        )
