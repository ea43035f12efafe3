"""Pre-tokenization: special-token splitting and the regex that cuts text into pre-tokens.

CS336 notes "细节问答" (为什么要进行预分词): BPE never merges across pre-token boundaries, which keeps
training cheap (counts per distinct pre-token, not per corpus position) and stops tokens like
``dog!`` vs ``dog.`` from forming. Special tokens are cut out first, longest first, so no merge
crosses them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import regex

#: GPT-2's pattern (also HF ``ByteLevel(use_regex=True)``, tiktoken ``r50k_base``).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

#: GPT-4's pattern (tiktoken ``cl100k_base``): case-insensitive contractions, digits in groups of 1-3.
GPT4_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Llama-3's pattern (as GPT-4's, with the contractions written out per case).
LLAMA3_PATTERN = (
    r"""(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: SmolLM2 (GGUF ``tokenizer.ggml.pre = "smollm"``; HF ``Sequence[Digits(individual), ByteLevel]``):
#: every \p{N} character is its own pre-token, then the GPT-2 pattern runs on the text between
#: digits. Written as one regex: the digit alternative comes first, GPT-2's `` ?\p{N}+`` is gone,
#: and the end-of-piece lookahead ``(?!\S)`` becomes ``(?![^\s\p{N}])`` because a piece between
#: digits ends where the next digit starts.
SMOLLM_PATTERN = (
    r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
)

#: Names accepted wherever a pattern is expected, including GGUF ``tokenizer.ggml.pre`` values.
PATTERNS = {
    "gpt2": GPT2_PATTERN,
    "default": GPT2_PATTERN,
    "gpt4": GPT4_PATTERN,
    "cl100k": GPT4_PATTERN,
    "llama3": LLAMA3_PATTERN,
    "llama-bpe": LLAMA3_PATTERN,
    "smollm": SMOLLM_PATTERN,
}


def resolve_pattern(pattern: str | None) -> str:
    """A pattern name from :data:`PATTERNS` or a literal regex -> the regex (``None`` -> GPT-2)."""
    if pattern is None:
        return GPT2_PATTERN
    if pattern in PATTERNS:
        return PATTERNS[pattern]
    try:
        regex.compile(pattern)
    except regex.error as e:
        raise ValueError(
            f"pattern {pattern!r} is neither a known name ({', '.join(sorted(PATTERNS))}) "
            f"nor a valid regex: {e}"
        ) from None
    return pattern


#: Text with every kind of character a corpus holds (letters, digits, punctuation, spaces, tabs, newlines,
#: accents, CJK, emoji, control characters): a pre-tokenizer's pieces must put it back together.
COVERAGE_PROBE = "Hello, World! It's 2024:\n\tnaïve café — 日本語 😀  x_y=1.5e3\r\n\x00\x1f end "


def resolve_training_pattern(pattern: str | None) -> str:
    """:func:`resolve_pattern`, refusing a pattern whose pieces do not cover the text (e.g. ``''``):
    BPE only sees the pieces, so such a pattern would train a tokenizer that drops what it misses."""
    resolved = resolve_pattern(pattern)
    pieces = regex.findall(resolved, COVERAGE_PROBE)
    if "".join(pieces) != COVERAGE_PROBE:
        covered = sum(map(len, pieces))
        raise ValueError(
            f"pattern {pattern!r} does not cover the text: its pieces of {COVERAGE_PROBE!r} hold {covered} of "
            f"{len(COVERAGE_PROBE)} characters; a pre-tokenizer must match every character "
            f"(use one of {', '.join(sorted(PATTERNS))})"
        )
    return resolved


def special_splitter(special_tokens: Iterable[str]) -> regex.Pattern | None:
    """A regex whose ``split`` cuts text around special tokens, keeping them (longest first)."""
    specials = sorted(set(special_tokens), key=lambda s: (-len(s), s))
    if not specials:
        return None
    if any(not s for s in specials):
        raise ValueError("special tokens must be non-empty strings, got ''")
    return regex.compile("(" + "|".join(regex.escape(s) for s in specials) + ")")


#: ASCII whitespace exactly as the ``regex`` module's ``\s`` sees it (not \x1c-\x1f, unlike ``re``).
_ASCII_SPACE = r"\t\n\x0b\x0c\r "


def ascii_variant(pattern: str) -> str | None:
    """The same pre-tokenizer for pure-ASCII text, written for the stdlib ``re`` module (about 2x faster).

    On ASCII input ``\\p{L}`` is ``[A-Za-z]``, ``\\p{N}`` is ``[0-9]`` and ``\\s`` is the six ASCII
    whitespace characters, so the translation is exact there. Only the built-in patterns are
    translated (tests compare both on arbitrary ASCII); others return ``None`` (no fast path).
    """
    if pattern not in PATTERNS.values():
        return None
    out = []
    in_class = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            tok = (
                pattern[i : i + 5]
                if pattern.startswith(("\\p{L}", "\\p{N}"), i)
                else pattern[i : i + 2]
            )
            inner = {"\\p{L}": "A-Za-z", "\\p{N}": "0-9", "\\s": _ASCII_SPACE}.get(tok)
            if inner is not None:
                out.append(inner if in_class else f"[{inner}]")
            elif tok == "\\S":
                out.append(
                    f"[^{_ASCII_SPACE}]"
                )  # never used inside a class by the built-in patterns
            else:
                out.append(tok)
            i += len(tok)
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
#: " <ASCII letter>" always begins a pre-token under every built-in pattern, whatever precedes it
#: (a whitespace run before it gives up its last character), so text may be cut there.
_SAFE_CUT = re.compile(r" (?=[A-Za-z])")


class PreTokenizer:
    """Splits special-token-free text into pre-tokens with ``pattern``.

    For the built-in patterns, ASCII stretches go through the exact stdlib-``re`` variant
    (:func:`ascii_variant`) and only the stretches around non-ASCII characters, widened to safe cut
    points, go through the ``regex`` module; the pieces are identical to ``regex.findall(pattern, text)``.
    """

    def __init__(self, pattern: str | None = None) -> None:
        self.pattern = resolve_pattern(pattern)
        self._full = regex.compile(self.pattern)
        fast = ascii_variant(self.pattern)
        self._fast = re.compile(fast) if fast is not None else None

    def __reduce__(self):
        return (PreTokenizer, (self.pattern,))

    def finditer(self, text: str):
        return self._full.finditer(text)

    def split(self, text: str) -> list[str]:
        fast = self._fast
        if fast is None:
            return self._full.findall(text)
        if text.isascii():
            return fast.findall(text)
        pieces: list[str] = []
        pos = 0  # text[:pos] is done; pos is always 0 or a safe cut
        n = len(text)
        for m in _NON_ASCII.finditer(text):
            if m.start() < pos:
                continue
            # widen [m.start(), m.end()) to safe cuts: the last one at or before the start ...
            lo = m.start()
            while lo > pos:
                lo = text.rfind(" ", pos, lo)
                if lo < 0:
                    lo = pos
                    break
                if text[lo + 1 : lo + 2].isascii() and text[lo + 1 : lo + 2].isalpha():
                    break
            # ... and the first one after the end
            cut = _SAFE_CUT.search(text, m.end())
            hi = cut.start() if cut is not None else n
            if lo > pos:
                pieces += fast.findall(text, pos, lo)
            pieces += self._full.findall(text, lo, hi)
            pos = hi
            if pos >= n:
                break
        if pos < n:
            pieces += fast.findall(text, pos)
        return pieces
