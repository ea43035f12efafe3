"""OlmoeForCausalLM: 64 fine-grained experts, QK-norm over whole projections, optional ``clip_qkv``."""

from __future__ import annotations

from typing import Any

from lmstack.model.config import ConfigError, ModelConfig
from lmstack.model.families.base import QK_NORM, flag, hf_int
from lmstack.model.families.experts import MoEDecoder
from lmstack.utils import check_float


class Olmoe(MoEDecoder):
    model_type = "olmoe"
    hf_class = "OlmoeForCausalLM"
    block_names = {**MoEDecoder.block_names, **QK_NORM}

    def moe_fields(self, d: dict[str, Any]) -> dict[str, Any]:
        if flag(d, "attention_bias"):
            raise ConfigError(
                f"attention_bias={d['attention_bias']!r} is not supported for olmoe (expected false)"
            )
        clip = d.get("clip_qkv")
        return dict(
            n_experts=hf_int(d, "num_experts"),
            router_norm_topk=flag(d, "norm_topk_prob"),
            qk_norm_full=True,
            qkv_clip=None if clip is None else check_float("clip_qkv", clip, ConfigError),
        )

    def moe_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(
            num_experts=c.n_experts,
            norm_topk_prob=c.router_norm_topk,
            clip_qkv=c.qkv_clip,
            attention_bias=False,
        )
