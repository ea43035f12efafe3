"""Inference: KV caches, sampling and generation (seed 000 §2, seed 001 "推理")."""

from lmstack.inference.generate import generate, sample_next
from lmstack.inference.kv_cache import KVCache

__all__ = ["KVCache", "generate", "sample_next"]
