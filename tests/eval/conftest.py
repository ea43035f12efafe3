"""Fixtures for the evaluation tests: a tiny random HF Llama saved as an HF folder (transformers is the
reference for every log-probability) with a small byte-level BPE tokenizer beside it."""

import pytest
import torch

from lmstack.tokenizer import Tokenizer
from lmstack.tokenizer.formats import save_hf

MERGES = [
    (b" ", b"t"),
    (b"h", b"e"),
    (b" t", b"he"),
    (b" ", b"a"),
    (b"i", b"s"),
    (b" ", b"c"),
    (b"a", b"t"),
]
EOS = "<|endoftext|>"


def make_tokenizer() -> Tokenizer:
    vocab = {i: bytes([i]) for i in range(256)}
    for a, b in MERGES:
        vocab[len(vocab)] = a + b
    return Tokenizer(vocab, MERGES, special_tokens=[EOS], pattern="gpt2")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, make_hf_llama):
    """An HF Llama folder (config.json + model.safetensors + tokenizer.json), context 64."""
    tok = make_tokenizer()
    eos = tok.token_to_id(EOS)
    model = make_hf_llama(
        std=0.15,
        vocab_size=tok.vocab_size,
        rope_theta=1000.0,
        max_position_embeddings=64,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    d = tmp_path_factory.mktemp("tiny_hf")
    model.save_pretrained(d, safe_serialization=True)
    save_hf(tok, d / "tokenizer.json")
    return d


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def lm(tiny_dir):
    """(lmstack model, tokenizer) loaded through the inference loader."""
    from lmstack.inference.loader import load_for_inference

    return load_for_inference(str(tiny_dir), dtype="fp32")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs with one intra-op thread (the root conftest's ``one_thread``)."""
