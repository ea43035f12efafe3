"""Heuristic quality filters: Gopher quality and repetition, C4, FineWeb — each a :class:`Filter` with named thresholds.

Sources (the thresholds are theirs; the counting conventions are datatrove's, so the same thresholds keep the
same documents — tests/data/test_data_quality.py runs datatrove's filters beside these as the reference):

- Gopher quality and repetition: Rae et al. 2021, "Scaling Language Models: Methods, Analysis & Insights from
  Training Gopher", appendix A.1.1 and table A1.
- C4: Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer",
  section 2.2 (and the TFDS c4_utils it points to: policy lines, 1000-character words, citation marks).
- FineWeb: Penedo et al. 2024, "The FineWeb Datasets: Decanting the Web for the Finest Text Data at Scale",
  section 3.5 (line punctuation, duplicated-line characters, short lines) plus datatrove's list ratio.

Words come from :func:`split_words`, a regular-expression tokenizer shaped like the rule-based English
tokenizer datatrove calls (spaCy's): punctuation is split off words and counts as a word of its own, so
"Hello, world." is four words of which two are alphabetic. It is one ``findall``, not a tokenizer pipeline.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import regex

from lmstack.data.document import Document
from lmstack.data.step import Filter, check_number

_HAS_NON_SYMBOL = regex.compile(
    r"[^\p{P}\p{S}\p{C}\p{Z}]"
)  # a word that is not all punctuation/symbols
_HAS_ALPHA = regex.compile(r"\p{L}")
TERMINAL_PUNCTUATION = tuple(
    regex.findall(r"\p{Sentence_Terminal}", "".join(map(chr, range(0x30000))))
)
STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")  # Gopher's list

# The rule-based tokenizer's shape: split on white space; peel punctuation off the front and the back of each
# chunk; split the rest at infixes (hyphens, '/', ':', ',' between letters, '...'). Abbreviations with inner
# periods ("e.g.", "U.S.") keep their final period; "n't" and "'s"-style clitics become words of their own.
_OPEN = "([{<\"'“‘«「『（〔【《〈`´‚„$£€¥#*&_§%=+—–…,:;!?¿¡。？！，、；：～·"
_CLOSE = ")]}>\"'”’»」』）〕】》〉`´…,:;!?。？！，、；：～·%*&#_—–"
_PREFIX = regex.compile(rf"(?:\.\.+|[{regex.escape(_OPEN)}]|\p{{So}})")
_SUFFIX = regex.compile(
    rf"(?:\.\.+|[{regex.escape(_CLOSE)}]|\p{{So}}|['’][sSdDmM]|['’](?:ll|re|ve|LL|RE|VE)|n['’]t|N['’]T"
    r"|(?<=[\p{Ll}\d\p{P}]|\p{Lu}\p{Lu})\.)\Z"
)
_INFIX = regex.compile(
    r"\.\.+|…|(?<=\d)[+\-*^](?=[\d-])|(?<=[\p{L}\d])[:<>=/](?=\p{L})|(?<=\p{L}),(?=\p{L})"
    r"|(?<=[\p{L}\d])(?:---|--|——|-|–|—|~)(?=\p{L})"
)
_ABBREV = regex.compile(
    r"(?:\p{L}\.){2,}|(?:Mr|Mrs|Ms|Dr|St|Mt|Jr|Sr|vs|etc|Inc|Ltd|Co|Prof|No|Jan|Feb|Mar|Apr|Jun|"
    r"Jul|Aug|Sep|Sept|Oct|Nov|Dec)\.|\p{L}\.",
    regex.I,
)
_URL = regex.compile(r"(?:https?://|www\.)\S+|[\w.+-]+@[\w-]+(?:\.[\w-]+)+")


def _chunk_words(chunk: str, out: list[str]) -> None:
    tail: list[str] = []
    while chunk:
        if _ABBREV.fullmatch(chunk) or _URL.fullmatch(chunk):
            break
        m = _PREFIX.match(chunk)
        if m and m.end() < len(chunk) + 1 and m.group(0):
            out.append(m.group(0))
            chunk = chunk[m.end() :]
            continue
        m = _SUFFIX.search(chunk)
        if m and m.start() > 0:
            tail.append(m.group(0))
            chunk = chunk[: m.start()]
            continue
        break
    if chunk:
        if _ABBREV.fullmatch(chunk) or _URL.fullmatch(chunk):
            out.append(chunk)
        else:
            start = 0
            for m in _INFIX.finditer(chunk):
                if m.start() > start:
                    out.append(chunk[start : m.start()])
                if m.group(0):
                    out.append(m.group(0))
                start = m.end()
            if start < len(chunk):
                out.append(chunk[start:])
    out.extend(reversed(tail))


def split_words(text: str) -> list[str]:
    """Words and punctuation marks of ``text`` (see the module docstring)."""
    out: list[str] = []
    for chunk in text.split():
        if chunk.isalnum():  # the common case: a plain word or number
            out.append(chunk)
        else:
            _chunk_words(chunk, out)
    return out


# ---------------------------------------------------------------------------------------------- Gopher quality
class GopherQuality(Filter):
    """Gopher's quality rules (Rae et al. 2021, A.1.1). ``None`` disables a rule.

    - ``min_doc_words``/``max_doc_words`` (50 / 100,000): non-symbol words -> ``gopher_short_doc`` / ``gopher_long_doc``
    - ``min_avg_word_length``/``max_avg_word_length`` (3 / 10 characters, non-symbol words) ->
      ``gopher_below_avg_threshold`` / ``gopher_above_avg_threshold``
    - ``max_symbol_word_ratio`` (0.1): '#' per word, and '...' or '…' per word -> ``gopher_too_many_hashes`` /
      ``gopher_too_many_ellipsis``
    - ``max_bullet_lines_ratio`` (0.9): lines starting with '•' or '-' -> ``gopher_too_many_bullets``
    - ``max_ellipsis_lines_ratio`` (0.3): lines ending in '...' or '…' -> ``gopher_too_many_end_ellipsis``
    - ``min_alpha_words_ratio`` (0.8): words with an alphabetic character -> ``gopher_below_alpha_threshold``
    - ``min_stop_words`` (2) distinct words of ``stop_words`` -> ``gopher_enough_stop_words`` (datatrove's name);
      case-insensitive by default as the paper means it (datatrove compares case-sensitively:
      ``stop_words_case_sensitive=True`` does the same).
    """

    name = "gopher_quality"

    def __init__(
        self,
        min_doc_words: int | None = 50,
        max_doc_words: int | None = 100_000,
        min_avg_word_length: float | None = 3,
        max_avg_word_length: float | None = 10,
        max_symbol_word_ratio: float | None = 0.1,
        max_bullet_lines_ratio: float | None = 0.9,
        max_ellipsis_lines_ratio: float | None = 0.3,
        min_alpha_words_ratio: float | None = 0.8,
        min_stop_words: int | None = 2,
        stop_words: Iterable[str] = STOP_WORDS,
        stop_words_case_sensitive: bool = False,
    ):
        for key in ("min_doc_words", "max_doc_words", "min_stop_words"):
            check_number(self.name, key, locals()[key], integer=True)
        for key in ("min_avg_word_length", "max_avg_word_length"):
            check_number(self.name, key, locals()[key])
        for key in (
            "max_symbol_word_ratio",
            "max_bullet_lines_ratio",
            "max_ellipsis_lines_ratio",
            "min_alpha_words_ratio",
        ):
            check_number(self.name, key, locals()[key], hi=1.0)
        self.min_doc_words, self.max_doc_words = min_doc_words, max_doc_words
        self.min_avg_word_length, self.max_avg_word_length = (
            min_avg_word_length,
            max_avg_word_length,
        )
        self.max_symbol_word_ratio = max_symbol_word_ratio
        self.max_bullet_lines_ratio, self.max_ellipsis_lines_ratio = (
            max_bullet_lines_ratio,
            max_ellipsis_lines_ratio,
        )
        self.min_alpha_words_ratio, self.min_stop_words = min_alpha_words_ratio, min_stop_words
        self.case_sensitive = stop_words_case_sensitive
        self.stop_words = frozenset(
            w if stop_words_case_sensitive else w.lower() for w in stop_words
        )

    def reason(self, doc: Document) -> str | None:
        text = doc.text
        words = split_words(text)
        content = [w for w in words if _HAS_NON_SYMBOL.search(w)]
        if self.min_doc_words is not None and len(content) < self.min_doc_words:
            return "gopher_short_doc"
        if self.max_doc_words is not None and len(content) > self.max_doc_words:
            return "gopher_long_doc"
        if not words:  # every rule below divides by the word count
            return "gopher_short_doc"
        if content:
            mean_len = sum(map(len, content)) / len(content)
            if self.min_avg_word_length is not None and mean_len < self.min_avg_word_length:
                return "gopher_below_avg_threshold"
            if self.max_avg_word_length is not None and mean_len > self.max_avg_word_length:
                return "gopher_above_avg_threshold"
        n = len(words)
        if self.max_symbol_word_ratio is not None:
            if text.count("#") / n > self.max_symbol_word_ratio:
                return "gopher_too_many_hashes"
            if (text.count("...") + text.count("…")) / n > self.max_symbol_word_ratio:
                return "gopher_too_many_ellipsis"
        lines = text.splitlines() or [""]
        if self.max_bullet_lines_ratio is not None:
            bullets = sum(ln.lstrip().startswith(("•", "-")) for ln in lines)
            if bullets / len(lines) > self.max_bullet_lines_ratio:
                return "gopher_too_many_bullets"
        if self.max_ellipsis_lines_ratio is not None:
            ends = sum(ln.rstrip().endswith(("...", "…")) for ln in lines)
            if ends / len(lines) > self.max_ellipsis_lines_ratio:
                return "gopher_too_many_end_ellipsis"
        if (
            self.min_alpha_words_ratio is not None
            and sum(1 for w in words if _HAS_ALPHA.search(w)) / n < self.min_alpha_words_ratio
        ):
            return "gopher_below_alpha_threshold"
        if self.min_stop_words is not None:
            seen = set(words) if self.case_sensitive else {w.lower() for w in words}
            if len(self.stop_words & seen) < self.min_stop_words:
                return "gopher_enough_stop_words"
        return None


# ------------------------------------------------------------------------------------------- Gopher repetition
def duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items equal to an earlier item, their total characters): every repeat counts, the first does not."""
    seen: set[str] = set()
    n = chars = 0
    for it in items:
        if it in seen:
            n += 1
            chars += len(it)
        else:
            seen.add(it)
    return n, chars


def top_ngram_chars(words: list[str], n: int) -> int:
    """Characters of the most frequent n-gram (words joined by one space) times its count; ties: first seen."""
    grams = Counter(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))
    if not grams:
        return 0
    gram, count = grams.most_common(1)[0]
    return len(gram) * count


