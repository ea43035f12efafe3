"""Tokenizer files in and out (CS336 notes "分词器": tiktoken and HF tokenizers are the reference libraries).

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

from .byte_unicode import token_to_str
from .gguf_io import load_gguf_tokenizer
from .pretokenize import GPT2_PATTERN, PATTERNS, SMOLLM_PATTERN
from .tokenizer import MAX_TOKEN_ID, Tokenizer, TokenizerFileError, printable_token

FORMAT = "lmstack-bpe"
_META = ("bos_token_id", "eos_token_id", "pad_token_id", "chat_template")


def _pattern_value(tok: Tokenizer) -> str:
    return tok.pattern_name if tok.pattern_name in PATTERNS else tok.pattern


def _set_meta(tok: Tokenizer, meta: dict, where: str) -> Tokenizer:
    for k in _META:
        v = meta.get(k)
        if v is None:
            continue
        if k == "chat_template" and not isinstance(v, str):
            raise TokenizerFileError(f"{where}: chat_template={v!r:.60} must be a string")
        if k != "chat_template" and (
            isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOKEN_ID
        ):
            raise TokenizerFileError(
                f"{where}: {k}={v!r:.60} must be a token id in [0, {MAX_TOKEN_ID}]"
            )
        setattr(tok, k, v)
    return tok


# ---------------------------------------------------------------------- checks shared by the readers
def _read_json(path: str | os.PathLike):
    """(text, value) of a JSON file; bad UTF-8 or JSON is a TokenizerFileError naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerFileError(f"{path}: not UTF-8 text ({e})") from None
    return text, _parse_json(text, str(path))


