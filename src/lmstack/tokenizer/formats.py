"""Tokenizer files in and out (seed 001 "分词器": tiktoken and HF tokenizers are the reference libraries).

- lmstack's own JSON (:func:`save`/:func:`load`): token bytes as hex, nothing lost.
- GPT-2 ``vocab.json`` + ``merges.txt`` (tokens as GPT-2 printable strings, see :mod:`.byte_unicode`).
- HF ``tokenizer.json`` for byte-level BPE, both directions, and a live ``tokenizers.Tokenizer``.
- A live ``tiktoken.Encoding`` (ranks = ids; requires merge order to follow id order).
- GGUF in (:mod:`.gguf_io`). :func:`load_tokenizer` picks the format from the path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lmstack.utils import atomic_write_text

from .byte_unicode import str_to_token, token_to_str
from .gguf_io import load_gguf_tokenizer
from .pretokenize import GPT2_PATTERN, PATTERNS, SMOLLM_PATTERN
from .tokenizer import Tokenizer

FORMAT = "lmstack-bpe"
_META = ("bos_token_id", "eos_token_id", "pad_token_id", "chat_template")


def _pattern_value(tok: Tokenizer) -> str:
    return tok.pattern_name if tok.pattern_name in PATTERNS else tok.pattern


def _set_meta(tok: Tokenizer, meta: dict) -> Tokenizer:
    for k in _META:
        if meta.get(k) is not None:
            setattr(tok, k, meta[k])
    return tok


# ---------------------------------------------------------------------- lmstack JSON
def to_dict(tok: Tokenizer) -> dict:
    return {
        "format": FORMAT,
        "version": 1,
        "pattern": _pattern_value(tok),
        "vocab": {str(i): b.hex() for i, b in sorted(tok.vocab.items())},
        "merges": [[a.hex(), b.hex()] for a, b in tok.merges],
        "special_tokens": tok.special_tokens,
        **{k: getattr(tok, k) for k in _META},
    }


def save(tok: Tokenizer, path: str | os.PathLike) -> None:
    """Write lmstack's own tokenizer file (JSON, atomically)."""
    atomic_write_text(path, json.dumps(to_dict(tok), ensure_ascii=False))


def from_dict(d: dict, where: str = "tokenizer") -> Tokenizer:
    if d.get("format") != FORMAT:
        raise ValueError(f"{where}: format={d.get('format')!r}, expected {FORMAT!r}")
    for key in ("vocab", "merges"):
        if key not in d:
            raise ValueError(f"{where}: no {key!r} entry; expected a file written by lmstack.tokenizer.save")
    try:
        vocab = {int(i): bytes.fromhex(h) for i, h in d["vocab"].items()}
        merges = [(bytes.fromhex(a), bytes.fromhex(b)) for a, b in d["merges"]]
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{where}: malformed vocab/merges ({e}); expected hex strings") from None
    specials = sorted(d.get("special_tokens", {}), key=lambda s: d["special_tokens"][s])
    return _set_meta(Tokenizer(vocab, merges, specials, pattern=d.get("pattern")), d)


def load(path: str | os.PathLike) -> Tokenizer:
    """Read a file written by :func:`save`."""
    path = Path(path)
    return from_dict(json.loads(path.read_text(encoding="utf-8")), str(path))


# ---------------------------------------------------------------------- GPT-2 vocab.json + merges.txt
def save_gpt2(tok: Tokenizer, vocab_path: str | os.PathLike, merges_path: str | os.PathLike) -> None:
    """GPT-2 files: ``vocab.json`` maps printable token strings to ids; ``merges.txt`` one pair a line."""
    specials = {i: s for s, i in tok.special_tokens.items()}
    vocab = {specials.get(i, token_to_str(b)): i for i, b in sorted(tok.vocab.items())}
    atomic_write_text(vocab_path, json.dumps(vocab, ensure_ascii=False))
    lines = ["#version: 0.2"] + [f"{token_to_str(a)} {token_to_str(b)}" for a, b in tok.merges]
    atomic_write_text(merges_path, "\n".join(lines) + "\n")


def load_gpt2(
    vocab_path: str | os.PathLike,
    merges_path: str | os.PathLike,
    special_tokens: list[str] | None = None,
    pattern: str | None = None,
) -> Tokenizer:
    """Read GPT-2 files. ``special_tokens=None`` treats ``<|endoftext|>`` as special when present."""
    raw = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
    if special_tokens is None:
        special_tokens = [s for s in ("<|endoftext|>",) if s in raw]
    specials = set(special_tokens)
    vocab = {int(i): (s.encode("utf-8") if s in specials else str_to_token(s)) for s, i in raw.items()}
    merges = []
    for n, line in enumerate(Path(merges_path).read_text(encoding="utf-8").split("\n")):
        if not line or (n == 0 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{merges_path}:{n + 1}: {line!r} is not two tokens separated by one space")
        merges.append((str_to_token(parts[0]), str_to_token(parts[1])))
    return Tokenizer(vocab, merges, special_tokens, pattern=pattern)


# ---------------------------------------------------------------------- HF tokenizer.json
def _hf_pre_tokenizer(tok: Tokenizer) -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if tok.pattern == GPT2_PATTERN:
        return byte_level
    if tok.pattern == SMOLLM_PATTERN:
        return {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    split = {"type": "Split", "pattern": {"Regex": tok.pattern}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, {**byte_level, "use_regex": False}]}


def to_hf_json(tok: Tokenizer) -> str:
    """HF ``tokenizer.json`` text for this byte-level BPE (no normalizer, ByteLevel decoder)."""
    specials = {i: s for s, i in tok.special_tokens.items()}
    vocab = {}
    for i, b in sorted(tok.vocab.items()):
        vocab.setdefault(specials[i] if i in specials else token_to_str(b), i)
    d = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, s in sorted(specials.items())
        ],
        "normalizer": None,
        "pre_tokenizer": _hf_pre_tokenizer(tok),
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab,
            "merges": [[token_to_str(a), token_to_str(b)] for a, b in tok.merges],
        },
    }
    return json.dumps(d, ensure_ascii=False)


