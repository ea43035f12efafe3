"""BPE training checked against a slow, obviously-correct reference trainer and HF BpeTrainer."""

from __future__ import annotations

import json
import random
import time
from collections import Counter

import pytest
import regex
from tok_helpers import stdlib_text

from lmstack.tokenizer import GPT2_PATTERN
from lmstack.tokenizer import train as train_mod
from lmstack.tokenizer.train import count_pretokens, find_chunk_boundaries, train_bpe

WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they which "
    "one you were her all she there would their we him been has when who will more no if out so said "
    "what up its about into than them can only other new some could time these two may then do first "
    "low lower lowest newer newest wider widest café naïve 東京 北京 😀 ok."
).split()


def make_corpus(n_words: int, seed: int, special: str | None = None) -> str:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** 1.1 for i in range(len(WORDS))]
    out = []
    for _i in range(n_words):
        out.append(rng.choices(WORDS, weights)[0])
        r = rng.random()
        out.append(" " if r < 0.8 else ("\n" if r < 0.9 else (", " if r < 0.95 else "  ")))
        if special and rng.random() < 0.02:
            out.append(special)
    return "".join(out)


def reference_train(text: str, vocab_size: int | None, specials: list[str], tie_break=None):
    """Slow and plain: split on specials (longest first), count pre-tokens, recount all pairs every step.

    ``vocab_size=None`` trains to exhaustion (until every pre-token is one token). ``tie_break``:
    among the pairs with the winning count, the one with the greatest ``tie_break(pair, merges so
    far)``; default the pair of byte strings itself (the GPT-2 convention). Returns merges and, per
    merge, whether the winning count was tied (where conventions may differ).
    """
    parts = [text]
    for s in sorted(specials, key=len, reverse=True):
        parts = [q for p in parts for q in p.split(s)]
    words = Counter()
    pat = regex.compile(GPT2_PATTERN)
    for p in parts:
        for piece in pat.findall(p):
            words[tuple(bytes([b]) for b in piece.encode("utf-8"))] += 1
    n_merges = vocab_size - len(specials) - 256 if vocab_size is not None else None
    merges, tied = [], []
    while n_merges is None or len(merges) < n_merges:
        pairs = Counter()
        for w, n in words.items():
            for i in range(len(w) - 1):
                pairs[(w[i], w[i + 1])] += n
        if not pairs:
            break
        best_count = max(pairs.values())
        tied_pairs = [p for p, c in pairs.items() if c == best_count]
        best = (
            max(tied_pairs)
            if tie_break is None
            else max(tied_pairs, key=lambda p: tie_break(p, merges))
        )
        tied.append(sum(1 for c in pairs.values() if c == best_count) > 1)
        merges.append(best)
        new_words = Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += n
        words = new_words
    return merges, tied


@pytest.mark.parametrize("seed", [0, 1])
def test_merges_match_reference(tmp_path, seed):
    text = make_corpus(3000, seed, special="<|endoftext|>")
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(path, 256 + 1 + 150, ["<|endoftext|>"])
    ref, _ = reference_train(text, 256 + 1 + 150, ["<|endoftext|>"])
    assert merges == ref
    assert vocab[0] == b"<|endoftext|>"
    assert len(vocab) == 256 + 1 + len(merges) == 256 + 1 + 150
    assert [vocab[1 + b] for b in range(256)] == [bytes([b]) for b in range(256)]
    assert vocab[257 + len(merges) - 1] == merges[-1][0] + merges[-1][1]


def test_no_token_contains_a_piece_of_a_special(tmp_path):
    # '<|' is frequent and would be merged if special tokens were not split out first
    text = "".join(f"word{i % 7} <|endoftext|>" for i in range(2000))
    path = tmp_path / "c.txt"
    path.write_text(text)
    vocab, merges = train_bpe(path, 400, ["<|endoftext|>"])
    learned = [vocab[i] for i in range(257, len(vocab))]
    assert learned and not any(b"<|" in t or b"|>" in t for t in learned)


def test_parallel_chunked_counting_equals_whole_text(tmp_path, monkeypatch):
    text = make_corpus(20000, 3, special="<|endoftext|>")
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    monkeypatch.setattr(train_mod, "_SERIAL_BYTES", 0)
    monkeypatch.setattr(train_mod, "_CHUNK_BYTES", 8192)
    bounds = find_chunk_boundaries(path, 8, [b"<|endoftext|>"])
    data = path.read_bytes()
    assert len(bounds) > 3 and all(data[b:].startswith(b"<|endoftext|>") for b in bounds[1:-1])
    got = count_pretokens(path, ["<|endoftext|>"], num_workers=2)
    expected = Counter()
    for part in text.split("<|endoftext|>"):
        expected.update(regex.findall(GPT2_PATTERN, part))
    assert got == expected


def test_chunking_without_specials_cuts_before_space_letter(tmp_path, monkeypatch):
    text = make_corpus(20000, 4)
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    monkeypatch.setattr(train_mod, "_SERIAL_BYTES", 0)
    monkeypatch.setattr(train_mod, "_CHUNK_BYTES", 8192)
    assert count_pretokens(path, num_workers=2) == Counter(regex.findall(GPT2_PATTERN, text))


