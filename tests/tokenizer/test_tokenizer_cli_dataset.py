"""``lmstack tokenizer`` commands and the flat token file (np.memmap, Book of LLMs §5.3 “memmap loading and bf16/int8 weights”)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tok_helpers import stdlib_text

from lmstack.cli import main
from lmstack.tokenizer import (
    Tokenizer,
    encode_files,
    is_token_file,
    load_tokenizer,
    open_tokens,
    read_sidecar,
    token_dtype,
)
from lmstack.tokenizer import train as train_mod


def test_dtype_rule():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    with pytest.raises(ValueError, match="vocab_size=0"):
        token_dtype(0)


def test_encode_files_parallel_equals_encode(trained, tmp_path, monkeypatch):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(stdlib_text(120_000), encoding="utf-8")
    b.write_text("第二个文件 second file <|endoftext|> end\n" * 500, encoding="utf-8")
    monkeypatch.setattr(train_mod, "_SERIAL_BYTES", 0)  # the threshold lives in plan_chunks
    stats = encode_files(trained, [a, b], tmp_path / "out.bin", num_workers=2, chunk_bytes=16_384)
    expected = trained.encode(a.read_text(encoding="utf-8")) + trained.encode(
        b.read_text(encoding="utf-8")
    )
    tokens = np.memmap(tmp_path / "out.bin", dtype=np.uint16, mode="r")
    assert tokens.tolist() == expected
    assert stats.n_tokens == len(expected) and stats.dtype == "uint16"
    assert stats.bytes_per_token == pytest.approx(
        (a.stat().st_size + b.stat().st_size) / len(expected)
    )
    assert open_tokens(tmp_path / "out.bin").tolist() == expected
    meta = json.loads((tmp_path / "out.bin.json").read_text())
    assert meta["n_tokens"] == len(expected) and meta["vocab_size"] == trained.vocab_size


def test_large_vocab_writes_uint32(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)}
    tok = Tokenizer(vocab, [], special_tokens=["<|x|>"])
    tok.vocab[70_000] = b"\x00\x00"  # an id beyond uint16
    (tmp_path / "a.txt").write_text("hi<|x|>")
    stats = encode_files(tok, tmp_path / "a.txt", tmp_path / "o.bin")
    assert stats.dtype == "uint32"
    assert open_tokens(tmp_path / "o.bin").tolist() == [104, 105, 256]


def test_the_reader_takes_what_the_encoder_writes_and_nothing_else(tmp_path):
    """One reader for the format the encoder writes: the sidecar's dtype, count and vocabulary."""
    vocab = {i: bytes([i]) for i in range(256)}
    (tmp_path / "a.txt").write_text("hello")
    encode_files(Tokenizer(vocab, []), tmp_path / "a.txt", tmp_path / "t.bin")
    info = read_sidecar(tmp_path / "t.bin")
    assert (info.dtype, info.n_tokens, info.vocab_size) == (np.uint16, 5, 256) and is_token_file(
        tmp_path / "t.bin"
    )
    side = tmp_path / "t.bin.json"
    for text in (
        "[1, 2]",
        "{",
        json.dumps({"dtype": "float32", "n_tokens": 5}),
        json.dumps({"n_tokens": 5}),
    ):
        side.write_text(text)
        assert not is_token_file(tmp_path / "t.bin")
        with pytest.raises(ValueError, match="sidecar|dtype"):
            open_tokens(tmp_path / "t.bin")
    side.write_text(json.dumps({"dtype": "uint16", "n_tokens": True, "vocab_size": "256"}))
    assert (
        read_sidecar(tmp_path / "t.bin").n_tokens is None
        and read_sidecar(tmp_path / "t.bin").vocab_size is None
    )
    assert open_tokens(tmp_path / "t.bin").tolist() == list(b"hello")
    side.unlink()
    assert not is_token_file(tmp_path / "t.bin")


