"""Tokenizer files under attack: every reader (lmstack JSON, HF tokenizer.json, GPT-2 vocab.json + merges.txt,
GGUF) given arbitrary JSON values, malformed entries, cut or flipped bytes raises TokenizerFileError naming
the file (or loads a working tokenizer); freshly trained tokenizers round-trip arbitrary text; a pattern
that does not cover the text is refused before training. hypothesis runs derandomized."""

import json
import random
import re
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmstack.cli import main as lmstack_main
from lmstack.tokenizer import (
    Tokenizer,
    load_gguf_tokenizer,
    load_tokenizer,
    save,
    save_hf,
    train_bpe,
)
from lmstack.tokenizer.formats import from_dict, from_hf_json, load_gpt2, save_gpt2
from lmstack.tokenizer.pretokenize import resolve_training_pattern
from lmstack.tokenizer.tokenizer import MAX_TOKEN_ID, TokenizerFileError

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
CORPUS = (
    "Hello world, hello there! It's 2024 — naïve café 日本語 😀\n\tdef f(x): return x ** 2\n" * 20
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**40), max_value=2**70)
    | st.floats()
    | st.text(max_size=10)
    | st.sampled_from(["lmstack-bpe", "BPE", "ByteLevel", "Ġa", "a b", "zz", "00", "-1"]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
unicode_text = st.text(
    st.one_of(
        st.characters(exclude_categories=("Cs",)),
        st.sampled_from(list(" \t\n\r'0123456789<|>é日😀")),
    ),
    max_size=60,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    vocab, merges = train_bpe(
        d / "corpus.txt", 300, ["<|endoftext|>"], num_workers=1, progress=False
    )
    tok = Tokenizer(vocab, merges, ["<|endoftext|>"])
    tok.eos_token_id = tok.special_tokens["<|endoftext|>"]
    return tok


@pytest.fixture(scope="module")
def files(trained, tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    save(trained, d / "lm.json")
    save_hf(trained, d / "hf.json")
    save_gpt2(trained, d / "vocab.json", d / "merges.txt")
    return {
        "lm": json.loads((d / "lm.json").read_text()),
        "hf": json.loads((d / "hf.json").read_text()),
        "vocab": json.loads((d / "vocab.json").read_text()),
        "merges": (d / "merges.txt").read_text(),
    }


def clear_or_working(load) -> None:
    """A TokenizerFileError, or a tokenizer that encodes and decodes; nothing else."""
    try:
        tok = load()
    except TokenizerFileError:
        return
    ids = tok.encode("hello world 123")
    assert all(0 <= i < tok.vocab_size for i in ids)
    tok.decode(ids)


# ---- round trip on freshly trained tokenizers -------------------------------------------------------
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    corpus=unicode_text.filter(bool),
    extra=st.integers(0, 60),
    pattern=st.sampled_from(["gpt2", "gpt4", "smollm"]),
    texts=st.lists(unicode_text, min_size=1, max_size=5),
)
def test_fresh_tokenizer_round_trips_arbitrary_text(tmp_path, corpus, extra, pattern, texts):
    (tmp_path / "c.txt").write_text(corpus * 3, encoding="utf-8")
    vocab, merges = train_bpe(
        tmp_path / "c.txt", 257 + extra, ["<|endoftext|>"], pattern, num_workers=1, progress=False
    )
    tok = Tokenizer(vocab, merges, ["<|endoftext|>"], pattern=pattern)
    for text in texts + [corpus, "<|endoftext|>".join(texts)]:
        assert tok.decode(tok.encode(text)) == text
    save(tok, tmp_path / "t.json")  # and the file written for it reads back to the same tokenizer
    again = load_tokenizer(tmp_path / "t.json")
    assert again.encode(corpus) == tok.encode(corpus)


# ---- arbitrary JSON to every reader --------------------------------------------------------------
@SETTINGS
@given(json_values)
def test_any_json_file_is_a_tokenizer_or_a_clear_error(tmp_path, value):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(value))
    clear_or_working(lambda: load_tokenizer(path))


@SETTINGS
@given(
    st.sampled_from(
        [
            "format",
            "vocab",
            "merges",
            "special_tokens",
            "pattern",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "chat_template",
        ]
    ),
    json_values,
)
def test_lmstack_file_with_one_entry_replaced(files, key, value):
    clear_or_working(lambda: from_dict({**files["lm"], key: value}, "t.json"))


@SETTINGS
@given(
    st.sampled_from(
        [
            "model",
            "added_tokens",
            "pre_tokenizer",
            "normalizer",
            "model.vocab",
            "model.merges",
            "model.type",
            "added_tokens.0",
            "added_tokens.0.id",
            "pre_tokenizer.pretokenizers",
        ]
    ),
    json_values,
)
def test_hf_file_with_one_entry_replaced(files, key, value):
    d = json.loads(json.dumps(files["hf"]))
    *parents, last = key.split(".")
    node = d
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    if isinstance(node, list):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    clear_or_working(lambda: from_hf_json(json.dumps(d), "tokenizer.json"))


@SETTINGS
@given(json_values, st.text(max_size=40))
def test_gpt2_files_with_anything(tmp_path, files, vocab, merges):
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text(merges)
    clear_or_working(lambda: load_gpt2(tmp_path / "vocab.json", tmp_path / "merges.txt"))
    (tmp_path / "vocab.json").write_text(json.dumps(files["vocab"]))
    clear_or_working(lambda: load_gpt2(tmp_path / "vocab.json", tmp_path / "merges.txt"))


# ---- the cases the issue names ------------------------------------------------------------------------
@pytest.mark.parametrize("value", [[1, 2], 5, "tokenizer", None, True])
def test_json_that_is_not_an_object(tmp_path, value):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(value))
    with pytest.raises(
        TokenizerFileError, match=rf"t.json: {type(value).__name__} .* is not a tokenizer file"
    ):
        load_tokenizer(path)


