"""The Llama-family Transformer: config, layers, attention, the model, and weight I/O."""

from lmstack.model.config import PRESETS, ConfigError, ModelConfig

__all__ = ["PRESETS", "ConfigError", "ModelConfig"]