def test_cli_train_encode_info(tmp_path, capsys):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "a.txt").write_text(stdlib_text(60_000), encoding="utf-8")
    (corpus / "b.txt").write_text("hello world, hello tokens\n" * 300, encoding="utf-8")
    tok_path = tmp_path / "tok.json"
    assert (
        main(
            [
                "tokenizer",
                "train",
                str(corpus),
                "--glob",
                "*.txt",
                "--vocab-size",
                "400",
                "--out",
                str(tok_path),
            ]
        )
        == 0
    )
    tok = load_tokenizer(tok_path)
    assert tok.vocab_size == 400 and "<|endoftext|>" in tok.special_tokens
    assert (
        main(
            [
                "tokenizer",
                "train",
                str(corpus / "b.txt"),
                "--vocab-size",
                "270",
                "--format",
                "hf",
                "--out",
                str(tmp_path / "tokenizer.json"),
            ]
        )
        == 0
    )
    assert load_tokenizer(tmp_path / "tokenizer.json").vocab_size == 270
    out = tmp_path / "tokens.bin"
    assert (
        main(
            [
                "tokenizer",
                "encode",
                str(corpus / "b.txt"),
                "--tokenizer",
                str(tok_path),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "bytes/token" in printed and "tokens (uint16)" in printed
    assert np.memmap(out, dtype=np.uint16, mode="r").tolist() == tok.encode(
        (corpus / "b.txt").read_text()
    )
    assert main(["tokenizer", "info", str(tok_path), "--text", "hello world"]) == 0
    assert "vocab size V  400" in capsys.readouterr().out
    assert main(["tokenizer", "info", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_info_gguf(gguf_path, capsys):
    assert main(["tokenizer", "info", str(gguf_path)]) == 0
    out = capsys.readouterr().out
    assert "49152" in out and "smollm" in out and "chat template yes" in out


def test_encode_batch_parallel(trained):
    texts = [stdlib_text(5000)[i * 500 : (i + 1) * 500] for i in range(10)] + ["", "<|endoftext|>x"]
    assert trained.encode_batch(texts, num_workers=2) == [trained.encode(t) for t in texts]
    with pytest.raises(ValueError, match="num_workers=0"):
        trained.encode_batch(texts, num_workers=0)


def test_corrupt_tokenizer_files(tmp_path):
    p = tmp_path / "t.json"
    p.write_text('{"format": "lmstack-bpe", "vocab": {"0": "zz"}, "merges": []}')
    with pytest.raises(ValueError, match="malformed"):
        load_tokenizer(p)
    p.write_text('{"format": "lmstack-bpe"}')
    with pytest.raises(ValueError, match="no 'vocab'"):
        load_tokenizer(p)
    p.write_text("{not json")
    with pytest.raises(ValueError, match="neither GGUF nor JSON"):
        load_tokenizer(p)


def test_a_corrupt_sidecar_is_an_error_naming_it_for_readers_that_would_read_text(tmp_path):
    """Issue #31: `eval ppl tok.bin` with a broken sidecar read the binary as UTF-8 text (ppl 255.8 over 3,439
    "tokens"; truth 266.3 over 1,719). A sidecar that exists must be valid, or the reader stops naming it."""
    from lmstack.eval.perplexity import read_eval_tokens

    vocab = {i: bytes([i]) for i in range(256)}
    (tmp_path / "a.txt").write_text("hello")
    encode_files(Tokenizer(vocab, []), tmp_path / "a.txt", tmp_path / "t.bin")
    side = tmp_path / "t.bin.json"
    good = side.read_text()
    assert read_eval_tokens(tmp_path / "t.bin").tolist() == list(b"hello")
    for text in (
        "{",
        "[1, 2]",
        good[: len(good) // 2],
        json.dumps({"dtype": "bogus", "n_tokens": 5}),
    ):
        side.write_text(text)
        with pytest.raises(ValueError, match=r"t\.bin"):
            read_eval_tokens(tmp_path / "t.bin", tokenizer=Tokenizer(vocab, []))
    side.unlink()  # no sidecar at all: a text file, read with the tokenizer
    (tmp_path / "t.bin").write_text("hi")
    assert read_eval_tokens(tmp_path / "t.bin", tokenizer=Tokenizer(vocab, [])).tolist() == list(
        b"hi"
    )