def edit_hf(files, edit) -> dict:
    d = json.loads(json.dumps(files["hf"]))
    edit(d)
    return d


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["added_tokens"][0].pop("id"),
            r"added_tokens\[0\] = .*expected an object with an integer 'id'",
        ),
        (
            lambda d: d["added_tokens"][0].update(id="0"),
            r"added_tokens\[0\] = .*expected an object with an integer 'id'",
        ),
        (
            lambda d: d["model"].update(merges=[1, 2]),
            r"model.merges\[0\] = 1; expected \"left right\" or \[left, right\]",
        ),
        (lambda d: d["model"].update(merges=[["a"]]), r"model.merges\[0\] = \['a'\]; expected"),
        (
            lambda d: d["model"]["vocab"].update(a=-1),
            r"model.vocab\['a'\] = -1; expected a token id in \[0, ",
        ),
        (
            lambda d: d["model"]["vocab"].update(a=10**12),
            r"model.vocab\['a'\] = 1000000000000; expected a token id",
        ),
        (
            lambda d: d["model"]["vocab"].update(a=1.5),
            r"model.vocab\['a'\] = 1.5; expected a token id",
        ),
        (
            lambda d: d["model"]["vocab"].update(a=d["model"]["vocab"]["b"]),
            r"model.vocab gives id \d+ to both '[ab]' and '[ab]'",
        ),
        (
            lambda d: d["model"]["vocab"].update({"\u2603": 5000}),
            r"model.vocab\['☃'\].*not one of GPT-2's 256 byte",
        ),
        (lambda d: d.update(model=[]), r"model is list \[\]; expected dict"),
        (
            lambda d: d.update(pre_tokenizer="ByteLevel"),
            r"pre_tokenizer is 'ByteLevel'; expected ByteLevel",
        ),
        (lambda d: d.update(normalizer="NFC"), r"normalizer \"NFC\" is not supported"),
    ],
)
def test_hf_tokenizer_json_errors_name_the_file_and_entry(tmp_path, files, edit, message):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(edit_hf(files, edit)))
    with pytest.raises(TokenizerFileError, match=rf"tokenizer.json: {message}"):
        load_tokenizer(path)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("vocab", {"-1": "41"}, r"malformed vocab id '-1'"),
        (
            "vocab",
            {"99999999999": "41"},
            r"malformed vocab id '99999999999'; expected distinct ids in \[0, ",
        ),
        ("vocab", {"1": "41", "01": "42"}, r"malformed vocab id '01'"),
        ("vocab", [], r"vocab is list \[\]; expected dict"),
        ("merges", [3, 4], r"malformed merges\[0\] = 3; expected a pair of hex strings"),
        ("merges", [["zz", "41"]], r"malformed merges\[0\]\[0\] = 'zz'; expected a hex string"),
        ("special_tokens", ["x"], r"special_tokens is list \['x'\]; expected dict"),
        ("special_tokens", {"<s>": -3}, r"special_tokens\['<s>'\] = -3; expected a token id"),
        ("eos_token_id", "2", r"eos_token_id='2' must be a token id"),
        ("pattern", "(", r"pattern '\(' is neither a known name"),
        ("pattern", 7, r"pattern=7 must be a string"),
    ],
)
def test_lmstack_file_errors_name_the_file_and_entry(tmp_path, files, key, value, message):
    path = tmp_path / "tok.json"
    path.write_text(json.dumps({**files["lm"], key: value}))
    with pytest.raises(TokenizerFileError, match=rf"tok.json: {message}"):
        load_tokenizer(path)