def duplicated_ngram_chars(words: list[str], n: int) -> int:
    """Characters (without spaces) in repeated n-grams, scanning left to right and jumping past each repeat.

    An n-gram already seen counts its characters once and the scan moves n words on, so overlapping repeats
    are not counted twice (datatrove's convention for Gopher's "duplicate n-gram character fraction").
    """
    seen: set[str] = set()
    chars, i, last = 0, 0, len(words) - n
    while i <= last:
        gram = "".join(words[i : i + n])
        if gram in seen:
            chars += len(gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


_PARAGRAPHS = re.compile(r"\n{2,}")
_LINES = re.compile(r"\n+")
GOPHER_TOP_NGRAMS = ((2, 0.20), (3, 0.18), (4, 0.16))
GOPHER_DUP_NGRAMS = ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10))


class GopherRepetition(Filter):
    """Gopher's repetition rules (Rae et al. 2021, table A1); fractions are of the document's characters.

    ``dup_para_frac`` 0.3 / ``dup_para_char_frac`` 0.2 (paragraphs split on blank lines) -> ``dup_para_frac`` /
    ``dup_para_char_frac``; ``dup_line_frac`` 0.3 / ``dup_line_char_frac`` 0.2 -> ``dup_line_frac`` /
    ``dup_line_char_frac``; ``top_n_grams`` ((2, 0.2), (3, 0.18), (4, 0.16)) -> ``top_{n}_gram``;
    ``dup_n_grams`` ((5, 0.15) ... (10, 0.10)) -> ``duplicated_{n}_n_grams``; an empty text -> ``empty``.
    """

    name = "gopher_repetition"

    def __init__(
        self,
        dup_line_frac: float | None = 0.3,
        dup_para_frac: float | None = 0.3,
        dup_line_char_frac: float | None = 0.2,
        dup_para_char_frac: float | None = 0.2,
        top_n_grams: Iterable[tuple[int, float]] = GOPHER_TOP_NGRAMS,
        dup_n_grams: Iterable[tuple[int, float]] = GOPHER_DUP_NGRAMS,
    ):
        for key in ("dup_line_frac", "dup_para_frac", "dup_line_char_frac", "dup_para_char_frac"):
            check_number(self.name, key, locals()[key], hi=1.0)
        top_n_grams, dup_n_grams = tuple(top_n_grams), tuple(dup_n_grams)
        for key, pairs in (("top_n_grams", top_n_grams), ("dup_n_grams", dup_n_grams)):
            if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
                raise ValueError(
                    f"{self.name}: {key}={pairs!r} must be a list of [n, fraction] pairs"
                )
            for n, frac in pairs:
                check_number(self.name, f"{key} n", n, lo=1, integer=True)
                check_number(self.name, f"{key}[n={n}] fraction", frac, hi=1.0)
        self.dup_line_frac, self.dup_para_frac = dup_line_frac, dup_para_frac
        self.dup_line_char_frac, self.dup_para_char_frac = dup_line_char_frac, dup_para_char_frac
        self.top_n_grams, self.dup_n_grams = tuple(top_n_grams), tuple(dup_n_grams)

    def reason(self, doc: Document) -> str | None:
        text = doc.text
        if not text:
            return "empty"
        size = len(text)
        paras = _PARAGRAPHS.split(text.strip())
        n, chars = duplicates(paras)
        if self.dup_para_frac is not None and n / len(paras) > self.dup_para_frac:
            return "dup_para_frac"
        if self.dup_para_char_frac is not None and chars / size > self.dup_para_char_frac:
            return "dup_para_char_frac"
        lines = _LINES.split(text)
        n, chars = duplicates(lines)
        if self.dup_line_frac is not None and n / len(lines) > self.dup_line_frac:
            return "dup_line_frac"
        if self.dup_line_char_frac is not None and chars / size > self.dup_line_char_frac:
            return "dup_line_char_frac"
        words = split_words(text)
        for n_, frac in self.top_n_grams:
            if top_ngram_chars(words, n_) / size > frac:
                return f"top_{n_}_gram"
        for n_, frac in self.dup_n_grams:
            if duplicated_ngram_chars(words, n_) / size > frac:
                return f"duplicated_{n_}_n_grams"
        return None


