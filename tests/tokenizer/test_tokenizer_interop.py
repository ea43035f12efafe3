"""Ids identical to HF ``tokenizers`` and ``tiktoken`` built from the same vocab/merges; file formats."""

from __future__ import annotations

import json

import pytest
from tok_helpers import SPECIALS

from lmstack.tokenizer import (
    Tokenizer,
    from_hf_json,
    load_gpt2,
    load_tokenizer,
    save,
    save_gpt2,
    save_hf,
    to_hf_json,
    to_hf_tokenizer,
    to_tiktoken,
)
from lmstack.tokenizer.byte_unicode import token_to_str

tokenizers = pytest.importorskip("tokenizers")
tiktoken = pytest.importorskip("tiktoken")

TEXTS = [
    "Hello, world! It's a test; we'll see what they've done.",
    "def main(argv=None):\n    if x == 1:\n        return {'a': [1, 2, 3]}\n\n\n\n",
    "中文：你好，世界！今天天气很好。",
    "emoji 😀🎉 👍🏽👨‍👩‍👧 café naïve ß",
    "   spaces    \t\ttabs\n\n  \n newlines  \r\n windows\r\n",
    "numbers 1234567 3.14 1e-10 ½ ² ٣",
    "<|endoftext|>start and end<|endoftext|>",
    "mid<|endoftext|><|endoftext|>dle <|endoftext|><|endoftext|><|endoftext|> x<|im_start|>y",
    "<|endoftext|  <|im_start <|endoftext|>>",
    "",
    " ",
    "\n",
]


def hf_direct(tok: Tokenizer):
    """HF tokenizers built straight from vocab/merges with its own API (no lmstack export code)."""
    from tokenizers import decoders, models, pre_tokenizers

    specials = {i: s for s, i in tok.special_tokens.items()}
    vocab = {specials[i] if i in specials else token_to_str(b): i for i, b in tok.vocab.items()}
    merges = [(token_to_str(a), token_to_str(b)) for a, b in tok.merges]
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(
        [
            tokenizers.AddedToken(s, normalized=False, special=True)
            for _, s in sorted(specials.items())
        ]
    )
    return hf


def tiktoken_direct(tok: Tokenizer, single_digits: bool = False):
    r"""tiktoken built from the vocabulary with tiktoken's own GPT-2 pre-tokenizer pattern (the one
    its r50k_base/gpt2 encodings use), not lmstack's. ``single_digits``: SmolLM2's pre-tokenizer,
    HF's Digits(individual_digits=True) before ByteLevel — every digit alone, no space attached —
    i.e. tiktoken's pattern with its number branch `` ?\p{N}++`` replaced by ``\p{N}``."""
    from tiktoken_ext.openai_public import r50k_pat_str

    pattern = r50k_pat_str
    if single_digits:
        assert r" ?\p{N}++" in pattern, pattern
        pattern = pattern.replace(r" ?\p{N}++", r"\p{N}")
    specials = set(tok.special_tokens.values())
    ranks = {b: i for i, b in tok.vocab.items() if i not in specials}
    return tiktoken.Encoding(
        "t", pat_str=pattern, mergeable_ranks=ranks, special_tokens=dict(tok.special_tokens)
    )


# ---------------------------------------------------------------- a vocabulary lmstack trained
@pytest.mark.parametrize("text", TEXTS)
def test_trained_matches_hf_tokenizers(trained, text):
    hf = hf_direct(trained)
    assert hf.token_to_id("<|endoftext|>") == trained.special_tokens["<|endoftext|>"]
    assert trained.encode(text) == hf.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", [t for t in TEXTS if "<|endoftext|><|endoftext|>" not in t])
def test_trained_matches_tiktoken(trained, text):
    # tiktoken's special-token regex is not longest-first, so the overlapping pair is left to HF above
    enc = tiktoken_direct(trained)
    assert trained.encode(text) == enc.encode(text, allowed_special="all")
    assert trained.encode(text, allow_special=False) == enc.encode_ordinary(text)


def test_overlapping_specials_longest_first(trained):
    ids = trained.encode("a<|endoftext|><|endoftext|><|endoftext|>b")
    eot, eot2 = (
        trained.special_tokens["<|endoftext|>"],
        trained.special_tokens["<|endoftext|><|endoftext|>"],
    )
    assert ids == trained.encode("a") + [eot2, eot] + trained.encode("b")


def test_exports_equal_direct_references(trained):
    hf = to_hf_tokenizer(trained)
    enc = to_tiktoken(trained)
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False).ids == trained.encode(text)
        if "<|endoftext|><|endoftext|>" not in text:
            assert enc.encode(text, allowed_special="all") == trained.encode(text)
        assert hf.decode(trained.encode(text), skip_special_tokens=False) == text