def _parse_json(text: str, where: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise TokenizerFileError(f"{where}: not valid JSON ({e})") from None


def _expect(value, kind: type, where: str, what: str):
    if not isinstance(value, kind):
        raise TokenizerFileError(
            f"{where}: {what} is {type(value).__name__} {value!r:.60}; expected {kind.__name__}"
        )
    return value


def _ids_by_token(raw: dict, where: str, what: str = "vocab") -> dict[int, str]:
    """A token -> id map (HF, GPT-2) inverted, with every id an integer in range and used once."""
    out: dict[int, str] = {}
    for s, i in _expect(raw, dict, where, what).items():
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= MAX_TOKEN_ID:
            raise TokenizerFileError(
                f"{where}: {what}[{s!r}] = {i!r:.40}; expected a token id in [0, {MAX_TOKEN_ID}]"
            )
        if i in out:
            raise TokenizerFileError(
                f"{where}: {what} gives id {i} to both {out[i]!r} and {s!r}; expected each id once"
            )
        out[i] = s
    return out


def _build(where: str, vocab: dict[int, bytes], merges, specials, pattern) -> Tokenizer:
    """The Tokenizer, with whatever it refuses (a merge of unknown tokens, a bad pattern) naming the file."""
    if not vocab:
        raise TokenizerFileError(f"{where}: the vocabulary is empty")
    if pattern is not None and not isinstance(pattern, str):
        raise TokenizerFileError(
            f"{where}: pattern={pattern!r:.60} must be a string (a regex or a name)"
        )
    try:
        return Tokenizer(vocab, merges, specials, pattern=pattern)
    except ValueError as e:
        raise TokenizerFileError(f"{where}: {e}") from None


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


def _hex_token(h, where: str, what: str) -> bytes:
    try:
        return bytes.fromhex(_expect(h, str, where, what))
    except ValueError:
        raise TokenizerFileError(
            f"{where}: malformed {what} = {h!r:.40}; expected a hex string"
        ) from None


def from_dict(d: dict, where: str = "tokenizer") -> Tokenizer:
    _expect(d, dict, where, "the file's JSON")
    if d.get("format") != FORMAT:
        raise TokenizerFileError(f"{where}: format={d.get('format')!r}, expected {FORMAT!r}")
    for key in ("vocab", "merges"):
        if key not in d:
            raise TokenizerFileError(
                f"{where}: no {key!r} entry; expected a file written by lmstack.tokenizer.save"
            )
    vocab: dict[int, bytes] = {}
    for k, h in _expect(d["vocab"], dict, where, "vocab").items():
        i = int(k) if k.isascii() and k.isdigit() else -1
        if not 0 <= i <= MAX_TOKEN_ID or i in vocab:
            raise TokenizerFileError(
                f"{where}: malformed vocab id {k!r}; expected distinct ids in [0, {MAX_TOKEN_ID}]"
            )
        vocab[i] = _hex_token(h, where, f"vocab[{k!r}]")
    merges = []
    for n, m in enumerate(_expect(d["merges"], list, where, "merges")):
        if not isinstance(m, list) or len(m) != 2:
            raise TokenizerFileError(
                f"{where}: malformed merges[{n}] = {m!r:.60}; expected a pair of hex strings"
            )
        merges.append(
            (_hex_token(m[0], where, f"merges[{n}][0]"), _hex_token(m[1], where, f"merges[{n}][1]"))
        )
    specials = _ids_by_token(d.get("special_tokens") or {}, where, "special_tokens")
    tok = _build(where, vocab, merges, [specials[i] for i in sorted(specials)], d.get("pattern"))
    return _set_meta(tok, d, where)


def load(path: str | os.PathLike) -> Tokenizer:
    """Read a file written by :func:`save`."""
    return from_dict(_read_json(path)[1], str(path))


# ---------------------------------------------------------------------- GPT-2 vocab.json + merges.txt
def save_gpt2(
    tok: Tokenizer, vocab_path: str | os.PathLike, merges_path: str | os.PathLike
) -> None:
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
    raw = _ids_by_token(_read_json(vocab_path)[1], str(vocab_path))
    if special_tokens is None:
        special_tokens = [s for s in ("<|endoftext|>",) if s in raw.values()]
    specials = set(special_tokens)
    vocab = {
        i: (
            s.encode("utf-8")
            if s in specials
            else printable_token(s, str(vocab_path), f"token {i}")
        )
        for i, s in raw.items()
    }
    try:
        lines = Path(merges_path).read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise TokenizerFileError(f"{merges_path}: not UTF-8 text ({e})") from None
    merges = []
    for n, line in enumerate(lines):
        if not line or (n == 0 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise TokenizerFileError(
                f"{merges_path}:{n + 1}: {line!r} is not two tokens separated by one space"
            )
        merges.append(tuple(printable_token(p, f"{merges_path}:{n + 1}", "merge") for p in parts))
    return _build(str(vocab_path), vocab, merges, special_tokens, pattern)


# ---------------------------------------------------------------------- HF tokenizer.json
def _hf_pre_tokenizer(tok: Tokenizer) -> dict:
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    if tok.pattern == GPT2_PATTERN:
        return byte_level
    if tok.pattern == SMOLLM_PATTERN:
        return {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
        }
    split = {
        "type": "Split",
        "pattern": {"Regex": tok.pattern},
        "behavior": "Isolated",
        "invert": False,
    }
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
            {
                "id": i,
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, s in sorted(specials.items())
        ],
        "normalizer": None,
        "pre_tokenizer": _hf_pre_tokenizer(tok),
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[token_to_str(a), token_to_str(b)] for a, b in tok.merges],
        },
    }
    return json.dumps(d, ensure_ascii=False)


def save_hf(tok: Tokenizer, path: str | os.PathLike) -> None:
    atomic_write_text(path, to_hf_json(tok))


_HF_SPECIALS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "pad_token": "pad_token_id",
}


