"""The native encoder core (csrc/bpe.cpp) against the Python `regex` module's pre-tokens, tiktoken and HF
tokenizers on the same vocabulary, and the Python path (ids unchanged); threads, the cache bound, fallback."""

from __future__ import annotations

import pickle
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tok_helpers import SPECIALS, stdlib_text

from lmstack.tokenizer import Tokenizer, native, to_hf_tokenizer, to_tiktoken
from lmstack.tokenizer.pretokenize import PATTERNS

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
BUILT_IN = ["gpt2", "gpt4", "llama3", "smollm"]

# Characters where the patterns' alternatives meet: every kind of whitespace (incl. \x1c-\x1f and \x85,
# which str.isspace and `regex` see differently), the contraction letters in both cases and U+017F LONG S
# (GPT-4's (?i) folds it to s, Llama-3's [sS] does not), digits of other scripts, letters that are not
# ASCII, combining marks, CJK, emoji, punctuation.
TRICKY = list(
    " \t\n\r\x0b\x0c\x1c\x1f\x85\xa0\u2028\u3000\u200b\ufeff'’\"sStTdDmMlLrReEvVſKİ0123456789٣½Ⅻ¹"
    "aéü\u0301ǅ中文日本語한😀🎉👍🏽.,!?-_()[]<>|\\/#$%&*+=~`@^{};:"
)
unicode_text = st.one_of(
    st.text(
        st.one_of(st.characters(exclude_categories=("Cs",)), st.sampled_from(TRICKY)), max_size=80
    ),
    st.text(st.sampled_from(TRICKY), max_size=40),  # dense in the characters above
)
with_specials = st.lists(st.one_of(unicode_text, st.sampled_from(SPECIALS)), max_size=6).map(
    "".join
)

pytestmark = pytest.mark.skipif(
    native.status() is not None, reason=f"native core off: {native.status()}"
)


def python_path(tok: Tokenizer) -> Tokenizer:
    """The same tokenizer on its Python path (the encoder as it was before the native core)."""
    twin = pickle.loads(pickle.dumps(tok))
    twin.use_native = False
    return twin


_TOKS: dict = {}


def variant(trained: Tokenizer, pattern: str) -> tuple[Tokenizer, Tokenizer, object, object]:
    """(native, python path, tiktoken, HF tokenizers) on the trained vocabulary with ``pattern``."""
    if pattern not in _TOKS:
        tok = Tokenizer(trained.vocab, trained.merges, SPECIALS, pattern=pattern)
        _TOKS[pattern] = (tok, python_path(tok), to_tiktoken(tok), to_hf_tokenizer(tok))
    return _TOKS[pattern]


@pytest.mark.parametrize("pattern", BUILT_IN)
@SETTINGS
@given(text=unicode_text)
def test_pretokens_equal_regex(trained, pattern, text):
    tok = variant(trained, pattern)[0]
    assert tok.backend == "native"
    assert native.module().pretokenize(tok._core(), text) == regex.findall(PATTERNS[pattern], text)


@pytest.mark.parametrize("pattern", BUILT_IN)
@SETTINGS
@given(text=with_specials)
def test_ids_equal_python_path_tiktoken_and_hf(trained, pattern, text):
    tok, py, tt, hf = variant(trained, pattern)
    ids = tok.encode(text)
    assert ids == py.encode(text)
    assert tok.encode(text, allow_special=False) == py.encode(text, allow_special=False)
    # HF's added tokens match at every position, longest first, as lmstack does; tiktoken's special regex
    # is not longest-first, so it is asked only about text without specials
    assert ids == hf.encode(text, add_special_tokens=False).ids
    plain = text.replace("<|", "< |")
    assert tok.encode(plain) == tt.encode_ordinary(plain)


EDGES = [
    "it'ſx",
    "x'ſ'ſy",
    "he'Sa'Tb'REc'Ved'Me'LLf'Dg",
    "we'rEx I'lLy",
    "'ſx",
    "''s",
    "x   123",
    "x 1",
    "a\n\n  b",
    "  \n x",
    "ends  ",
    "ends\n ",
    " \t\n\r\n\x0b x",
    "\x85x \x1c y \u3000z",
    "a\u0301b 中文 😀😀 !!\n\n",
    "1234567",
    "٣½Ⅻ¹2",
    "(foo ((bar",
    "\tfoo \rbar",
    "\r\n\r\n",
    "? !\r\n",
    "$1,000.50",
    "",
]


@pytest.mark.parametrize("pattern", BUILT_IN)
@pytest.mark.parametrize("text", EDGES)
def test_edges_equal_regex_and_tiktoken(trained, pattern, text):
    tok, _, tt, _ = variant(trained, pattern)
    assert native.module().pretokenize(tok._core(), text) == regex.findall(PATTERNS[pattern], text)
    assert tok.encode(text) == tt.encode_ordinary(text)


