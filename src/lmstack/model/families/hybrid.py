"""``StrictFamily``: what the recurrent / hybrid / interleaved families (Mamba2, Gemma-2/3, Qwen3-Next) share.
Their loaders refuse a config field they do not know by name (a new HF option must not be silently ignored),
refuse known fields they cannot honour with their value, and name a missing or misshapen tensor by its HF
name, layer, mixer kind and the config fields that size it."""

from __future__ import annotations

from typing import Any

from lmstack.model.config import MAX_SEQ_LEN, ConfigError, ModelConfig
from lmstack.model.families.base import (
    Family,
    dict_or_none,
    expect,
    first_id,
    flag,
    hf_int,
    name_of,
)
from lmstack.utils import check_float

#: HF config fields that do not change the forward pass (bookkeeping, training-only, generation defaults)
HARMLESS_FIELDS = {
    "transformers_version",
    "architectures",
    "output_hidden_states",
    "return_dict",
    "dtype",
    "torch_dtype",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "problem_type",
    "id2label",
    "label2id",
    "_name_or_path",
    "model_type",
    "output_attentions",
    "use_cache",
    "initializer_range",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "attention_dropout",
    "output_router_logits",
    "router_aux_loss_coef",
    "max_position_embeddings",
    "tokenizer_class",
    "_attn_implementation_autoset",
    "use_bidirectional_attention",
    "cache_implementation",
    "residual_in_fp32",
    "time_step_rank",
    "time_step_min",
    "time_step_max",
    "time_step_floor",
    "rescale_prenorm_residual",
    "hidden_act",
    "hidden_activation",
    "attention_bias",
    "use_bias",
    "use_conv_bias",
    "rms_norm",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
}
#: the attention fields the attention-using strict families read
ATTENTION_FIELDS = {
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
}


class StrictFamily(Family):
    """A family whose loader refuses unknown HF fields; a family sets ``known_fields`` and implements
    ``family_fields`` / ``family_to_hf``."""

    #: the fields this loader reads (besides the harmless ones)
    known_fields: frozenset[str] = frozenset()
    explain_errors = True

    def config_from_hf(self, d: dict[str, Any], source: str) -> ModelConfig:
        unknown = sorted(set(d) - HARMLESS_FIELDS - self.known_fields)
        if unknown:
            raise ConfigError(
                f"field(s) {unknown} are not supported by lmstack's {self.hf_class} loader; known "
                f"fields: {sorted(self.known_fields)} (and bookkeeping ones)"
            )
        kw: dict[str, Any] = dict(
            vocab_size=hf_int(d, "vocab_size"),
            d_model=hf_int(d, "hidden_size"),
            n_layers=hf_int(d, "num_hidden_layers"),
            tie_embeddings=flag(d, "tie_word_embeddings"),
            architecture=self.model_type,
            bos_token_id=first_id(d, "bos_token_id"),
            eos_token_id=first_id(d, "eos_token_id"),
            name=name_of(d, self.model_type),
        )
        return ModelConfig(**{**kw, **self.family_fields(d, kw, source)})

    def family_fields(self, d: dict[str, Any], kw: dict[str, Any], source: str) -> dict[str, Any]:
        """The family's ModelConfig keywords (``kw``: the common ones read so far, which it may override)."""
        raise NotImplementedError

    def attention_fields(self, d: dict[str, Any], source: str) -> dict[str, Any]:
        """The softmax-attention layers' keywords (Gemma, Qwen3-Next); RoPE scaling is refused here, but
        ``rope_linear_factor`` (Gemma-3's linear scaling of the global layers, read by that family)."""
        n_heads = hf_int(d, "num_attention_heads")
        kw = dict(
            n_heads=n_heads,
            n_kv_heads=hf_int(d, "num_key_value_heads", n_heads),
            d_ff=hf_int(d, "intermediate_size"),
            head_dim=None if d.get("head_dim") is None else hf_int(d, "head_dim"),
            max_seq_len=hf_int(d, "max_position_embeddings", 8192, MAX_SEQ_LEN),
            norm_eps=check_float("rms_norm_eps", d.get("rms_norm_eps", 1e-6), ConfigError),
            norm_offset=True,
        )
        expect(d, "attention_bias", (False,), self.hf_class)
        scaling = dict_or_none(d, "rope_scaling", source)
        if scaling and self.rope_linear_factor(scaling) is None:
            raise ConfigError(
                f"rope_scaling={d['rope_scaling']!r} is not supported (only plain RoPE"
                f"{self.scaling_hint})"
            )
        return kw

    scaling_hint = ""  # what else ``rope_scaling`` may be, for the error

    def rope_linear_factor(self, scaling: dict[str, Any]) -> float | None:
        """Hook: the factor of an accepted legacy ``rope_scaling`` (None: refused)."""
        return None

    def config_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "vocab_size": c.vocab_size,
            "hidden_size": c.d_model,
            "num_hidden_layers": c.n_layers,
            "tie_word_embeddings": c.tie_embeddings,
            "bos_token_id": c.bos_token_id,
            "eos_token_id": c.eos_token_id,
            "torch_dtype": "float32",
            **self.family_to_hf(c),
        }

    def family_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        raise NotImplementedError

    def attention_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(
            intermediate_size=c.d_ff,
            num_attention_heads=c.n_heads,
            num_key_value_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            max_position_embeddings=c.max_seq_len,
            rms_norm_eps=c.norm_eps,
            attention_bias=False,
        )
