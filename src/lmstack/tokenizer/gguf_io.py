"""Read the tokenizer stored inside a GGUF file (llama.cpp's ``tokenizer.ggml.*`` keys).

Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is supported: tokens are GPT-2 printable
strings (see :mod:`.byte_unicode`), merges are ``"left right"`` strings, and token types mark
control/user-defined tokens (special tokens, stored as plain text). ``tokenizer.ggml.pre`` names
the pre-tokenizer; ``"smollm"`` (SmolLM2) splits every digit and then applies GPT-2's regex.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from .byte_unicode import str_to_token
from .pretokenize import PATTERNS
from .tokenizer import Tokenizer

# llama.cpp token types
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike, prefix: str = "") -> dict:
    """The key/value metadata of a GGUF file (v2/v3, little-endian), stopping before tensor info.

    Only keys starting with ``prefix`` are kept (others are skipped without building them), so
    reading a 49k-token vocabulary takes a fraction of a second. Arrays become Python lists.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        size = len(buf)
        pos = 0

        def need(n: int) -> None:
            if pos + n > size:
                raise ValueError(f"{path}: truncated GGUF metadata (needs byte {pos + n}, file has {size})")

        def scalar(fmt: str):
            nonlocal pos
            n = struct.calcsize(fmt)
            need(n)
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += n
            return v

        def string() -> bytes:
            nonlocal pos
            n = scalar("<Q")
            need(n)
            v = buf[pos : pos + n]
            pos += n
            return v

        def value(vtype: int, keep: bool):
            nonlocal pos
            if vtype in _SCALARS:
                return scalar(_SCALARS[vtype])
            if vtype == _STRING:
                v = string()
                return v.decode("utf-8", errors="replace") if keep else None
            if vtype == _ARRAY:
                itype, count = scalar("<I"), scalar("<Q")
                if itype in _SCALARS:
                    fmt = _SCALARS[itype]
                    n = struct.calcsize(fmt) * count
                    need(n)
                    out = list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos)) if keep else None
                    pos += n
                    return out
                if itype == _STRING:
                    if not keep:
                        for _ in range(count):
                            string()
                        return None
                    return [string().decode("utf-8", errors="replace") for _ in range(count)]
                return [value(itype, keep) for _ in range(count)]
            raise ValueError(f"{path}: unknown GGUF value type {vtype} at byte {pos}; expected 0..12")

        need(4)
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path}: starts with {bytes(buf[:4])!r}, expected the GGUF magic b'GGUF'")
        pos = 4
        version = scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported; expected 2 or 3")
        scalar("<Q")  # tensor count
        n_kv = scalar("<Q")
        meta: dict = {"GGUF.version": version}
        for _ in range(n_kv):
            key = string().decode("utf-8", errors="replace")
            vtype = scalar("<I")
            keep = key.startswith(prefix)
            v = value(vtype, keep)
            if keep:
                meta[key] = v
        return meta


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Build a :class:`Tokenizer` from a GGUF file's metadata (no tensors are read).

    Sets ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` and ``chat_template`` (``None`` when
    absent). Control and user-defined tokens become special tokens.
    """
    meta = read_gguf_metadata(path, prefix="tokenizer.")

    def get(key: str, required: bool = True):
        if key not in meta and required:
            raise ValueError(f"{path}: GGUF metadata lacks {key!r}; expected a byte-level BPE tokenizer")
        return meta.get(key)

    model = get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={model!r} is not supported; expected 'gpt2' (byte-level BPE)")
    tokens = get("tokenizer.ggml.tokens")
    merge_lines = get("tokenizer.ggml.merges")
    types = get("tokenizer.ggml.token_type", required=False) or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{path}: {len(types)} token types for {len(tokens)} tokens; expected one type per token")

    vocab: dict[int, bytes] = {}
    specials: list[str] = []
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            vocab[i] = tok.encode("utf-8")
            specials.append(tok)
        else:
            vocab[i] = str_to_token(tok)
    merges = []
    for line in merge_lines:
        left, sep, right = line.partition(" ")
        if not sep:
            raise ValueError(f"{path}: merge {line!r} is not two tokens separated by a space")
        merges.append((str_to_token(left), str_to_token(right)))

    pre = get("tokenizer.ggml.pre", required=False) or "gpt2"
    if pre not in PATTERNS:
        raise ValueError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported; expected one of {sorted(PATTERNS)}")

    tok = Tokenizer(vocab, merges, special_tokens=specials, pattern=pre)
    tok.bos_token_id = get("tokenizer.ggml.bos_token_id", required=False)
    tok.eos_token_id = get("tokenizer.ggml.eos_token_id", required=False)
    tok.pad_token_id = get("tokenizer.ggml.padding_token_id", required=False)
    tok.chat_template = get("tokenizer.chat_template", required=False)
    return tok