def test_several_files_and_errors(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("hello hello hello")
    b.write_text(" world world")
    counts = count_pretokens([a, b])
    assert counts == Counter({" hello": 2, "hello": 1, " world": 2})
    with pytest.raises(FileNotFoundError, match="missing"):
        train_bpe(tmp_path / "missing", 300)
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe(a, 100, ["<|endoftext|>"])


def test_matches_hf_bpe_trainer_until_first_tie(tmp_path):
    """HF breaks count ties by its own id order, lmstack by the greatest byte pair: compare up to the first tie."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from lmstack.tokenizer.byte_unicode import str_to_token

    text = make_corpus(20000, 5)
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    n = 300
    ref, tied = reference_train(text, 256 + n, [])
    first_tie = tied.index(True) if True in tied else len(tied)
    assert first_tie >= 20, "corpus too tie-prone for a meaningful comparison"

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + n,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train([str(path)], trainer)
    hf_merges = json.loads(hf.to_str())["model"]["merges"]
    hf_merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in hf_merges]
    hf_merges = [(str_to_token(a), str_to_token(b)) for a, b in hf_merges]

    _, ours = train_bpe(path, 256 + n)
    assert ours == ref
    assert ours[:first_tie] == hf_merges[:first_tie]


def test_small_corpus_trains_fast(tmp_path):
    text = stdlib_text(100_000)
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    t0 = time.perf_counter()
    vocab, merges = train_bpe(path, 500, ["<|endoftext|>"])
    elapsed = time.perf_counter() - t0
    assert len(vocab) == 500
    assert elapsed < 1.0, f"100 KB -> 500 tokens took {elapsed:.2f}s, expected well under 1s"


def test_chunk_boundaries_never_split_a_longer_special(tmp_path):
    double = b"<|endoftext|><|endoftext|>"
    data = (b"x" * 50 + double) * 400
    path = tmp_path / "d.txt"
    path.write_bytes(data)
    for n in (3, 7, 13):
        bounds = find_chunk_boundaries(path, n, [b"<|endoftext|>", double])
        assert len(bounds) > 2
        for b in bounds[1:-1]:
            assert data[b:].startswith(double), b  # cut only before a whole double special


def test_invalid_utf8_bytes_are_trained_as_bytes(tmp_path):
    """Bytes that are not UTF-8 survive counting (surrogateescape) and come back as the same bytes."""
    path = tmp_path / "bin.txt"
    path.write_bytes(b"ok \xff\xfe\xff\xfe ok \xff\xfe\xff\xfe ok " * 50)
    counts = count_pretokens(path)
    assert sum(counts.values()) > 0
    vocab, merges = train_bpe(path, 270)
    assert (b"\xff", b"\xfe") in merges
    assert any(b"\xff\xfe" in t for t in vocab.values())


def test_custom_pattern_chunks_only_at_specials(tmp_path, monkeypatch):
    text = make_corpus(20000, 7)
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    assert find_chunk_boundaries(path, 4, [], safe_cuts=False) == [0, path.stat().st_size]
    monkeypatch.setattr(train_mod, "_SERIAL_BYTES", 0)
    monkeypatch.setattr(train_mod, "_CHUNK_BYTES", 8192)
    custom = r"\S+\s*"  # would be cut differently before ' <letter>'
    assert count_pretokens(path, pattern=custom, num_workers=2) == Counter(
        regex.findall(custom, text)
    )


def gpt2_byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (openai/gpt-2 encoder.py ``bytes_to_unicode``):
    printable Latin-1 bytes map to themselves, the other bytes to U+0100 onwards in byte order."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


# Small corpora where the merges run out: count-1 pairs, ties at every count, overlapping
# pairs ("aaaa"), words of one byte, multi-byte characters, a corpus with one word.
EXHAUSTION_CORPORA = {
    "zipf-300": make_corpus(300, 11),
    "zipf-120": make_corpus(120, 12),
    "ties": "ab ba ab ba cd dc cd dc abcd dcba x y z",
    "overlaps": "aaaa aaa aa a aaaaa bbbb abab baba aabb",
    "singletons": "the quick brown fox jumps over a lazy dog; pack my box with five dozen liquor jugs",
    "unicode": "café naïve 東京 北京 東京 😀😀 ok ok. ok!",
    "one-word": "mississippi",
}


@pytest.mark.parametrize("name", list(EXHAUSTION_CORPORA))
def test_merges_to_exhaustion_match_reference_and_hf(tmp_path, name):
    """Every merge until nothing is left, count-1 pairs and ties included: lmstack equals the slow
    reference (ties: greatest byte pair), and HF's BpeTrainer equals the same reference with HF's
    tie rule (ties: smallest pair of HF token ids, the 256 byte characters numbered in code point
    order and each merge the next id), so both trainers see the same counts at every step."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = EXHAUSTION_CORPORA[name]
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    ref, tied = reference_train(text, None, [])
    assert len(ref) >= 5 and any(tied)
    vocab, ours = train_bpe(
        path, 256 + 10 * len(ref)
    )  # asks for more than exist: trains to exhaustion
    assert ours == ref
    assert len(vocab) == 256 + len(ref)

    chars = gpt2_byte_chars()
    to_str = {bytes([b]): c for b, c in enumerate(chars)}
    byte_ids = {bytes([b]): i for i, b in enumerate(sorted(range(256), key=lambda b: chars[b]))}

    def hf_tie(pair, merges):  # the greatest key among ties = the smallest (id a, id b)
        ids = dict(byte_ids)
        for a, b in merges:  # a merged token gets the next id the first time it appears
            ids.setdefault(a + b, len(ids))
        return (-ids[pair[0]], -ids[pair[1]])

    ref_hf, _ = reference_train(text, None, [], tie_break=hf_tie)

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.train(
        [str(path)],
        trainers.BpeTrainer(
            vocab_size=256 + 10 * len(ref),
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    hf_merges = json.loads(hf.to_str())["model"]["merges"]
    hf_merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in hf_merges]
    assert hf_merges == [
        ("".join(to_str[bytes([c])] for c in a), "".join(to_str[bytes([c])] for c in b))
        for a, b in ref_hf
    ]
