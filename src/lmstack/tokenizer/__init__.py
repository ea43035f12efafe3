"""Byte-level BPE tokenizer (seed 001 "分词器", "细节问答"; seed 000 §5.3 memmap token files).

Public API: :class:`Tokenizer` (encode / decode / encode_iterable), :func:`load_gguf_tokenizer`
(also ``Tokenizer.from_gguf``), the pre-tokenizer patterns and the GPT-2 byte<->unicode mapping.
"""

from .byte_unicode import bytes_to_unicode, unicode_to_bytes
from .gguf_io import load_gguf_tokenizer
from .pretokenize import GPT2_PATTERN, GPT4_PATTERN, LLAMA3_PATTERN, PATTERNS, SMOLLM_PATTERN
from .tokenizer import Tokenizer

Tokenizer.from_gguf = staticmethod(load_gguf_tokenizer)  # type: ignore[attr-defined]

__all__ = [
    "Tokenizer",
    "load_gguf_tokenizer",
    "bytes_to_unicode",
    "unicode_to_bytes",
    "GPT2_PATTERN",
    "GPT4_PATTERN",
    "LLAMA3_PATTERN",
    "SMOLLM_PATTERN",
    "PATTERNS",
]
