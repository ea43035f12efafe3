"""Property tests (hypothesis): round-trips, streaming equals whole-text encoding, and agreement
with tiktoken / HF tokenizers on arbitrary Unicode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tok_helpers import SPECIALS

SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# Arbitrary Unicode (no surrogates, which are not encodable as UTF-8), biased toward the
# characters that stress pre-tokenization: whitespace runs, digits, apostrophes, specials' pieces.
unicode_text = st.text(
    st.one_of(
        st.characters(exclude_categories=("Cs",)),
        st.sampled_from(list(" \t\n\r\x0b\x0c\u00a0\u3000'sdl0123456789<|>")),
    ),
    max_size=80,
)
with_specials = st.lists(st.one_of(unicode_text, st.sampled_from(SPECIALS)), max_size=6).map(
    "".join
)


@SETTINGS
@given(text=unicode_text)
def test_roundtrip_plain(trained, text):
    assert trained.decode(trained.encode(text)) == text
    assert trained.decode(trained.encode(text, allow_special=False)) == text


@SETTINGS
@given(text=with_specials)
def test_roundtrip_with_specials(trained, text):
    assert trained.decode(trained.encode(text)) == text


@SETTINGS
@given(text=with_specials, cuts=st.lists(st.integers(0, 500), max_size=8))
def test_encode_iterable_equals_encode(trained, text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert list(trained.encode_iterable(chunks, chunk_chars=1)) == trained.encode(text)


@SETTINGS
@given(text=unicode_text)
def test_agrees_with_tiktoken_and_hf(trained, text):
    tiktoken = pytest.importorskip("tiktoken")
    tokenizers = pytest.importorskip("tokenizers")
    from test_tokenizer_interop import hf_direct, tiktoken_direct

    ids = trained.encode(text, allow_special=False)
    assert ids == _cached(trained, "tt", tiktoken_direct).encode_ordinary(text)
    hf_ids = _cached(trained, "hf", hf_direct).encode(text, add_special_tokens=False).ids
    assert trained.encode(text) == hf_ids  # HF always matches special tokens
    del tiktoken, tokenizers


_REFS: dict = {}


def _cached(tok, key, build):
    if (id(tok), key) not in _REFS:
        _REFS[(id(tok), key)] = build(tok)
    return _REFS[(id(tok), key)]


@SETTINGS
@given(data=st.binary(max_size=40))
def test_decode_invalid_utf8_like_python(trained, data):
    ids = [trained.token_to_id(bytes([b])) for b in data]
    assert trained.decode(ids) == data.decode("utf-8", errors="replace")


@SETTINGS
@given(text=with_specials)
def test_smollm2_agrees_with_hf_digits_bytelevel(smol, hf_smollm, text):
    """SmolLM2's one-regex pre-tokenizer equals HF's Sequence[Digits(individual), ByteLevel] on any text
    (bytes SmolLM2's vocab lacks are dropped by both, as HF BPE does without an unk token)."""
    assert smol.encode(text) == hf_smollm.encode(text, add_special_tokens=False).ids


ascii_text = st.text(st.characters(max_codepoint=127), max_size=120)


@SETTINGS
@given(text=ascii_text)
def test_ascii_fast_path_equals_unicode_regex(text):
    """The stdlib-``re`` ASCII variant of each built-in pattern cuts ASCII text exactly like ``regex``."""
    import re

    import regex

    from lmstack.tokenizer.pretokenize import PATTERNS, ascii_variant

    for pattern in set(PATTERNS.values()):
        assert re.findall(ascii_variant(pattern), text) == regex.findall(pattern, text)


def test_ascii_variant_only_for_builtin_patterns():
    from lmstack.tokenizer.pretokenize import ascii_variant

    assert ascii_variant(r"\p{L}+|\s+") is None


@SETTINGS
@given(text=with_specials, cuts=st.lists(st.integers(0, 500), max_size=8))
def test_encode_iterable_custom_pattern_that_skips_text(trained, text, cuts):
    """A custom pattern need not cover every character (here spaces are dropped); streaming still agrees."""
    from lmstack.tokenizer import Tokenizer

    tok = _cached(
        trained, "words", lambda t: Tokenizer(t.vocab, t.merges, SPECIALS, pattern=r"\w+|[^\w\s]+")
    )
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert list(tok.encode_iterable(chunks, chunk_chars=1)) == tok.encode(text)


mixed_text = st.text(
    st.one_of(
        st.characters(max_codepoint=127),
        st.sampled_from(list("éß中😀\u00a0\u2028\u3000½٣")),
        st.characters(exclude_categories=("Cs",)),
    ),
    max_size=120,
)


@SETTINGS
@given(text=mixed_text)
def test_pretokenizer_split_equals_regex_findall(text):
    """ASCII stretches via ``re`` and non-ASCII stretches (widened to safe cuts) via ``regex``
    give exactly ``regex.findall`` on the whole text, for every built-in pattern."""
    import regex

    from lmstack.tokenizer.pretokenize import PATTERNS, PreTokenizer

    for pattern in set(PATTERNS.values()):
        assert PreTokenizer(pattern).split(text) == regex.findall(pattern, text)