def save_hf(tok: Tokenizer, path: str | os.PathLike) -> None:
    atomic_write_text(path, to_hf_json(tok))


def _pattern_from_hf(pre: dict | None, where: str) -> str:
    if pre is None:
        raise ValueError(f"{where}: no pre_tokenizer; expected ByteLevel (byte-level BPE)")
    kind = pre.get("type")
    if kind == "ByteLevel" and pre.get("use_regex", True):
        return GPT2_PATTERN
    if kind == "Sequence":
        steps = pre.get("pretokenizers", [])
        kinds = [s.get("type") for s in steps]
        if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
            return SMOLLM_PATTERN
        if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
            pat = steps[0].get("pattern", {})
            if "Regex" in pat and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
                return pat["Regex"]
    raise ValueError(
        f"{where}: pre_tokenizer {json.dumps(pre)[:200]} is not supported; expected ByteLevel(use_regex), "
        "Sequence[Digits(individual), ByteLevel] or Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)]"
    )


def from_hf_json(text: str, where: str = "tokenizer.json") -> Tokenizer:
    d = json.loads(text)
    model = d.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"{where}: model.type={model.get('type')!r}, expected 'BPE'")
    if d.get("normalizer") is not None:
        raise ValueError(f"{where}: normalizer {d['normalizer'].get('type')!r} is not supported; expected none")
    if not isinstance(model.get("vocab"), dict):
        raise ValueError(f"{where}: model.vocab is missing or not a dict; expected token -> id")
    pattern = _pattern_from_hf(d.get("pre_tokenizer"), where)
    added = {t["id"]: t["content"] for t in d.get("added_tokens", [])}
    vocab = {}
    for s, i in model["vocab"].items():
        vocab[i] = added[i].encode("utf-8") if i in added else str_to_token(s)
    for i, s in added.items():
        vocab[i] = s.encode("utf-8")
    merges = []
    for m in model.get("merges", []):
        a, b = m.split(" ") if isinstance(m, str) else m
        merges.append((str_to_token(a), str_to_token(b)))
    specials = [added[i] for i in sorted(added)]
    return Tokenizer(vocab, merges, specials, pattern=pattern)


def load_hf(path: str | os.PathLike) -> Tokenizer:
    path = Path(path)
    return from_hf_json(path.read_text(encoding="utf-8"), str(path))


def to_hf_tokenizer(tok: Tokenizer):
    """A live HF ``tokenizers.Tokenizer`` with the same vocab, merges, specials and pre-tokenizer."""
    import tokenizers

    return tokenizers.Tokenizer.from_str(to_hf_json(tok))


def to_tiktoken(tok: Tokenizer, name: str = "lmstack"):
    """A live ``tiktoken.Encoding``: mergeable ranks are the token ids of the non-special tokens.

    tiktoken merges by the rank of the merged token, lmstack by the rank of the merge; the two agree
    when token ids grow with merge order (true for lmstack-trained, GPT-2 and SmolLM2 vocabularies).
    """
    import tiktoken

    special_ids = set(tok.special_tokens.values())
    ranks: dict[bytes, int] = {}
    for i, b in sorted(tok.vocab.items()):
        if i not in special_ids:
            ranks.setdefault(b, i)
    return tiktoken.Encoding(name=name, pat_str=tok.pattern, mergeable_ranks=ranks, special_tokens=dict(tok.special_tokens))


# ---------------------------------------------------------------------- any of the above
def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load by path: ``*.gguf``; a directory holding ``tokenizer.json`` or ``vocab.json`` + ``merges.txt``;
    or a JSON file in lmstack's or HF's format."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return load_hf(path / "tokenizer.json")
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return load_gpt2(path / "vocab.json", path / "merges.txt")
        raise ValueError(f"directory {str(path)!r} has neither tokenizer.json nor vocab.json + merges.txt")
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"GGUF":
        return load_gguf_tokenizer(path)
    text = path.read_text(encoding="utf-8")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: neither GGUF nor JSON ({e})") from None
    if d.get("format") == FORMAT:
        return from_dict(d, str(path))
    if "model" in d:
        return from_hf_json(text, str(path))
    raise ValueError(f"{path}: JSON without 'format': {FORMAT!r} or an HF 'model'; not a tokenizer file")