# ---------------------------------------------------------------- SmolLM2's vocabulary (from the GGUF)
@pytest.fixture(scope="module")
def smol_refs(smol):
    return tiktoken_direct(smol, single_digits=True), to_hf_tokenizer(smol)


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_matches_tiktoken_and_hf(smol, hf_smollm, smol_refs, text):
    text = text.replace("<|endoftext|><|endoftext|>", "<|endoftext|> <|endoftext|>")
    enc, exported = smol_refs
    ids = smol.encode(text)
    assert ids == hf_smollm.encode(text, add_special_tokens=False).ids
    assert ids == enc.encode(text, allowed_special="all")
    assert ids == exported.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------- formats
def test_own_format_roundtrip(trained, tmp_path):
    path = tmp_path / "tok.json"
    save(trained, path)
    back = load_tokenizer(path)
    assert back.vocab == trained.vocab and back.merges == trained.merges
    assert back.special_tokens == trained.special_tokens and back.pattern == trained.pattern
    for text in TEXTS:
        assert back.encode(text) == trained.encode(text)


def test_gpt2_files_read_by_hf(trained, tmp_path):
    save_gpt2(trained, tmp_path / "vocab.json", tmp_path / "merges.txt")
    # HF's own reader of GPT-2 files
    from tokenizers import models, pre_tokenizers

    hf = tokenizers.Tokenizer(
        models.BPE.from_file(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    )
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    plain = [t for t in TEXTS if "<|" not in t]
    for text in plain:
        assert hf.encode(text, add_special_tokens=False).ids == trained.encode(text)
    back = load_gpt2(tmp_path / "vocab.json", tmp_path / "merges.txt", special_tokens=SPECIALS)
    assert back.vocab == trained.vocab and back.merges == trained.merges
    assert load_tokenizer(tmp_path).merges == trained.merges


def test_gpt2_byte_mapping_matches_hf():
    from tokenizers import pre_tokenizers

    from lmstack.tokenizer import bytes_to_unicode

    assert sorted(bytes_to_unicode().values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert bytes_to_unicode()[ord(" ")] == "Ġ" and bytes_to_unicode()[ord("\n")] == "Ċ"


def test_hf_json_in_and_out(trained, smol, hf_smollm, tmp_path):
    save_hf(trained, tmp_path / "tokenizer.json")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False).ids == trained.encode(text)
    assert load_tokenizer(tmp_path).vocab == trained.vocab
    # HF's own serialization of SmolLM2 (Digits + ByteLevel) read back by lmstack
    back = from_hf_json(hf_smollm.to_str())
    assert back.pattern == smol.pattern and back.merges == smol.merges
    for text in TEXTS + ["x   123 <|im_start|>"]:
        assert back.encode(text) == hf_smollm.encode(text, add_special_tokens=False).ids
    # a custom pattern goes out as Split + ByteLevel(use_regex=False)
    gpt4 = Tokenizer(trained.vocab, trained.merges, SPECIALS, pattern="gpt4")
    assert json.loads(to_hf_json(gpt4))["pre_tokenizer"]["type"] == "Sequence"
    for text in TEXTS:
        assert to_hf_tokenizer(gpt4).encode(text, add_special_tokens=False).ids == gpt4.encode(text)


def test_unsupported_files_are_named(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"model": {"type": "Unigram"}}))
    with pytest.raises(ValueError, match="model.type='Unigram'"):
        load_tokenizer(bad)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope")


@pytest.mark.parametrize("where", ["jinja_file", "config"])
def test_hf_folder_chat_template_and_special_tokens_as_autotokenizer_reads_them(
    trained, tmp_path, where
):
    """Issue #31: an HF folder's tokenizer_config.json and chat_template.jinja were never read, so chat failed on
    every HF checkpoint. The chat template and bos/eos/pad read from the folder render and resolve as
    transformers' AutoTokenizer does on the same folder."""
    transformers = pytest.importorskip("transformers")

    template = (
        "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    save_hf(trained, tmp_path / "tokenizer.json")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"),
        bos_token="<|im_start|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = template
    fast.save_pretrained(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    jinja = tmp_path / "chat_template.jinja"
    if where == "config":  # the older layout: the template inside tokenizer_config.json
        jinja.unlink(missing_ok=True)
        cfg["chat_template"] = template
    else:
        jinja.write_text(template)
        cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    assert tok.chat_template == template
    assert tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
    )
    cfg["eos_token"] = "<|not-a-token|>"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=r"eos_token='<\|not-a-token\|>' is not a token"):
        load_tokenizer(tmp_path)