# -------------------------------------------------------------------------------------------------------- C4
C4_END_PUNCTUATION = (".", "?", "!", '"', "'")
C4_POLICY = (
    "terms of use",
    "privacy policy",
    "cookie policy",
    "uses cookies",
    "use of cookies",
    "use cookies",
)
_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
# A sentence ends at a run of . ! ? (with closing quotes/brackets) before a space or the end, except after a
# one-letter initial or a common abbreviation ("Dr.", "e.g."), which rule-based sentence splitters keep whole.
_SENT_END = regex.compile(
    r"(?<!\b(?:\p{L}|[Dd]r|Mr|Mrs|Ms|St|vs|etc|e\.g|i\.e|Prof|Inc|Jr|Sr|No))"
    r"[.!?\p{Sentence_Terminal}]+[\"'”’)\]]*(?=\s|$)"
)


def count_sentences(line: str) -> int:
    """Sentences in one line: sentence ends (see ``_SENT_END``), plus one for trailing text without an end."""
    line = line.strip()
    if not line:
        return 0
    ends = list(_SENT_END.finditer(line))
    return len(ends) + (0 if ends and ends[-1].end() == len(line) else 1)


class C4Quality(Filter):
    """C4's page cleaning (Raffel et al. 2020, 2.2). Keeps the page's good lines and drops the page when too few remain.

    Per line: words longer than ``max_word_length`` (1000) drop the line; ``[1]``/``[edit]`` citation marks are
    removed; a line must end in terminal punctuation (``.?!"'``, not '...'), have ``min_words_per_line`` (3)
    words, not mention javascript, not be a cookie/terms-of-use line. Per page: "lorem ipsum" -> ``lorem_ipsum``,
    a '{' -> ``curly_bracket``, fewer than ``min_num_sentences`` (5) sentences in the kept lines ->
    ``too_few_sentences``. A kept page's text becomes its kept lines (C4 rewrites pages; reason() does it).
    """

    name = "c4_quality"

    def __init__(
        self,
        filter_no_terminal_punct: bool = True,
        min_num_sentences: int | None = 5,
        min_words_per_line: int | None = 3,
        max_word_length: int | None = 1000,
        filter_lorem_ipsum: bool = True,
        filter_javascript: bool = True,
        filter_curly_bracket: bool = True,
        filter_policy: bool = True,
        remove_citations: bool = True,
    ):
        for key in ("min_num_sentences", "min_words_per_line", "max_word_length"):
            check_number(self.name, key, locals()[key], integer=True)
        self.filter_no_terminal_punct, self.min_num_sentences = (
            filter_no_terminal_punct,
            min_num_sentences,
        )
        self.min_words_per_line, self.max_word_length = min_words_per_line, max_word_length
        self.filter_lorem_ipsum, self.filter_javascript = filter_lorem_ipsum, filter_javascript
        self.filter_curly_bracket, self.filter_policy = filter_curly_bracket, filter_policy
        self.remove_citations = remove_citations

    def reason(self, doc: Document) -> str | None:
        kept, sentences = [], 0
        for line in doc.text.splitlines():
            line = line.strip()
            words = line.split()
            if self.max_word_length is not None and any(
                len(w) > self.max_word_length for w in words
            ):
                continue
            if self.remove_citations:
                line = _CITATION.sub("", line)
            if self.filter_no_terminal_punct and (
                not line.endswith(C4_END_PUNCTUATION) or line.endswith("...")
            ):
                continue
            if self.min_words_per_line is not None and len(words) < self.min_words_per_line:
                continue
            low = line.lower()
            if self.filter_lorem_ipsum and "lorem ipsum" in low:
                return "lorem_ipsum"
            if self.filter_javascript and "javascript" in low:
                continue
            if self.filter_curly_bracket and "{" in line:
                return "curly_bracket"
            if self.filter_policy and any(p in low for p in C4_POLICY):
                continue
            sentences += count_sentences(line)
            kept.append(line)
        if self.min_num_sentences is not None and sentences < self.min_num_sentences:
            return "too_few_sentences"
        doc.text = "\n".join(kept).strip()
        return None


