"""LlamaForCausalLM, and ``Decoder``: the Llama layout every decoder family here starts from (Mistral,
Qwen2, the MoE and MLA families). HF stores q/k rows in the "half" RoPE layout, lmstack's default, so the
weights copy as they are."""

from __future__ import annotations

from typing import Any

from lmstack.model.config import MAX_SEQ_LEN, ConfigError, ModelConfig
from lmstack.model.families.base import (
    Family,
    first_id,
    flag,
    hf_int,
    name_of,
    rope_theta,
)
from lmstack.utils import check_float

#: the hybrid-family ModelConfig fields at their Llama-block defaults (the plain decoders cannot export them)
VARIANT_DEFAULTS = dict(
    block_ffn=True,
    norm_offset=False,
    sandwich_norm=False,
    ffn_act="silu",
    embed_scale=False,
    query_pre_attn_scalar=None,
    attn_softcap=None,
    final_softcap=None,
    local_rope_theta=None,
    rotary_dim=None,
    attn_output_gate=False,
    ssm_dt_limit=None,
    rope_linear_factor=None,
)
HYBRID_FAMILIES = ["gemma2", "gemma3_text", "mamba2", "qwen3_next"]


class Decoder(Family):
    """A Llama-layout decoder: SwiGLU, RMSNorm, RoPE, no biases but the family's own."""

    def config_from_hf(self, d: dict[str, Any], source: str) -> ModelConfig:
        return ModelConfig(**self.config_fields(d, source))

    def config_fields(self, d: dict[str, Any], source: str) -> dict[str, Any]:
        """The ModelConfig keywords: the Llama ones, then the family's (``family_fields``)."""
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act={act!r}; lmstack's SwiGLU needs 'silu'")
        if flag(d, "mlp_bias"):
            raise ConfigError("mlp_bias=True is not supported")
        family = self.family_fields(d, source)
        n_heads = hf_int(d, "num_attention_heads")
        head_dim = d.get("head_dim")
        kw = dict(
            vocab_size=hf_int(d, "vocab_size"),
            d_model=hf_int(d, "hidden_size"),
            n_layers=hf_int(d, "num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=hf_int(d, "num_key_value_heads", n_heads),
            d_ff=hf_int(d, "intermediate_size"),
            head_dim=None if head_dim is None else hf_int(d, "head_dim"),
            max_seq_len=hf_int(d, "max_position_embeddings", 4096, MAX_SEQ_LEN),
            rope_theta=rope_theta(d, source),
            norm_eps=check_float("rms_norm_eps", d.get("rms_norm_eps", 1e-6), ConfigError),
            tie_embeddings=flag(d, "tie_word_embeddings"),
            architecture=self.model_type,
            bos_token_id=first_id(d, "bos_token_id"),
            eos_token_id=first_id(d, "eos_token_id"),
            name=name_of(d, self.model_type),
        )
        return {**kw, **family, **self.more_fields(d, source)}

    def family_fields(self, d: dict[str, Any], source: str) -> dict[str, Any]:
        """Hook: checks and keywords read before the Llama fields."""
        return {}

    def more_fields(self, d: dict[str, Any], source: str) -> dict[str, Any]:
        """Hook: keywords read after the Llama fields (the MoE / MLA ones)."""
        return {}

    def decoder_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        """The Llama fields of ``c``'s HF config (``config_to_hf`` adds the family's)."""
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "vocab_size": c.vocab_size,
            "hidden_size": c.d_model,
            "intermediate_size": c.d_ff,
            "num_hidden_layers": c.n_layers,
            "num_attention_heads": c.n_heads,
            "num_key_value_heads": c.n_kv_heads,
            "head_dim": c.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": c.max_seq_len,
            "rms_norm_eps": c.norm_eps,
            "rope_theta": c.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
            "tie_word_embeddings": c.tie_embeddings,
            "bos_token_id": c.bos_token_id,
            "eos_token_id": c.eos_token_id,
            "torch_dtype": "float32",
        }


class PlainDecoder(Decoder):
    """Llama / Mistral / Qwen2: a config using none of the other families' options."""

    qkv_bias = False  # the family has q/k/v biases
    has_window = False  # the family has one sliding window over every layer (Mistral)

    def family_fields(self, d: dict[str, Any], source: str) -> dict[str, Any]:
        return {"qkv_bias": self.qkv_bias}

    def check_exportable(self, c: ModelConfig) -> None:
        """Refuse what this HF family cannot express, naming the field."""
        variant = [f for f, v in VARIANT_DEFAULTS.items() if getattr(c, f) != v]
        if variant:
            raise ConfigError(
                f"{variant} set on architecture={c.architecture!r}, whose HF family has no such "
                f"option; these belong to {HYBRID_FAMILIES}"
            )
        if c.qk_norm or c.parallel_block:
            raise ConfigError(
                "qk_norm / parallel_block models have no Llama/Mistral/Qwen2 HF equivalent"
            )
        if c.rope_layout != "half":
            raise ConfigError("HF checkpoints use rope_layout='half'; convert the model first")
        arch = c.architecture
        if c.sliding_window is not None and not self.has_window:
            raise ConfigError(
                f"sliding_window={c.sliding_window} needs architecture='mistral', got {arch!r}"
            )
        if c.layer_types is not None and not self.exports_layer_types(c.layer_types):
            raise ConfigError(
                f"layer_types={c.layer_types} has no {arch!r} HF equivalent (only qwen2 with "
                "['attention', 'local_attention'] layers, i.e. interleaved local/global attention)"
            )
        if c.qkv_bias != self.qkv_bias:
            raise ConfigError(
                f"qkv_bias={c.qkv_bias} does not fit architecture={arch!r} (only qwen2 has q/k/v bias)"
            )

    def exports_layer_types(self, layer_types: list[str]) -> bool:
        return False

    def config_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        self.check_exportable(c)
        return {**self.decoder_to_hf(c), **self.family_to_hf(c)}

    def family_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return {}


class Llama(PlainDecoder):
    model_type = "llama"
    hf_class = "LlamaForCausalLM"

    def family_fields(self, d: dict[str, Any], source: str) -> dict[str, Any]:
        if flag(d, "attention_bias"):
            raise ConfigError("attention_bias=True (a bias on o_proj too) is not supported")
        return super().family_fields(d, source)

    def family_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": False, "mlp_bias": False}
