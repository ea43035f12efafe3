"""Inference: KV caches (contiguous, paged with prefix sharing), sampling, the continuous-batching
engine, speculative decoding and chat (Book of LLMs §2 “inference”, CS336 notes "推理").

- ``generate``: batch-1 streaming with the contiguous ``KVCache`` (the fast interactive path);
- ``LLM`` / ``LLMEngine`` / ``AsyncLLM``: iteration-level scheduling over ``PagedKVCache``;
- ``DraftModel`` / ``PromptLookup``: speculation strategies (lossless accept/reject) for ``generate``;
- ``SamplingParams``: temperature, top-k, top-p, min-p, repetition penalty, stops, seed, logprobs.
"""

from lmstack.inference.async_llm import AsyncLLM
from lmstack.inference.block_manager import BlockManager
from lmstack.inference.engine import GenerationError, LLMEngine
from lmstack.inference.generate import generate
from lmstack.inference.kv_cache import KVCache
from lmstack.inference.llm import LLM
from lmstack.inference.paged import PagedKVCache
from lmstack.inference.sampling import SamplingParams
from lmstack.inference.sequence import RequestOutput
from lmstack.inference.speculative import DraftModel, PromptLookup, truncated_draft

__all__ = [
    "LLM",
    "AsyncLLM",
    "BlockManager",
    "DraftModel",
    "GenerationError",
    "KVCache",
    "LLMEngine",
    "PagedKVCache",
    "PromptLookup",
    "RequestOutput",
    "SamplingParams",
    "generate",
    "truncated_draft",
]