class C4BadWords(Filter):
    """Drops a page containing any word of a bad-words list (C4 used LDNOOBW's; none ships with lmstack, so
    the caller gives ``words`` or a ``path`` with one per line) -> ``document_removed_with_badwords``.
    Matches whole words, case-insensitively."""

    name = "c4_badwords"

    def __init__(self, words: Iterable[str] | None = None, path: str | Path | None = None):
        vocab = set(words or ())
        if path is not None:
            vocab |= {
                ln.strip()
                for ln in Path(path).read_text(encoding="utf-8").splitlines()
                if ln.strip()
            }
        if not vocab:
            raise ValueError("C4BadWords needs a non-empty bad-words list (words=... or path=...)")
        alts = "|".join(re.escape(w.lower()) for w in sorted(vocab, key=len, reverse=True))
        self._re = re.compile(rf"(?:\W|^)(?:{alts})(?:\W|$)")

    def reason(self, doc: Document) -> str | None:
        return "document_removed_with_badwords" if self._re.search(doc.text.lower()) else None


# ---------------------------------------------------------------------------------------------------- FineWeb
class FineWebQuality(Filter):
    """FineWeb's rules (Penedo et al. 2024, 3.5) over the non-blank lines:

    - ``line_punct_thr`` 0.12: fraction of lines ending in terminal punctuation (Unicode Sentence_Terminal) must
      be at least this -> ``line_punct_ratio`` (``line_punct_exclude_zero`` exempts documents with none at all)
    - ``short_line_thr`` 0.67: fraction of lines of at most ``short_line_length`` (30) characters -> ``short_line_ratio``
    - ``char_duplicates_ratio`` 0.1 (the paper's; datatrove's class defaults to 0.01): characters in repeated
      lines over the characters that are not newlines -> ``char_dup_ratio``
    - ``new_line_ratio`` 0.3: newlines per word (datatrove's list filter) -> ``list_ratio``; no lines -> ``empty``
    """

    name = "fineweb_quality"

    def __init__(
        self,
        line_punct_thr: float | None = 0.12,
        line_punct_exclude_zero: bool = False,
        short_line_thr: float | None = 0.67,
        short_line_length: int = 30,
        char_duplicates_ratio: float | None = 0.1,
        new_line_ratio: float | None = 0.3,
        stop_chars: tuple[str, ...] = TERMINAL_PUNCTUATION,
    ):
        for key in ("line_punct_thr", "short_line_thr", "char_duplicates_ratio"):
            check_number(self.name, key, locals()[key], hi=1.0)
        check_number(self.name, "new_line_ratio", new_line_ratio)  # newlines per word: may exceed 1
        check_number(self.name, "short_line_length", short_line_length, integer=True)
        self.line_punct_thr, self.line_punct_exclude_zero = line_punct_thr, line_punct_exclude_zero
        self.short_line_thr, self.short_line_length = short_line_thr, short_line_length
        self.char_duplicates_ratio, self.new_line_ratio = char_duplicates_ratio, new_line_ratio
        self.stop_chars = tuple(stop_chars)

    def reason(self, doc: Document) -> str | None:
        text = doc.text
        lines = [ln for ln in text.split("\n") if ln.strip()]
        if not lines:
            return "empty"
        if self.line_punct_thr is not None:
            ratio = sum(1 for ln in lines if ln.endswith(self.stop_chars)) / len(lines)
            if ratio < self.line_punct_thr and not (ratio == 0 and self.line_punct_exclude_zero):
                return "line_punct_ratio"
        short = sum(1 for ln in lines if len(ln) <= self.short_line_length) / len(lines)
        if self.short_line_thr is not None and short > self.short_line_thr:
            return "short_line_ratio"
        if (
            self.char_duplicates_ratio is not None
            and duplicates(lines)[1] / (len(text) - text.count("\n")) > self.char_duplicates_ratio
        ):
            return "char_dup_ratio"
        if self.new_line_ratio is not None:
            n_words = len(split_words(text))
            if n_words == 0 or text.count("\n") / n_words > self.new_line_ratio:
                return "list_ratio"
        return None


STEPS = {
    "gopher_quality": GopherQuality,
    "gopher_repetition": GopherRepetition,
    "c4_quality": C4Quality,
    "c4_badwords": C4BadWords,
    "fineweb_quality": FineWebQuality,
}
