"""Routing technical documents past the web-prose rules, and the rules they get instead.

The Gopher, C4 and FineWeb rules were written for web prose: on documentation with code, command lines and
API listings they fire on the code, not on the quality (punctuation split off as words sinks Gopher's
alphabetic-word ratio; a ``{`` ends a page for C4). Pipelines that want such text route it: The Pile and
Dolma keep code and technical sources in their own pipelines, RedPajama-v2 and FineWeb-Edu score pages with
classifiers instead of prose heuristics. Here one rule tags the route and every filter can be limited to
routes (the pipeline key ``routes``, :class:`~lmstack.data.step.Filter`):

- :class:`CodeRouter` (``code_router``): ``metadata["route"] = "code"`` for a document that is *code with
  explanation* — at least ``min_code_lines`` lines and ``min_code_frac`` of its lines look like code, and at
  least ``min_prose_lines`` lines are prose sentences — else ``"prose"``. A page of code with no prose
  (script text shown as text, a symbol index) stays on the prose route, where the prose rules drop it.
- :class:`CodeQuality` (``code_quality``): the rules the code route gets, after StarCoder's data filters
  (Li et al. 2023, "StarCoder", 3.x: a maximum line length of 1000 characters, an alphanumeric fraction of
  at least 0.25) and Gopher's document length (50-100,000 words, here whitespace words).

A line looks like code when it is indented (``<pre>`` blocks keep their indentation through extraction),
when ``>= 0.1`` of its non-space characters are code symbols, or when it holds a code token: a call
``name(``, ``::``, ``->``, ``=>``, ``==``, ``!=``, ``&&``, ``||``, an option ``--flag``, a tag ``<tag>``, a
``snake_case`` or ``camelCase`` identifier, a path ``a/b/``, a trailing ``{ } ;``, or a prompt ``$ ``.
A prose line has at least 8 words and ends in ``. ? ! :``.
"""

from __future__ import annotations

import re

from lmstack.data.document import Document
from lmstack.data.step import Filter, Mapper, StepStats

_SYMBOLS = frozenset("{}[]()<>=;:$#_/\\|*&%~^+@`")
_CODE_TOKEN = re.compile(
    r"\w\(|::|->|=>|==|!=|&&|\|\||(?:^|\s)--?\w|</?\w+[ >]|\b[a-z]+_[a-z_]+\b|\b[a-z]+[A-Z]\w*\b"
    r"|\w/\w+/|[{};]\s*$|^\s*[$#>] "
)


def line_kinds(text: str) -> tuple[int, int, int]:
    """(non-blank lines, code-like lines, prose lines) of ``text`` (the module docstring's definitions)."""
    lines = code = prose = 0
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        lines += 1
        chars = len(s) - s.count(" ")
        if (
            line.startswith(("  ", "\t"))
            or sum(c in _SYMBOLS for c in s) >= 0.1 * chars
            or _CODE_TOKEN.search(line)
        ):
            code += 1
        elif len(s.split()) >= 8 and s[-1] in ".?!:":
            prose += 1
    return lines, code, prose


class CodeRouter(Mapper):
    """Sets ``metadata["route"]`` to ``"code"`` (technical documents: code with explanation) or
    ``"prose"``, and ``metadata["code_line_frac"]``. Counters ``route_code``, ``route_prose``."""

    name = "code_router"

    def __init__(
        self, min_code_lines: int = 5, min_code_frac: float = 0.2, min_prose_lines: int = 3
    ):
        if min_code_lines < 1 or min_prose_lines < 0 or not 0.0 <= min_code_frac <= 1.0:
            raise ValueError(
                f"code_router: min_code_lines={min_code_lines!r} (>= 1), min_code_frac={min_code_frac!r} "
                f"(in [0, 1]), min_prose_lines={min_prose_lines!r} (>= 0)"
            )
        self.min_code_lines, self.min_code_frac = min_code_lines, min_code_frac
        self.min_prose_lines = min_prose_lines

    def route(self, text: str) -> tuple[str, float]:
        lines, code, prose = line_kinds(text)
        frac = code / lines if lines else 0.0
        technical = (
            code >= self.min_code_lines
            and frac >= self.min_code_frac
            and prose >= self.min_prose_lines
        )
        return ("code" if technical else "prose"), frac

    def apply(self, doc: Document, stats: StepStats) -> Document:
        route, frac = self.route(doc.text)
        doc.metadata["route"], doc.metadata["code_line_frac"] = route, round(frac, 4)
        stats.counters[f"route_{route}"] += 1
        return doc


class CodeQuality(Filter):
    """The code route's rules (module docstring); reasons ``code_short_doc``, ``code_long_doc``,
    ``code_long_line``, ``code_below_alnum_threshold``."""

    name = "code_quality"

    def __init__(
        self,
        min_words: int = 50,
        max_words: int = 100_000,
        max_line_chars: int = 1000,
        min_alnum_frac: float = 0.25,
    ):
        self.min_words, self.max_words = min_words, max_words
        self.max_line_chars, self.min_alnum_frac = max_line_chars, min_alnum_frac

    def reason(self, doc: Document) -> str | None:
        text = doc.text
        words = len(text.split())
        if words < self.min_words:
            return "code_short_doc"
        if words > self.max_words:
            return "code_long_doc"
        if max((len(ln) for ln in text.splitlines()), default=0) > self.max_line_chars:
            return "code_long_line"
        if sum(c.isalnum() for c in text) < self.min_alnum_frac * len(text):
            return "code_below_alnum_threshold"
        return None


STEPS = {"code_router": CodeRouter, "code_quality": CodeQuality}
