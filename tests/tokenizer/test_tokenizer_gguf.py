"""SmolLM2's tokenizer read from its GGUF file, checked against transformers and HF tokenizers."""

from __future__ import annotations

import pytest

from lmstack.tokenizer.gguf_io import read_gguf_metadata

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 2024; we'll see, they're here, I'd go.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "Prices: $1,234.56 and 7.5% of 1000000 items; 3.14159e-10",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "Ünïcödé àccents ñ ß Ελληνικά русский язык العربية",
    "spaces    and\ttabs\t\t and\n\n\nnewlines \n \n  end   ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "odd <|im_end|><|im_start|>  places<|endoftext|>x<file_sep>",
    "   leading spaces and trailing   ",
    "",
    "a",
    "\n",
    "x123y 4 56 789",
    "<|im_start",  # a prefix of a special token is plain text
]


def test_metadata_and_special_ids(smol, gguf_path):
    meta = read_gguf_metadata(gguf_path, prefix="tokenizer.")
    assert meta["tokenizer.ggml.pre"] == "smollm"
    assert smol.vocab_size == 49152 == len(meta["tokenizer.ggml.tokens"])
    assert len(smol.merges) == len(meta["tokenizer.ggml.merges"])
    assert smol.bos_token_id == 1 and smol.eos_token_id == 2
    assert smol.special_tokens["<|im_start|>"] == 1
    assert smol.special_tokens["<|endoftext|>"] == 0
    assert isinstance(smol.chat_template, str) and "<|im_start|>" in smol.chat_template


@pytest.mark.slow
def test_metadata_matches_gguf_package(gguf_path):
    """lmstack's own metadata parser reads what the reference ``gguf`` package reads."""
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(gguf_path))
    ours = read_gguf_metadata(gguf_path)
    for key in (
        "tokenizer.ggml.pre",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.chat_template",
        "general.architecture",
    ):
        assert ours[key] == reader.fields[key].contents()
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        theirs = reader.fields[key].contents()
        assert ours[key] == theirs


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers_gguf(smol, hf_gguf, text):
    assert smol.encode(text) == hf_gguf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS + ["x   123", "a  1\n\n2", "\u00bd\u00bd 12"])
def test_ids_match_hf_tokenizers_smollm_pretokenizer(smol, hf_smollm, text):
    assert smol.encode(text) == hf_smollm.encode(text, add_special_tokens=False).ids


def test_where_transformers_gguf_drops_digit_split(smol, hf_gguf, hf_smollm):
    """Whitespace before a digit: SmolLM2's digit split keeps 3 spaces together, plain GPT-2 regex does not."""
    text = "x   123"
    assert smol.encode(text) == hf_smollm.encode(text, add_special_tokens=False).ids
    assert smol.encode(text) != hf_gguf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(smol, hf_gguf, text):
    ids = hf_gguf.encode(text, add_special_tokens=False)
    assert smol.decode(ids) == hf_gguf.decode(ids) == text


def test_invalid_utf8_decodes_to_replacement(smol):
    ids = smol.encode("😀")
    assert len(ids) > 1
    assert smol.decode(ids[:1]) == "\ufffd"
    assert smol.decode_bytes(ids[:1]) == "😀".encode()[: len(smol.vocab[ids[0]])]


def test_bad_files(tmp_path):
    from lmstack.tokenizer import load_gguf_tokenizer

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gguf_tokenizer(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match="magic"):
        load_gguf_tokenizer(bad)
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(
        b"GGUF" + (3).to_bytes(4, "little") + bytes(8) + (5).to_bytes(8, "little") + b"\x10"
    )
    with pytest.raises(ValueError, match="truncated"):
        load_gguf_tokenizer(trunc)


@pytest.mark.parametrize("gen", [False, True])
def test_chat_template_matches_transformers(smol, hf_gguf, gen):
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 中文?"},
    ]
    ours = smol.apply_chat_template(messages, add_generation_prompt=gen)
    theirs = hf_gguf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours == theirs
    with_system = [{"role": "system", "content": "Be brief."}] + messages
    assert smol.apply_chat_template(
        with_system, add_generation_prompt=gen, tokenize=True
    ) == hf_gguf.encode(
        hf_gguf.apply_chat_template(with_system, tokenize=False, add_generation_prompt=gen),
        add_special_tokens=False,
    )
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        smol.apply_chat_template([{"content": "no role"}])