def test_gpt2_vocab_errors_name_the_file(tmp_path, files):
    (tmp_path / "merges.txt").write_text(files["merges"])
    for vocab, message in [
        ([1], r"the file's JSON|vocab is list"),
        ({"a": "1"}, r"vocab\['a'\] = '1'"),
        ({"a": 1, "b": 1}, "gives id 1 to both 'a' and 'b'"),
    ]:
        (tmp_path / "vocab.json").write_text(json.dumps(vocab))
        with pytest.raises(TokenizerFileError, match=rf"vocab.json: .*({message})"):
            load_tokenizer(tmp_path)
    (tmp_path / "vocab.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(TokenizerFileError, match="vocab.json: not UTF-8 text"):
        load_tokenizer(tmp_path)


# ---- GGUF tokenizer metadata ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok_gguf(trained, tmp_path_factory):
    gguf = pytest.importorskip("gguf")
    from lmstack.tokenizer.byte_unicode import token_to_str

    path = tmp_path_factory.mktemp("g") / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    specials = set(trained.special_tokens.values())
    w.add_tokenizer_model("gpt2")
    w.add_token_list(
        [b.decode() if i in specials else token_to_str(b) for i, b in sorted(trained.vocab.items())]
    )
    w.add_token_types([3 if i in specials else 1 for i in sorted(trained.vocab)])
    w.add_token_merges([f"{token_to_str(a)} {token_to_str(b)}" for a, b in trained.merges])
    w.add_eos_token_id(trained.eos_token_id)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert load_gguf_tokenizer(path).encode(CORPUS) == trained.encode(CORPUS)
    return path


def test_gguf_tokenizer_cut_or_flipped_is_a_clear_error(tok_gguf, tmp_path):
    raw = tok_gguf.read_bytes()
    rng = random.Random(5)
    path = tmp_path / "bad.gguf"
    # (the last bytes are alignment padding after the metadata: a cut there loses nothing)
    for cut in sorted(
        {0, 3, 4, 10, 24, len(raw) - 32} | {rng.randrange(len(raw) - 32) for _ in range(40)}
    ):
        path.write_bytes(raw[:cut])
        with pytest.raises(
            TokenizerFileError, match=rf"bad.gguf: (truncated at byte {cut}, expected|starts with)"
        ):
            load_gguf_tokenizer(path)
    for _ in range(200):
        b = bytearray(raw)
        b[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        path.write_bytes(b)
        clear_or_working(lambda: load_gguf_tokenizer(path))


def test_gguf_tokenizer_metadata_of_the_wrong_type(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_array("tokenizer.ggml.tokens", [1, 2, 3])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        TokenizerFileError, match=r"t.gguf: tokenizer.ggml.tokens\[0\] = 1; expected a string"
    ):
        load_gguf_tokenizer(path)


# ---- pre-tokenizer patterns must cover the text ---------------------------------------------------
@pytest.mark.parametrize("pattern", ["", r"\p{L}+", r"[a-z]+|\s", "x*"])
def test_pattern_that_drops_text_is_refused_before_training(tmp_path, pattern):
    with pytest.raises(ValueError, match=re.escape(f"pattern {pattern!r} does not cover the text")):
        resolve_training_pattern(pattern)
    (tmp_path / "c.txt").write_text(CORPUS)
    out = tmp_path / "tok.json"
    assert (
        lmstack_main(
            [
                "tokenizer",
                "train",
                str(tmp_path / "c.txt"),
                "--vocab-size",
                "300",
                "--pattern",
                pattern,
                "--out",
                str(out),
            ]
        )
        == 2
    )
    assert not out.exists()


@pytest.mark.parametrize("pattern", ["gpt2", "gpt4", "llama3", "smollm", r"\s+|\S+", r"(?s)."])
def test_covering_patterns_are_accepted(pattern):
    resolve_training_pattern(pattern)


def test_max_token_id_bounds_the_vocabulary():
    with pytest.raises(
        ValueError,
        match=rf"token id {MAX_TOKEN_ID + 1} must be an integer in \[0, {MAX_TOKEN_ID}\]",
    ):
        Tokenizer({MAX_TOKEN_ID + 1: b"a"}, [])
    with pytest.raises(ValueError, match=r"token 0 is 5; expected bytes"):
        Tokenizer({0: 5}, [])
    struct.pack("<I", MAX_TOKEN_ID)  # fits the uint32 token files
