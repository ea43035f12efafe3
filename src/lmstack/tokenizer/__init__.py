"""Byte-level BPE tokenizer (CS336 notes "分词器", "细节问答"; Book of LLMs §5.3 “memmap loading and bf16/int8 weights” memmap token files).

Public API: :class:`Tokenizer` (encode / decode / encode_iterable / apply_chat_template),
:func:`train_bpe`, file formats (lmstack JSON, GPT-2 vocab.json+merges.txt, HF tokenizer.json,
GGUF in; tiktoken and HF tokenizers out; :func:`load_tokenizer` picks one), chat templates,
dataset encoding to flat token files for ``np.memmap`` (:func:`encode_files`; :func:`open_tokens`
reads them back), the pre-tokenizer patterns, the GPT-2 byte mapping.
"""

from .byte_unicode import bytes_to_unicode, unicode_to_bytes
from .chat import ChatTemplateError, render_chat_template
from .dataset import EncodeStats, encode_files
from .formats import (
    from_hf_json,
    load,
    load_gpt2,
    load_hf,
    load_tokenizer,
    save,
    save_gpt2,
    save_hf,
    save_hf_config,
    to_hf_json,
    to_hf_tokenizer,
    to_tiktoken,
)
from .gguf_io import load_gguf_tokenizer, read_gguf_metadata
from .pretokenize import (
    GPT2_PATTERN,
    GPT4_PATTERN,
    LLAMA3_PATTERN,
    PATTERNS,
    SMOLLM_PATTERN,
    PreTokenizer,
)
from .token_file import check_token_ids, is_token_file, open_tokens, read_sidecar, token_dtype
from .tokenizer import Tokenizer
from .train import count_pretokens, train_bpe

__all__ = [
    "Tokenizer",
    "ChatTemplateError",
    "render_chat_template",
    "PreTokenizer",
    "encode_files",
    "open_tokens",
    "read_sidecar",
    "check_token_ids",
    "is_token_file",
    "token_dtype",
    "EncodeStats",
    "train_bpe",
    "count_pretokens",
    "load_tokenizer",
    "load_gguf_tokenizer",
    "read_gguf_metadata",
    "save",
    "load",
    "save_gpt2",
    "load_gpt2",
    "save_hf",
    "save_hf_config",
    "load_hf",
    "to_hf_json",
    "from_hf_json",
    "to_hf_tokenizer",
    "to_tiktoken",
    "bytes_to_unicode",
    "unicode_to_bytes",
    "GPT2_PATTERN",
    "GPT4_PATTERN",
    "LLAMA3_PATTERN",
    "SMOLLM_PATTERN",
    "PATTERNS",
]
