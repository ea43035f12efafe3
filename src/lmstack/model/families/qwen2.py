"""Qwen2ForCausalLM: Llama with biases on q, k, v (not o), and optionally interleaved local/global attention
(``use_sliding_window`` with per-layer ``layer_types``, lmstack's ``local_attention`` / ``attention``)."""

from __future__ import annotations

from typing import Any

from lmstack.model.config import ConfigError, ModelConfig
from lmstack.model.families.base import flag, hf_int
from lmstack.model.families.llama import PlainDecoder
from lmstack.utils import check_int

#: Qwen2's per-layer attention kinds <-> lmstack mixers (model.mixers)
LAYER_TYPES = {"attention": "full_attention", "local_attention": "sliding_attention"}


def local_global(d: dict[str, Any]) -> tuple[list[str], int]:
    """Qwen2 with ``use_sliding_window``: per-layer windows from ``layer_types`` (or, in older configs,
    sliding from layer ``max_window_layers`` on) -> (lmstack layer_types, local_window)."""
    n = hf_int(d, "num_hidden_layers")
    window = check_int("sliding_window", d.get("sliding_window"), ConfigError, minimum=1)
    kinds = d.get("layer_types")
    if kinds is None:
        first = check_int(
            "max_window_layers", d.get("max_window_layers", 28), ConfigError, minimum=0
        )
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n:
        raise ConfigError(
            f"layer_types={kinds!r:.80} must list one attention kind for each of the {n} layers"
        )
    back = {v: k for k, v in LAYER_TYPES.items()}
    for i, t in enumerate(kinds):
        if t not in back:
            raise ConfigError(f"layer_types[{i}]={t!r} (layer {i}); expected one of {sorted(back)}")
    return [back[t] for t in kinds], window


class Qwen2(PlainDecoder):
    model_type = "qwen2"
    hf_class = "Qwen2ForCausalLM"
    qkv_bias = True

    def family_fields(self, d: dict[str, Any], source: str) -> dict[str, Any]:
        kw = super().family_fields(d, source)
        if flag(d, "use_sliding_window"):
            kw["layer_types"], kw["local_window"] = local_global(d)
        return kw

    def exports_layer_types(self, layer_types: list[str]) -> bool:
        return not set(layer_types) - set(LAYER_TYPES)

    def family_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        if c.layer_types is None:
            return dict(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layers)
        return dict(  # interleaved local/global windows (HF layer_types)
            use_sliding_window=True,
            sliding_window=c.local_window,
            max_window_layers=c.n_layers,
            layer_types=[LAYER_TYPES[t] for t in c.layer_types],
        )
