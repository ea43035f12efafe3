"""Read the tokenizer stored inside a GGUF file (llama.cpp's ``tokenizer.ggml.*`` keys).

Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is supported: tokens are GPT-2 printable
strings (see :mod:`.byte_unicode`), merges are ``"left right"`` strings, and token types mark
control/user-defined tokens (special tokens, stored as plain text). ``tokenizer.ggml.pre`` names
the pre-tokenizer; ``"smollm"`` (SmolLM2) splits every digit and then applies GPT-2's regex.

:func:`read_gguf_layout` is lmstack's one GGUF header parser (the model loader uses it too): it trusts
no count or length, so a cut or corrupted file is a :class:`GGUFFormatError` saying
"truncated at byte N, expected M"; the tokenizer reader turns it and every malformed entry into a
:class:`~.tokenizer.TokenizerFileError` naming the file and key.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .pretokenize import PATTERNS
from .tokenizer import Tokenizer, TokenizerFileError, printable_token

# llama.cpp token types
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1,
    2,
    3,
    4,
    5,
    6,
)


_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


class GGUFFormatError(ValueError):
    """A GGUF file whose container (header, metadata, tensor table) is malformed or truncated."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table: ``dims`` fastest-first as stored, ``offset`` from the data section."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass
class GGUFLayout:
    """What the header says: metadata, the tensor table, where tensor data starts, the file's size."""

    metadata: dict
    tensors: list[GGUFTensorInfo]
    alignment: int
    data_offset: int
    file_size: int


class _Cursor:
    """Reads little-endian GGUF values from a buffer; every read checks the file is long enough."""

    def __init__(self, buf, path: Path) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise GGUFFormatError(
                f"{self.path}: truncated at byte {self.size}, expected {self.pos + n} bytes or more ({what})"
            )

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> bytes:
        n = self.scalar("<Q", what)
        self.need(n, what)
        v = self.buf[self.pos : self.pos + n]
        self.pos += n
        return v

    def value(self, vtype: int, keep: bool, what: str):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            v = self.string(what)
            return v.decode("utf-8", errors="replace") if keep else None
        if vtype != _ARRAY:
            raise GGUFFormatError(
                f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos} ({what}); "
                "expected 0..12"
            )
        itype, count = self.scalar("<I", what), self.scalar("<Q", what)
        smallest = (
            struct.calcsize(_SCALARS[itype]) if itype in _SCALARS else 8
        )  # a string or array is >= 8 bytes
        self.need(count * smallest, f"{what}: array of {count}")
        if itype in _SCALARS:
            fmt = _SCALARS[itype]
            out = (
                list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos)) if keep else None
            )
            self.pos += struct.calcsize(fmt) * count
            return out
        if itype == _STRING and not keep:
            for _ in range(count):
                self.string(what)
            return None
        if itype == _STRING:
            return [self.string(what).decode("utf-8", errors="replace") for _ in range(count)]
        return [self.value(itype, keep, what) for _ in range(count)]


