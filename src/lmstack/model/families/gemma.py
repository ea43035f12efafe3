"""Gemma2ForCausalLM and Gemma3ForCausalLM (text): interleaved sliding-window : global attention, GeGLU,
(1 + w) sandwich norms, embeddings scaled by sqrt(D), ``query_pre_attn_scalar``; Gemma-2 soft-caps the
attention and output logits, Gemma-3 has per-head QK-norm, its own RoPE base on the local layers and
optionally linear RoPE scaling on the global ones (model/variants.py)."""

from __future__ import annotations

from typing import Any

from lmstack.model.config import MAX_SIZE, ConfigError, ModelConfig
from lmstack.model.families.base import QK_NORM, dict_or_none, expect, hf_kinds, plain_theta
from lmstack.model.families.hybrid import ATTENTION_FIELDS, StrictFamily
from lmstack.utils import check_float, check_int

#: HF per-layer attention kinds <-> lmstack mixers
KINDS = {"local_attention": "sliding_attention", "attention": "full_attention"}
_ATTN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")


class Gemma2(StrictFamily):
    model_type = "gemma2"
    hf_class = "Gemma2ForCausalLM"
    block_names = {
        "attn_norm.weight": "input_layernorm.weight",
        "post_attn_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
        **{f"attn.{n}": f"self_attn.{n}" for n in _ATTN},
        **QK_NORM,
        **{f"ffn.{w}_proj.weight": f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")},
    }
    known_fields = frozenset(
        ATTENTION_FIELDS
        | {
            "query_pre_attn_scalar",
            "sliding_window",
            "layer_types",
            "final_logit_softcapping",
            "attn_logit_softcapping",
        }
    )
    qk_norm = False
    hf_fields = {
        **StrictFamily.hf_fields,
        "local_window": "sliding_window",
        "attn_softcap": "attn_logit_softcapping",
        "final_softcap": "final_logit_softcapping",
        "local_rope_theta": "rope_local_base_freq",
    }

    def rope_fields(
        self, d: dict[str, Any], params: dict[str, Any], n: int, source: str
    ) -> tuple[float, float | None, float | None, list[str]]:
        """-> (Θ, the local layers' Θ, the linear RoPE factor, the default HF layer_types)."""
        theta = plain_theta(
            params or {"rope_theta": d.get("rope_theta", 10000.0)}, "rope_parameters"
        )
        default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        return theta, None, None, default

    def family_fields(self, d: dict[str, Any], kw: dict[str, Any], source: str) -> dict[str, Any]:
        n = kw["n_layers"]
        kw = {**self.attention_fields(d, source), "qk_norm": self.qk_norm}
        expect(d, "hidden_activation", ("gelu_pytorch_tanh",), self.hf_class)
        expect(d, "hidden_act", ("gelu_pytorch_tanh",), self.hf_class)
        expect(d, "use_bidirectional_attention", (None, False), self.hf_class)
        params = dict_or_none(d, "rope_parameters", source)
        theta, local_theta, linear, default = self.rope_fields(d, params, n, source)
        softcaps = {
            f: None if d.get(f) is None else check_float(f, d[f], ConfigError)
            for f in ("attn_logit_softcapping", "final_logit_softcapping")
        }
        return dict(
            kw,
            rope_theta=theta,
            local_rope_theta=local_theta,
            layer_types=hf_kinds(d, n, {v: k for k, v in KINDS.items()}, default),
            rope_linear_factor=linear,
            local_window=check_int(
                "sliding_window", d.get("sliding_window", 4096), ConfigError, 1, MAX_SIZE
            ),
            tie_embeddings=d.get("tie_word_embeddings", True) is not False,
            sandwich_norm=True,
            ffn_act="gelu_tanh",
            embed_scale=True,
            attn_softcap=softcaps["attn_logit_softcapping"],
            final_softcap=softcaps["final_logit_softcapping"],
            query_pre_attn_scalar=check_float(
                "query_pre_attn_scalar", d.get("query_pre_attn_scalar", 256), ConfigError
            ),
        )

    def family_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        scalar = c.query_pre_attn_scalar
        assert scalar is not None, "a Gemma config has query_pre_attn_scalar"
        return dict(
            self.attention_to_hf(c),
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,
            sliding_window=c.local_window,
            layer_types=[KINDS[t] for t in c.mixer_types],
            attn_logit_softcapping=c.attn_softcap,
            final_logit_softcapping=c.final_softcap,
            rope_parameters=self.rope_to_hf(c),
        )

    def rope_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        if c.rope_linear_factor is not None:
            raise ConfigError("rope_linear_factor has no Gemma-2 HF equivalent")
        return {"rope_type": "default", "rope_theta": c.rope_theta}


class Gemma3Text(Gemma2):
    model_type = "gemma3_text"
    hf_class = "Gemma3ForCausalLM"
    known_fields = Gemma2.known_fields | {
        "rope_local_base_freq",
        "sliding_window_pattern",
        "_sliding_window_pattern",
    }
    qk_norm = True
    scaling_hint = ", or linear on the global layers"

    def rope_linear_factor(self, scaling: dict[str, Any]) -> float | None:
        """Gemma-3 4B+: linear RoPE scaling of the global layers (legacy ``rope_scaling``)."""
        if scaling.get("rope_type", scaling.get("type")) != "linear":
            return None
        return check_float("rope_scaling.factor", scaling.get("factor"), ConfigError)

    def rope_fields(
        self, d: dict[str, Any], params: dict[str, Any], n: int, source: str
    ) -> tuple[float, float | None, float | None, list[str]]:
        scaling = dict_or_none(d, "rope_scaling", source)
        linear = self.rope_linear_factor(scaling) if scaling else None
        every = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
        every = check_int("sliding_window_pattern", every, ConfigError, 1, MAX_SIZE)
        default = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        if "full_attention" in params or "sliding_attention" in params:
            full = dict_or_none(params, "full_attention", source)
            if full.get("rope_type") == "linear":
                linear = check_float(
                    "rope_parameters.full_attention.factor", full.get("factor"), ConfigError
                )
                full = {**full, "rope_type": "default"}
            theta = plain_theta(full, "rope_parameters.full_attention")
            local_theta = plain_theta(
                dict_or_none(params, "sliding_attention", source),
                "rope_parameters.sliding_attention",
            )
        else:
            theta = plain_theta(
                params or {"rope_theta": d.get("rope_theta", 1e6)}, "rope_parameters"
            )
            local_theta = check_float(
                "rope_local_base_freq", d.get("rope_local_base_freq", 10000.0), ConfigError
            )
        return theta, local_theta, linear, default

    def rope_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        full = {"rope_type": "default", "rope_theta": c.rope_theta}
        if c.rope_linear_factor is not None:
            full.update(rope_type="linear", factor=c.rope_linear_factor)
        return {
            "full_attention": full,
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": c.local_rope_theta or c.rope_theta,
            },
        }
