"""GPT-2's reversible bytes <-> printable-unicode mapping (CS336 notes "分词器", "细节问答": bytes vs UTF-8).

GPT-2 stores byte-level tokens in ``vocab.json``/``merges.txt`` (and GGUF/HF ``tokenizer.json``
reuse the convention) as strings, not bytes: each of the 256 byte values is shown as one printable
character. Printable Latin-1 bytes stand for themselves; the other 68 (control characters, space,
0x7F-0xA0, 0xAD) are moved to U+0100 onwards, so a space becomes ``Ġ`` and a newline ``Ċ``.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """Byte value (0..255) -> the single character GPT-2 files use for it."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of :func:`bytes_to_unicode`."""
    return {c: b for b, c in bytes_to_unicode().items()}


def token_to_str(token: bytes) -> str:
    """Raw token bytes -> GPT-2 printable string (``b" the"`` -> ``"Ġthe"``)."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def str_to_token(text: str) -> bytes:
    """GPT-2 printable string -> raw token bytes; a character outside the table is an error."""
    table = unicode_to_bytes()
    try:
        return bytes(table[c] for c in text)
    except KeyError as e:
        raise ValueError(
            f"token {text!r} contains {e.args[0]!r}, which is not one of GPT-2's 256 byte characters"
        ) from None
