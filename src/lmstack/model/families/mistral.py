"""MistralForCausalLM: Llama with a sliding window over the keys (``sliding_window``) in every layer."""

from __future__ import annotations

from typing import Any

from lmstack.model.config import ConfigError, ModelConfig
from lmstack.model.families.llama import PlainDecoder
from lmstack.utils import check_int


def sliding_window(d: dict[str, Any]) -> int | None:
    """HF ``sliding_window`` (null: full attention)."""
    v = d.get("sliding_window")
    return None if v is None else check_int("sliding_window", v, ConfigError, minimum=1)


class Mistral(PlainDecoder):
    model_type = "mistral"
    hf_class = "MistralForCausalLM"
    has_window = True

    def family_fields(self, d: dict[str, Any], source: str) -> dict[str, Any]:
        return {**super().family_fields(d, source), "sliding_window": sliding_window(d)}

    def family_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return {"sliding_window": c.sliding_window}
