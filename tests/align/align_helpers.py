"""Shared small pieces of the align tests: a byte-level tokenizer with a ChatML template and a tiny model."""

import torch

from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_chat_tokenizer() -> Tokenizer:
    """256 byte tokens + <|im_start|> (256), <|im_end|> (257, also EOS), <|pad|> (258); ChatML template."""
    tok = Tokenizer(
        {i: bytes([i]) for i in range(256)},
        [],
        special_tokens=["<|im_start|>", "<|im_end|>", "<|pad|>"],
    )
    tok.chat_template = CHATML
    tok.eos_token_id = tok.special_tokens["<|im_end|>"]
    tok.pad_token_id = tok.special_tokens["<|pad|>"]
    return tok


def tiny_model(seed: int = 0, vocab_size: int = 260, max_seq_len: int = 256, **kw) -> Transformer:
    cfg = ModelConfig(
        vocab_size=vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=max_seq_len,
        **kw,
    )
    torch.manual_seed(seed)
    return Transformer(cfg, seed=seed)