@pytest.mark.parametrize("pattern", BUILT_IN)
def test_long_pieces_take_the_heap_path(trained, pattern):
    """Pre-tokens of hundreds of bytes (a CJK sentence is one \\p{L}+ run, whitespace runs, a long word)
    merge through the linked list + heap; ids equal tiktoken's and the Python path's."""
    tok, py, tt, _ = variant(trained, pattern)
    texts = [
        "你好世界今天天气很好我们一起学习分词器" * 20,
        " " * 700 + "x",
        "\n\n \t" * 100,
        "a" * 1000,
        "ab" * 333 + "!",
        "😀" * 150,
        "1234567890" * 50,
        "'" * 300 + "s",
        "é" * 400,
    ]
    for text in texts:
        assert tok.encode(text) == tt.encode_ordinary(text) == py.encode(text), text[:20]


def test_real_text_equals_tiktoken_and_python(smol):
    text = (
        stdlib_text(300_000) + "你好，世界！今天天气很好。😀 café naïve ſtop 'S 'ſ\r\n\r\n  \x85x"
    )
    tt = to_tiktoken(smol)
    ids = smol.encode(text)
    assert ids == tt.encode(text, allowed_special="all") == python_path(smol).encode(text)


@pytest.mark.parametrize(
    "text",
    [
        "<|endoftext|><|endoftext|><|endoftext|>",
        "<|endoftext|<|im_start|>",
        "<|<|endoftext|>|>",
        "x<|im_start|>",
        "<|endoftext",
        "<<|endoftext|>>",
    ],
)
def test_specials_longest_first(trained, text):
    tok, py, _, hf = variant(trained, "gpt2")
    assert tok.encode(text) == py.encode(text) == hf.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, allow_special=False) == py.encode(text, allow_special=False)


def test_lone_surrogates_raise_like_python(trained):
    tok = variant(trained, "gpt2")[0]
    for text in ["a\ud800b", "\udfff", "ok \ud83d"]:
        with pytest.raises(UnicodeEncodeError):
            tok.encode(text)
        with pytest.raises(UnicodeEncodeError):
            python_path(tok).encode(text)
        with pytest.raises(UnicodeEncodeError):
            tok.encode_batch(["fine", text], num_workers=2)


def test_threads_share_the_cache_and_agree(smol):
    docs = stdlib_text(400_000).split("<|endoftext|>")
    tt = to_tiktoken(smol)
    want = tt.encode_ordinary_batch(docs, num_threads=1)
    smol.clear_cache()
    assert smol.encode_batch(docs, num_workers=4) == want
    with ThreadPoolExecutor(
        3
    ) as pool:  # Python threads calling encode at once (GIL released inside)
        assert list(pool.map(smol.encode, docs)) == want
    flat = smol.encode_concat(
        docs, np.uint16, sep_id=smol.special_tokens["<|endoftext|>"], num_threads=2
    )
    ref = np.concatenate(
        [np.array(w + [smol.special_tokens["<|endoftext|>"]], dtype=np.uint16) for w in want]
    )
    np.testing.assert_array_equal(flat, ref)
    py = python_path(smol)
    np.testing.assert_array_equal(
        py.encode_concat(docs[:5], np.uint32),
        np.concatenate([np.array(w, dtype=np.uint32) for w in want[:5]]),
    )


def test_cache_is_bounded(trained):
    tok = Tokenizer(trained.vocab, trained.merges, SPECIALS, cache_size=64)
    text = " ".join(f"w{i}x{i * 7}y" for i in range(3000))
    assert tok.encode(text) == to_tiktoken(tok).encode_ordinary(text)
    n = native.module().cache_len(tok._core())
    assert 0 < n <= 64
    tok.clear_cache()
    assert native.module().cache_len(tok._core()) == 0


def test_custom_pattern_merges_natively(trained):
    pattern = r"\S+|\s+"
    tok = Tokenizer(trained.vocab, trained.merges, SPECIALS, pattern=pattern)
    assert tok.backend == "native BPE, regex pre-tokenizer"
    text = "hello   world<|endoftext|> it's 2024 你好"
    assert (
        tok.encode(text)
        == to_tiktoken(tok).encode(text, allowed_special="all")
        == python_path(tok).encode(text)
    )
    assert list(tok.encode_iterable([text[:7], text[7:]], chunk_chars=4)) == tok.encode(text)


def test_pickles_without_the_native_encoder(trained):
    tok = variant(trained, "gpt4")[0]
    twin = pickle.loads(pickle.dumps(tok))
    assert twin._native_enc is None
    assert twin.encode("it'S 12345 ok") == tok.encode("it'S 12345 ok")


def test_sparse_large_ids(trained):
    """Ids past the core's table of ready-made Python ints (2^20) come out right (hand-worked)."""
    vocab = {i: bytes([i]) for i in range(256)}
    vocab[3_000_000] = b"ab"
    vocab[3_000_001] = b"abab"
    tok = Tokenizer(vocab, [(b"a", b"b"), (b"ab", b"ab")], ["<|e|>"])
    assert tok.backend == "native"
    assert tok.encode("ababab<|e|>") == [3_000_001, 3_000_000, 3_000_002]
    np.testing.assert_array_equal(
        tok.encode_concat(["abab", "x"], np.uint32, sep_id=3_000_002),
        [3_000_001, 3_000_002, 120, 3_000_002],
    )