def read_gguf_layout(path: str | os.PathLike, prefix: str = "", tensors: bool = True) -> GGUFLayout:
    """Parse a GGUF file's header (v2/v3, little-endian): metadata, then (``tensors``) the tensor table.

    Only metadata keys starting with ``prefix`` are kept (others are skipped without building them), so
    reading a 49k-token vocabulary takes a fraction of a second. Arrays become Python lists. Nothing is
    trusted: a count or length running past the end raises "truncated at byte N, expected M".
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise GGUFFormatError(
                f"{path}: truncated at byte 0, expected 4 bytes or more (the GGUF magic)"
            )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_layout(_Cursor(buf, path), prefix, tensors)


def _parse_layout(cur: _Cursor, prefix: str, tensors: bool) -> GGUFLayout:
    path = cur.path
    cur.need(4, "the GGUF magic")
    if cur.buf[:4] != b"GGUF":
        raise GGUFFormatError(
            f"{path}: starts with {bytes(cur.buf[:4])!r}, expected the GGUF magic b'GGUF'"
        )
    cur.pos = 4
    version = cur.scalar("<I", "the version")
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} is not supported; expected 2 or 3")
    n_tensors = cur.scalar("<Q", "the tensor count")
    n_kv = cur.scalar("<Q", "the metadata count")
    cur.need(
        13 * n_kv, f"{n_kv} metadata entries of 13 bytes or more"
    )  # key length, type, a 1-byte value
    if tensors:
        cur.need(13 * n_kv + 32 * n_tensors, f"{n_tensors} tensor entries of 32 bytes or more")
    meta: dict = {"GGUF.version": version}
    alignment = 32
    for k in range(n_kv):
        key = cur.string(f"metadata key #{k}").decode("utf-8", errors="replace")
        vtype = cur.scalar("<I", f"the type of metadata {key!r}")
        keep = key.startswith(prefix)
        v = cur.value(vtype, keep or key == "general.alignment", f"metadata {key!r}")
        if key == "general.alignment":
            if vtype != 4 or v <= 0 or v & (v - 1):
                raise GGUFFormatError(
                    f"{path}: general.alignment={v!r} (type {vtype}); expected a uint32 power of two"
                )
            alignment = v
        if keep:
            meta[key] = v
    infos: list[GGUFTensorInfo] = []
    if tensors:
        seen: set[str] = set()
        for t in range(n_tensors):
            name = cur.string(f"the name of tensor #{t}").decode("utf-8", errors="replace")
            n_dims = cur.scalar("<I", f"tensor {name!r}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise GGUFFormatError(
                    f"{path}: tensor {name!r} has {n_dims} dimensions; expected 1..{_MAX_DIMS}"
                )
            dims = tuple(cur.scalar("<Q", f"tensor {name!r}") for _ in range(n_dims))
            ggml_type = cur.scalar("<I", f"tensor {name!r}")
            offset = cur.scalar("<Q", f"tensor {name!r}")
            if name in seen:
                raise GGUFFormatError(
                    f"{path}: tensor {name!r} is listed twice in the tensor table"
                )
            seen.add(name)
            infos.append(GGUFTensorInfo(name, dims, ggml_type, offset))
    data_offset = -(-cur.pos // alignment) * alignment
    return GGUFLayout(meta, infos, alignment, data_offset, cur.size)


def read_gguf_metadata(path: str | os.PathLike, prefix: str = "") -> dict:
    """The key/value metadata of a GGUF file (see :func:`read_gguf_layout`), stopping before tensor info."""
    return read_gguf_layout(path, prefix, tensors=False).metadata


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Build a :class:`Tokenizer` from a GGUF file's metadata (no tensors are read).

    Sets ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` and ``chat_template`` (``None`` when
    absent). Control and user-defined tokens become special tokens.
    """
    try:
        meta = read_gguf_metadata(path, prefix="tokenizer.")
    except GGUFFormatError as e:
        raise TokenizerFileError(str(e)) from None

    def get(key: str, required: bool = True, kind: type | None = None):
        if key not in meta and required:
            raise TokenizerFileError(
                f"{path}: GGUF metadata lacks {key!r}; expected a byte-level BPE tokenizer"
            )
        v = meta.get(key)
        if v is not None and kind is list and not isinstance(v, list):
            raise TokenizerFileError(f"{path}: {key} is {type(v).__name__}; expected an array")
        if v is not None and kind is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise TokenizerFileError(f"{path}: {key}={v!r:.60}; expected an integer token id")
        return v

    model = get("tokenizer.ggml.model")
    if model != "gpt2":
        raise TokenizerFileError(
            f"{path}: tokenizer.ggml.model={model!r:.60} is not supported; expected 'gpt2' "
            "(byte-level BPE)"
        )
    tokens = get("tokenizer.ggml.tokens", kind=list)
    merge_lines = get("tokenizer.ggml.merges", kind=list)
    types = get("tokenizer.ggml.token_type", required=False, kind=list) or [TOKEN_NORMAL] * len(
        tokens
    )
    if len(types) != len(tokens):
        raise TokenizerFileError(
            f"{path}: {len(types)} token types for {len(tokens)} tokens; "
            "expected one type per token"
        )

    vocab: dict[int, bytes] = {}
    specials: list[str] = []
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if not isinstance(tok, str):
            raise TokenizerFileError(
                f"{path}: tokenizer.ggml.tokens[{i}] = {tok!r:.40}; expected a string"
            )
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            vocab[i] = tok.encode("utf-8")
            specials.append(tok)
        else:
            vocab[i] = printable_token(tok, path, f"tokenizer.ggml.tokens[{i}]")
    merges = []
    for n, line in enumerate(merge_lines):
        left, sep, right = line.partition(" ") if isinstance(line, str) else ("", "", "")
        if not sep:
            raise TokenizerFileError(
                f"{path}: merge #{n} {line!r:.60} is not two tokens separated by a space"
            )
        merges.append(
            (
                printable_token(left, path, f"merge #{n}"),
                printable_token(right, path, f"merge #{n}"),
            )
        )

    pre = get("tokenizer.ggml.pre", required=False) or "gpt2"
    if not isinstance(pre, str) or pre not in PATTERNS:
        raise TokenizerFileError(
            f"{path}: tokenizer.ggml.pre={pre!r:.60} is not supported; expected one of "
            f"{sorted(PATTERNS)}"
        )
    try:
        tok = Tokenizer(vocab, merges, special_tokens=specials, pattern=pre)
    except ValueError as e:
        raise TokenizerFileError(f"{path}: {e}") from None
    tok.bos_token_id = get("tokenizer.ggml.bos_token_id", required=False, kind=int)
    tok.eos_token_id = get("tokenizer.ggml.eos_token_id", required=False, kind=int)
    tok.pad_token_id = get("tokenizer.ggml.padding_token_id", required=False, kind=int)
    template = get("tokenizer.chat_template", required=False)
    tok.chat_template = template if isinstance(template, str) else None
    return tok