def save_hf_config(tok: Tokenizer, path: str | os.PathLike) -> None:
    """HF's ``tokenizer_config.json`` beside a ``tokenizer.json``: the chat template and the BOS/EOS/PAD tokens
    (as strings), which tokenizer.json does not hold."""
    d: dict = {"chat_template": tok.chat_template} if tok.chat_template else {}
    for key, attr in _HF_SPECIALS.items():
        tid = getattr(tok, attr)
        if tid is not None:
            d[key] = tok.vocab[tid].decode("utf-8", "replace")
    atomic_write_text(path, json.dumps(d, ensure_ascii=False, indent=1))


def _pattern_from_hf(pre, where: str) -> str:
    if not isinstance(pre, dict):
        raise TokenizerFileError(
            f"{where}: pre_tokenizer is {pre!r:.60}; expected ByteLevel (byte-level BPE)"
        )
    kind = pre.get("type")
    if kind == "ByteLevel" and pre.get("use_regex", True):
        return GPT2_PATTERN
    steps = pre.get("pretokenizers") if kind == "Sequence" else None
    if isinstance(steps, list) and all(isinstance(step, dict) for step in steps):
        kinds = [step.get("type") for step in steps]
        if (
            kinds == ["Digits", "ByteLevel"]
            and steps[0].get("individual_digits")
            and steps[1].get("use_regex", True)
        ):
            return SMOLLM_PATTERN
        if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
            pat = steps[0].get("pattern")
            if (
                isinstance(pat, dict)
                and isinstance(pat.get("Regex"), str)
                and steps[0].get("behavior") == "Isolated"
                and not steps[0].get("invert")
            ):
                return pat["Regex"]
    raise TokenizerFileError(
        f"{where}: pre_tokenizer {json.dumps(pre)[:200]} is not supported; expected ByteLevel(use_regex), "
        "Sequence[Digits(individual), ByteLevel] or Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)]"
    )


def _hf_added_tokens(d: dict, where: str) -> dict[int, str]:
    added: dict[int, str] = {}
    for n, t in enumerate(_expect(d.get("added_tokens") or [], list, where, "added_tokens")):
        i = t.get("id") if isinstance(t, dict) else None
        content = t.get("content") if isinstance(t, dict) else None
        if (
            isinstance(i, bool)
            or not isinstance(i, int)
            or not 0 <= i <= MAX_TOKEN_ID
            or not isinstance(content, str)
        ):
            raise TokenizerFileError(
                f"{where}: added_tokens[{n}] = {t!r:.80}; expected an object with an integer "
                f"'id' in [0, {MAX_TOKEN_ID}] and a string 'content'"
            )
        if i in added:
            raise TokenizerFileError(
                f"{where}: added_tokens gives id {i} to both {added[i]!r} and {content!r}"
            )
        added[i] = content
    return added


def _hf_merge(m, n: int, where: str) -> tuple[bytes, bytes]:
    parts = m.split(" ") if isinstance(m, str) else m
    if not isinstance(parts, list) or len(parts) != 2:
        raise TokenizerFileError(
            f'{where}: model.merges[{n}] = {m!r:.60}; expected "left right" or [left, right]'
        )
    what = f"model.merges[{n}]"
    return printable_token(parts[0], where, what), printable_token(parts[1], where, what)


def from_hf_json(text: str, where: str = "tokenizer.json") -> Tokenizer:
    d = _expect(_parse_json(text, where), dict, where, "the file's JSON")
    model = _expect(d.get("model"), dict, where, "model")
    if model.get("type") != "BPE":
        raise TokenizerFileError(f"{where}: model.type={model.get('type')!r:.60}, expected 'BPE'")
    if d.get("normalizer") is not None:
        raise TokenizerFileError(
            f"{where}: normalizer {json.dumps(d['normalizer'])[:100]} is not supported; "
            "expected none"
        )
    if not isinstance(model.get("vocab"), dict):
        raise TokenizerFileError(
            f"{where}: model.vocab is missing or not a dict; expected token -> id"
        )
    pattern = _pattern_from_hf(d.get("pre_tokenizer"), where)
    added = _hf_added_tokens(d, where)
    vocab = {
        i: added[i].encode("utf-8")
        if i in added
        else printable_token(s, where, f"model.vocab[{s!r}]")
        for i, s in _ids_by_token(model["vocab"], where, "model.vocab").items()
    }
    for i, s in added.items():
        vocab[i] = s.encode("utf-8")
    merges = [
        _hf_merge(m, n, where)
        for n, m in enumerate(_expect(model.get("merges") or [], list, where, "model.merges"))
    ]
    return _build(where, vocab, merges, [added[i] for i in sorted(added)], pattern)


