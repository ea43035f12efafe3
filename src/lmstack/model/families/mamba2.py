"""Mamba2ForCausalLM: pure Mamba-2 blocks (norm -> mixer -> residual, no FFN; model/mamba2.py) under
``backbone.``."""

from __future__ import annotations

from typing import Any

from lmstack.model.config import ConfigError, ModelConfig
from lmstack.model.families.base import expect, hf_int
from lmstack.model.families.hybrid import StrictFamily
from lmstack.utils import check_float

MIXER = (
    "in_proj.weight",
    "conv1d.weight",
    "conv1d.bias",
    "dt_bias",
    "A_log",
    "D",
    "norm.weight",
    "out_proj.weight",
)
#: no positional limit in a pure Mamba-2 model: lmstack's cap on the sequences it accepts
MAMBA2_MAX_SEQ_LEN = 1 << 20


def _float_or_inf(v: Any) -> Any:
    """transformers writes inf as {"__float__": "Infinity"} (JSON has no inf)."""
    if isinstance(v, dict) and isinstance(v.get("__float__"), str):
        return float(v["__float__"])
    return v


class Mamba2(StrictFamily):
    model_type = "mamba2"
    hf_class = "Mamba2ForCausalLM"
    layer_prefix = "backbone.layers"
    hf_fields = {
        "vocab_size": "vocab_size",
        "d_model": "hidden_size",
        "n_layers": "num_hidden_layers",
        "norm_eps": "layer_norm_epsilon",
        "ssm_state_size": "state_size",
        "ssm_expand": "expand",
        "ssm_head_dim": "head_dim",
        "ssm_n_groups": "n_groups",
        "mixer_chunk_size": "chunk_size",
        "ssm_dt_limit": "time_step_limit",
    }
    top_names = {
        "embed.weight": "backbone.embeddings.weight",
        "norm.weight": "backbone.norm_f.weight",
        "lm_head.weight": "lm_head.weight",
    }
    block_names = {
        "attn_norm.weight": "norm.weight",
        **{f"attn.{n}": f"mixer.{n}" for n in MIXER},
    }
    known_fields = frozenset(
        {
            "state_size",
            "expand",
            "head_dim",
            "num_heads",
            "n_groups",
            "conv_kernel",
            "layer_norm_epsilon",
            "chunk_size",
            "time_step_limit",
            "norm_before_gate",
        }
    )

    def family_fields(self, d: dict[str, Any], kw: dict[str, Any], source: str) -> dict[str, Any]:
        for key, allowed in (
            ("hidden_act", ("silu",)),
            ("use_bias", (False,)),
            ("use_conv_bias", (True,)),
            ("rms_norm", (True,)),
            ("norm_before_gate", (False,)),
        ):
            expect(d, key, allowed, self.hf_class)
        D, expand, P = kw["d_model"], hf_int(d, "expand", 2), hf_int(d, "head_dim", 64)
        heads = hf_int(d, "num_heads", max(expand * D // P, 1))
        if heads * P != expand * D:
            raise ConfigError(
                f"num_heads={heads} x head_dim={P} must equal expand x hidden_size = {expand * D}"
            )
        limit = d.get("time_step_limit", [0.0, float("inf")])
        if not isinstance(limit, (list, tuple)) or len(limit) != 2:
            raise ConfigError(f"time_step_limit={limit!r}; expected [lo, hi]")
        limit = [_float_or_inf(v) for v in limit]
        if limit[1] != float("inf"):
            check_float("time_step_limit[1]", limit[1], ConfigError)
        return dict(
            n_heads=1,
            head_dim=2,
            d_ff=1,
            max_seq_len=MAMBA2_MAX_SEQ_LEN,
            layer_types=["mamba2"] * kw["n_layers"],
            block_ffn=False,
            ssm_state_size=hf_int(d, "state_size", 128),
            ssm_expand=expand,
            ssm_head_dim=P,
            ssm_n_groups=hf_int(d, "n_groups", 1),
            conv_kernel=hf_int(d, "conv_kernel", 4),
            mixer_chunk_size=hf_int(d, "chunk_size", 256),
            norm_eps=check_float(
                "layer_norm_epsilon", d.get("layer_norm_epsilon", 1e-5), ConfigError
            ),
            ssm_dt_limit=None if list(limit) == [0.0, float("inf")] else list(limit),
        )

    def family_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        lim = c.ssm_dt_limit or [0.0, float("inf")]
        return dict(
            state_size=c.ssm_state_size,
            expand=c.ssm_expand,
            head_dim=c.ssm_head_dim,
            num_heads=c.ssm_expand * c.d_model // c.ssm_head_dim,
            n_groups=c.ssm_n_groups,
            conv_kernel=c.conv_kernel,
            layer_norm_epsilon=c.norm_eps,
            chunk_size=c.mixer_chunk_size,
            time_step_limit=[
                lim[0],
                {"__float__": "Infinity"} if lim[1] == float("inf") else lim[1],
            ],
            use_bias=False,
            use_conv_bias=True,
            hidden_act="silu",
            rms_norm=True,
        )
