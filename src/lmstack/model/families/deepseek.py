"""DeepseekV2ForCausalLM / DeepseekV3ForCausalLM: multi-head latent attention (model/mla.py; interleaved
RoPE, optional YaRN scaling) and DeepSeekMoE (shared experts, the first k layers dense; V3: sigmoid
scores, an aux-free selection bias, group-limited routing, multi-token-prediction layers that are not part
of the model)."""

from __future__ import annotations

from typing import Any

import torch

from lmstack.model.config import MAX_SIZE, ConfigError, ModelConfig
from lmstack.model.families.base import (
    dict_or_none,
    flag,
    hf_int,
    none_or_int,
    shared_expert_names,
)
from lmstack.model.families.experts import MoEDecoder
from lmstack.utils import check_float, check_int

MLA_NAMES = {  # lmstack name inside blocks.{i} -> HF
    "attn.q_a_proj.weight": "self_attn.q_a_proj.weight",
    "attn.q_a_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "attn.q_b_proj.weight": "self_attn.q_b_proj.weight",
    "attn.kv_a_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.kv_b_proj.weight": "self_attn.kv_b_proj.weight",
}
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)


def split_yarn(d: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A DeepSeek config without its YaRN scaling (``rope_scaling`` or ``rope_parameters`` of type yarn), and
    the YaRN parameters for ``ModelConfig.rope_yarn`` (None when the RoPE is plain)."""
    d = dict(d)
    for key in ("rope_scaling", "rope_parameters"):
        v = dict_or_none(d, key, source)
        kind = v.get("rope_type", v.get("type"))
        if kind == "yarn":
            yarn = {k: v[k] for k in YARN_KEYS if v.get(k) is not None}
            if "factor" not in yarn:  # DeepSeek-V3 style: the ratio of the context lengths
                yarn["factor"] = hf_int(d, "max_position_embeddings") / hf_int(
                    v, "original_max_position_embeddings"
                )
            d[key] = {
                "rope_type": "default",
                **({"rope_theta": v["rope_theta"]} if "rope_theta" in v else {}),
            }
            if key == "rope_scaling":
                d.pop(key)
            return d, yarn
    return d, None


class DeepseekV2(MoEDecoder):
    model_type = "deepseek_v2"
    hf_class = "DeepseekV2ForCausalLM"
    block_names = {**MoEDecoder.block_names, **MLA_NAMES, **shared_expert_names("shared_experts")}
    hf_fields = {
        **MoEDecoder.hf_fields,
        "n_experts": "n_routed_experts",
        "moe_first_dense": "first_k_dense_replace",
        "router_scale": "routed_scaling_factor",
        "router_groups": "n_group",
        "router_topk_groups": "topk_group",
    }

    def config_fields(self, d: dict[str, Any], source: str) -> dict[str, Any]:
        d, yarn = split_yarn(d, source)
        kw = super().config_fields(d, source)
        return kw if yarn is None else {**kw, "rope_yarn": yarn}

    def moe_fields(self, d: dict[str, Any]) -> dict[str, Any]:
        if flag(d, "attention_bias"):
            raise ConfigError(
                f"attention_bias={d['attention_bias']!r} is not supported for {self.model_type}"
            )
        freq = d.get("moe_layer_freq", 1)
        if freq != 1:
            raise ConfigError(f"moe_layer_freq={freq!r} is not supported (expected 1)")
        n_shared = d.get("n_shared_experts") or 0
        e_ff = hf_int(d, "moe_intermediate_size")
        kw = dict(
            n_experts=hf_int(d, "n_routed_experts"),
            d_ff_expert=e_ff,
            n_shared_experts=check_int("n_shared_experts", n_shared, ConfigError, 0, MAX_SIZE),
            d_ff_shared=n_shared * e_ff or None,
            moe_first_dense=check_int(
                "first_k_dense_replace", d.get("first_k_dense_replace", 0), ConfigError, 0, MAX_SIZE
            ),
            router_scale=check_float(
                "routed_scaling_factor", d.get("routed_scaling_factor", 1.0), ConfigError
            ),
            kv_lora_rank=hf_int(d, "kv_lora_rank"),
            q_lora_rank=none_or_int(d, "q_lora_rank") or 0,
            qk_nope_head_dim=hf_int(d, "qk_nope_head_dim"),
            qk_rope_head_dim=hf_int(d, "qk_rope_head_dim"),
            v_head_dim=hf_int(d, "v_head_dim"),
            head_dim=hf_int(d, "qk_nope_head_dim") + hf_int(d, "qk_rope_head_dim"),
            n_kv_heads=hf_int(d, "num_attention_heads"),
            rope_layout="interleaved",
        )
        return {**kw, **self.router_fields(d)}

    def router_fields(self, d: dict[str, Any]) -> dict[str, Any]:
        method = d.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(
                f"topk_method={method!r} is not supported for deepseek_v2; "
                "expected 'greedy' or 'group_limited_greedy'"
            )
        if method == "group_limited_greedy":
            return dict(
                router_groups=hf_int(d, "n_group"), router_topk_groups=hf_int(d, "topk_group")
            )
        return {}

    def moe_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        d: dict[str, Any] = dict(
            n_routed_experts=c.n_experts,
            moe_intermediate_size=c.d_ff_expert or c.d_ff,
            n_shared_experts=c.n_shared_experts,
            first_k_dense_replace=c.moe_first_dense,
            routed_scaling_factor=c.router_scale,
            kv_lora_rank=c.kv_lora_rank,
            q_lora_rank=c.q_lora_rank or None,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
            attention_bias=False,
            head_dim=c.qk_rope_head_dim,
            norm_topk_prob=c.router_norm_topk,
        )
        if c.rope_yarn is not None:
            d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": c.rope_theta, **c.rope_yarn}
        return {**d, **self.router_to_hf(c)}

    def router_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        grouped = c.router_groups > 1
        return dict(
            topk_method="group_limited_greedy" if grouped else "greedy",
            n_group=c.router_groups if grouped else None,
            topk_group=c.router_topk_groups if grouped else None,
        )


class DeepseekV3(DeepseekV2):
    model_type = "deepseek_v3"
    hf_class = "DeepseekV3ForCausalLM"
    block_names = {**DeepseekV2.block_names, "ffn.router.bias": "mlp.gate.e_score_correction_bias"}

    def router_fields(self, d: dict[str, Any]) -> dict[str, Any]:
        method = d.get("topk_method", "noaux_tc")
        if method != "noaux_tc":
            raise ConfigError(
                f"topk_method={method!r} is not supported for deepseek_v3 (expected 'noaux_tc')"
            )
        if d.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(
                f"scoring_func={d['scoring_func']!r} is not supported (expected 'sigmoid')"
            )
        return dict(
            router_score="sigmoid",
            router_aux_free_bias=True,
            router_norm_topk=flag(d, "norm_topk_prob"),
            router_groups=hf_int(d, "n_group", 1),
            router_topk_groups=hf_int(d, "topk_group", 1),
            rope_layout="interleaved" if d.get("rope_interleave", True) else "half",
        )

    def router_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(
            n_group=c.router_groups,
            topk_group=c.router_topk_groups,
            rope_interleave=c.rope_layout == "interleaved",
            num_nextn_predict_layers=0,
        )

    def prepare_hf(
        self, hf_state: dict[str, torch.Tensor], config: ModelConfig, source: str
    ) -> dict[str, torch.Tensor]:
        """Drop the multi-token-prediction layers past ``n_layers``: not part of the model."""
        return {n: t for n, t in hf_state.items() if not self._mtp(n, config.n_layers)}

    def _mtp(self, name: str, n_layers: int) -> bool:
        layer = name.removeprefix(self.layer_prefix + ".").partition(".")[0]
        return (
            name.startswith(self.layer_prefix + ".") and layer.isdigit() and int(layer) >= n_layers
        )