def load_hf(path: str | os.PathLike) -> Tokenizer:
    text, _ = _read_json(path)
    return from_hf_json(text, str(path))


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
    return tiktoken.Encoding(
        name=name,
        pat_str=tok.pattern,
        mergeable_ranks=ranks,
        special_tokens=dict(tok.special_tokens),
    )


def _token_content(v, where: str, key: str) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken object ``{"content": ...}``."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    raise TokenizerFileError(
        f"{where}: {key}={v!r:.60}; expected a string or an object with a 'content' string"
    )


def apply_hf_folder_config(tok: Tokenizer, folder: str | os.PathLike) -> Tokenizer:
    """What HF keeps beside ``tokenizer.json``: the chat template (``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template`` — a string, or a list of named templates of which "default"
    is taken) and the bos/eos/pad tokens named in ``tokenizer_config.json``, as ``AutoTokenizer`` reads them.
    Only what the folder states is set; a token named there must be in the vocabulary."""
    folder = Path(folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg: dict = {}
    if cfg_path.is_file():
        _, cfg = _read_json(cfg_path)
        cfg = _expect(cfg, dict, str(cfg_path), "the file")
    template = cfg.get("chat_template")
    if isinstance(
        template, list
    ):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerFileError(
            f"{cfg_path}: chat_template={template!r:.60}; expected a string or named templates"
        )
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():  # transformers saves the template there; it wins over the config's copy
        template = jinja.read_text(encoding="utf-8")
    if template is not None:
        tok.chat_template = template
    ids = {b.decode("utf-8", "replace"): i for i, b in tok.vocab.items()}
    ids.update(tok.special_tokens)
    for key in ("bos_token", "eos_token", "pad_token"):
        content = _token_content(cfg.get(key), str(cfg_path), key)
        if content is None:
            continue
        if content not in ids:
            raise TokenizerFileError(
                f"{cfg_path}: {key}={content!r} is not a token of {folder / 'tokenizer.json'}"
            )
        setattr(tok, f"{key}_id", ids[content])
    return tok


# ---------------------------------------------------------------------- any of the above
def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load by path: ``*.gguf``; a directory holding ``tokenizer.json`` or ``vocab.json`` + ``merges.txt``;
    or a JSON file in lmstack's or HF's format."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
    if (
        path.is_dir()
    ):  # an HF folder: the tokenizer, plus its chat template and special tokens beside it
        if (path / "tokenizer.json").is_file():
            return apply_hf_folder_config(load_hf(path / "tokenizer.json"), path)
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return apply_hf_folder_config(load_gpt2(path / "vocab.json", path / "merges.txt"), path)
        raise TokenizerFileError(
            f"directory {str(path)!r} has neither tokenizer.json nor vocab.json + merges.txt"
        )
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"GGUF":
        return load_gguf_tokenizer(path)
    try:
        text, d = _read_json(path)
    except TokenizerFileError as e:
        raise TokenizerFileError(
            f"{path}: neither GGUF nor JSON ({str(e).removeprefix(f'{path}: ')})"
        ) from None
    if isinstance(d, dict) and d.get("format") == FORMAT:
        return from_dict(d, str(path))
    if isinstance(d, dict) and "model" in d:
        return from_hf_json(text, str(path))
    raise TokenizerFileError(
        f"{path}: {type(d).__name__} {d!r:.60} is not a tokenizer file; expected a JSON object "
        f"with 'format': {FORMAT!r} or an HF 'model'"
    )
