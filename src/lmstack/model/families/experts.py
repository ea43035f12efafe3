"""``MoEDecoder``: what the Llama-layout mixture-of-experts families (Mixtral, OLMoE, Qwen2/3-MoE,
DeepSeek-V2/V3; model/moe.py) share: the router's name, ``num_experts_per_tok``, and an HF config that
leaves ``head_dim`` to the family."""

from __future__ import annotations

from typing import Any

from lmstack.model.config import ModelConfig
from lmstack.model.families.base import LLAMA_BLOCK, hf_int
from lmstack.model.families.llama import Decoder

ROUTER = {"ffn.router.weight": "mlp.gate.weight"}


class MoEDecoder(Decoder):
    block_names = {**LLAMA_BLOCK, **ROUTER}
    hf_fields = {
        **Decoder.hf_fields,
        "d_ff_expert": "moe_intermediate_size",
        "n_experts": "num_experts",
    }

    def more_fields(self, d: dict[str, Any], source: str) -> dict[str, Any]:
        return {"n_experts_per_token": hf_int(d, "num_experts_per_tok"), **self.moe_fields(d)}

    def moe_fields(self, d: dict[str, Any]) -> dict[str, Any]:
        """Hook: the family's MoE / MLA keywords; a field it cannot honour is a ConfigError naming it."""
        return {}

    def config_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        d = self.decoder_to_hf(c)
        del d["head_dim"]
        return {**d, "num_experts_per_tok": c.n_experts_per_token, **self.moe_to_hf(c)}

    def moe_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return {}
