"""HF model families: one adapter per family (config and state dict, both ways), registered here.

``FAMILIES`` maps an HF ``model_type`` to its adapter; ``family_for(hf_config)`` picks the adapter of an HF
``config.json`` dict, ``family_of(config)`` the one of a ModelConfig (its ``architecture``). Adding a family:
its module here (a ``Family`` subclass: ``model_type``, ``hf_class``, its name tables, ``config_from_hf`` /
``config_to_hf``), its line in ``FAMILIES``, its name in ``model.config.ARCHITECTURES`` (the torch-free list
ModelConfig checks ``architecture`` against; ``tests/model/test_model_families.py`` checks the two agree),
and its parity test.
"""

from __future__ import annotations

from typing import Any

from lmstack.model.config import ConfigError, ModelConfig
from lmstack.model.families.base import Family
from lmstack.model.families.deepseek import DeepseekV2, DeepseekV3
from lmstack.model.families.gemma import Gemma2, Gemma3Text
from lmstack.model.families.llama import Llama
from lmstack.model.families.mamba2 import Mamba2
from lmstack.model.families.mistral import Mistral
from lmstack.model.families.mixtral import Mixtral
from lmstack.model.families.olmoe import Olmoe
from lmstack.model.families.qwen2 import Qwen2
from lmstack.model.families.qwen3_next import Qwen3Next
from lmstack.model.families.qwen_moe import Qwen2Moe, Qwen3Moe

FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add ``family`` to ``FAMILIES`` under its ``model_type`` (refusing a second adapter for it)."""
    if not family.model_type or family.model_type in FAMILIES:
        raise ValueError(f"family model_type={family.model_type!r} is empty or already registered")
    FAMILIES[family.model_type] = family
    return family


for _family in (
    Llama(),
    Mistral(),
    Qwen2(),
    Mixtral(),
    Olmoe(),
    Qwen2Moe(),
    Qwen3Moe(),
    DeepseekV2(),
    DeepseekV3(),
    Mamba2(),
    Gemma2(),
    Gemma3Text(),
    Qwen3Next(),
):
    register_family(_family)


def family_for(hf_config: dict[str, Any], source: str = "config.json") -> Family:
    """The adapter of an HF ``config.json`` dict, by its ``model_type``."""
    model_type = hf_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ConfigError(
            f"{source}: unknown architecture model_type={model_type!r}; supported: {sorted(FAMILIES)}"
        )
    return FAMILIES[model_type]


def family_of(config: ModelConfig) -> Family:
    """The adapter that saves ``config`` (its ``architecture``)."""
    if config.architecture not in FAMILIES:
        raise ConfigError(
            f"architecture={config.architecture!r} has no HF family; expected one of {sorted(FAMILIES)}"
        )
    return FAMILIES[config.architecture]
