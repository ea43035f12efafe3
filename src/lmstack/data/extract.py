"""HTML -> plain text: decode the bytes, extract the visible (optionally only the main) text.

The reader leaves a WARC record's HTTP payload in ``doc.metadata["raw"]`` (bytes) with its
``doc.metadata["content_type"]`` and an empty text; :class:`Extract` turns it into text.

Decoding (never raises): bytes that decode as UTF-8 (and are not plain ASCII) are UTF-8, whatever the
header says (legacy 8-bit text almost never forms valid multi-byte UTF-8 sequences); else the charset named
in the Content-Type header if Python knows it and the bytes decode in it (before that, bytes that are mostly
UTF-8 with some Windows-1252 bytes — pages pasted together — are decoded as UTF-8 with cp1252 for the rest) (a header that does not fit the
bytes is ignored), else the
``<meta charset>`` of the page, else uchardet's guess (resiliparse's ``detect_encoding``), then
resiliparse's ``bytes_to_str`` with ``errors="replace"`` and UTF-8 / cp1252 fallbacks, so undecodable
bytes become U+FFFD instead of an exception.

Extraction: resiliparse's ``extract_plain_text`` (Bevendorff et al., "FastWARC/Resiliparse", 2021) with
formatting kept (one block per line) and, in main-content mode (the default), its heuristics that drop
navigation, menus, footers and sidebars; trafilatura (Barbaresi 2021) as the slower alternative engine.
"""

from __future__ import annotations

import codecs
import gc
import re
from collections.abc import Iterable, Iterator

from lmstack.data.document import Document
from lmstack.data.step import Mapper, StepStats

ENGINES = ("resiliparse", "trafilatura")
_HTML_TYPES = ("text/html", "application/xhtml", "text/xml", "application/xml", "text/plain")
_CHARSET = re.compile(r"charset\s*=\s*[\"']?([\w.:-]+)", re.IGNORECASE)
_LOOKS_HTML = re.compile(
    r"^\s*(?:<!doctype\s+html|<html|<head|<body|<\?xml|<!--|<div|<p[\s>])", re.IGNORECASE
)


def _known_codec(name: str | None) -> str | None:
    if not name:
        return None
    try:
        return codecs.lookup(name).name
    except LookupError:
        return None


def looks_binary(raw: bytes) -> bool:
    """True when the first 4 KiB hold a NUL byte or mostly control bytes (images, archives, PDFs)."""
    head = raw[:4096]
    if not head or head.startswith(
        (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
    ):  # UTF-16 text has NULs
        return False
    if b"\x00" in head:
        return True
    ctrl = sum(1 for b in head if b < 9 or 13 < b < 32)
    return ctrl > 0.1 * len(head)


# one UTF-8 multi-byte sequence (2, 3 or 4 bytes); legacy 8-bit text almost never forms one
_UTF8_SEQ = re.compile(
    rb"[\xc2-\xdf][\x80-\xbf]|[\xe0-\xef][\x80-\xbf]{2}|[\xf0-\xf4][\x80-\xbf]{3}"
)


def _cp1252_bytes(e: UnicodeDecodeError) -> tuple[str, int]:
    return e.object[e.start : e.end].decode("cp1252", errors="replace"), e.end


codecs.register_error("lmstack.cp1252", _cp1252_bytes)


def _mixed_utf8(raw: bytes) -> str | None:
    """Pages pasted together from UTF-8 and Windows-1252/Latin-1 parts: when the bytes hold at least as many
    valid UTF-8 multi-byte sequences as bytes outside them, UTF-8 where it decodes and cp1252 for the rest
    (so both parts read right); None for a page in one legacy encoding (left to the detection)."""
    valid = len(_UTF8_SEQ.findall(raw))
    if not valid:
        return None
    outside = sum(1 for b in _UTF8_SEQ.sub(b"", raw) if b >= 0x80)
    if outside > valid:
        return None
    return raw.decode("utf-8", errors="lmstack.cp1252").removeprefix("\ufeff")


def decode_html(raw: bytes, content_type: str | None = None) -> str:
    """Bytes of a web page -> str, never raising (see the module docstring for the order of guesses)."""
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode_html expects bytes, got {type(raw).__name__}")
    raw = bytes(raw)
    if not raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) and not raw.isascii():
        try:  # bytes that are valid UTF-8 and not ASCII are UTF-8 whatever a header claims
            return raw.decode("utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError:
            pass
        mixed = _mixed_utf8(raw)
        if mixed is not None:
            return mixed
    header = _CHARSET.search(content_type or "")
    encoding = _known_codec(header.group(1) if header else None)
    if encoding is not None:
        try:  # the header's charset, when the bytes are valid in it
            return raw.decode(encoding).removeprefix("\ufeff")
        except UnicodeDecodeError:  # a wrong header (cp1251 bytes sent as "utf-8"): detect instead
            encoding = None
    if encoding is None:
        encoding = _known_codec(detect_encoding(raw, from_html_meta=True)) or "utf-8"
    try:
        return bytes_to_str(raw, encoding, errors="replace")
    except (UnicodeError, LookupError):  # a codec that fails even with errors="replace"
        return raw.decode("utf-8", errors="replace")


_PARSER = None


def _trafilatura_tree(html: str):
    """The tree ``trafilatura.utils.load_html`` builds from a string (its repairs, its parser's options,
    its retry with bytes), parsed with lxml's C element-class lookup instead of ``lxml.html``'s Python
    one, which runs for every element proxy (~2 million calls on the benchmark's 296 pages). The
    elements are the same ``HtmlElement`` class, but ``<form>``/``<input>``/``<label>`` get no form
    subclasses, which trafilatura does not use. None where trafilatura would reject the page: then the
    string goes to trafilatura unchanged."""
    global _PARSER
    from lxml import etree
    from lxml import html as lxml_html
    from trafilatura.utils import is_dubious_html, repair_faulty_html

    if _PARSER is None:
        parser = lxml_html.HTMLParser(
            collect_ids=False,
            default_doctype=False,
            encoding="utf-8",
            remove_comments=True,
            remove_pis=True,
        )
        parser.set_element_class_lookup(
            etree.ElementDefaultClassLookup(
                element=lxml_html.HtmlElement,
                comment=lxml_html.HtmlComment,
                pi=lxml_html.HtmlProcessingInstruction,
                entity=lxml_html.HtmlEntity,
            )
        )
        _PARSER = parser
    beginning = html[:50].lower()
    html = repair_faulty_html(html, beginning)
    try:
        tree = lxml_html.fromstring(html, parser=_PARSER)
    except ValueError:  # a string with an XML encoding declaration: lxml wants bytes
        tree = None
    except Exception:  # noqa: BLE001
        return None
    if tree is None or len(tree) < 1:
        try:
            tree = lxml_html.fromstring(html.encode("utf8", "surrogatepass"), parser=_PARSER)
        except Exception:  # noqa: BLE001
            return None
    if tree is None or (is_dubious_html(beginning) and len(tree) < 2):
        return None
    return tree


def html_to_text(html: str, main_content: bool = True, engine: str = "resiliparse") -> str:
    """HTML string -> text, one block per line; '' when nothing can be extracted (never raises on bad HTML)."""
    if engine not in ENGINES:
        raise ValueError(f"extraction engine {engine!r} is not one of {ENGINES}")
    if not html or not html.strip():
        return ""
    if engine == "trafilatura":
        import trafilatura

        gc_was_on = gc.isenabled()
        gc.disable()  # trafilatura makes ~10^5 short-lived objects a page: no cycle scans meanwhile
        try:
            tree = _trafilatura_tree(html)
            out = trafilatura.extract(
                html if tree is None else tree,
                include_comments=False,
                include_tables=True,
                favor_precision=main_content,
                no_fallback=not main_content,
            )
        except Exception:  # noqa: BLE001  trafilatura raises a zoo of lxml errors on broken pages
            return ""
        finally:
            if gc_was_on:
                gc.enable()
        return (out or "").strip()
    from resiliparse.extract.html2text import extract_plain_text

    try:
        text = extract_plain_text(
            html,
            preserve_formatting=True,
            main_content=main_content,
            list_bullets=True,
            alt_texts=False,
            links=False,
            form_fields=False,
            noscript=False,
            comments=False,
        )
    except Exception:  # noqa: BLE001  resiliparse's HTMLParserException on pathological input
        return ""
    lines = (ln.rstrip() for ln in text.splitlines())  # keep the indentation of <pre> code
    return "\n".join(ln for ln in lines if ln.strip())


class Extract(Mapper):
    """``metadata["raw"]`` (bytes, a WARC payload) or HTML in ``doc.text`` -> extracted text.

    Keeps ``metadata["content_type"]``, removes ``metadata["raw"]`` (so the document stays JSON) and records
    ``metadata["encoding_replacements"]`` (U+FFFD characters the decoding produced). A record that is binary,
    not HTML/text, or extracts to nothing is dropped with reason ``extract_binary`` / ``extract_not_html`` /
    ``extract_empty`` (an extractor that yields empty documents would only hand them to the next filter).
    Counters: ``extracted``, ``decoded_with_replacements``. Bytes in: the text's plus the raw payload's (so
    the funnel shows the HTML bytes going in, not 0).
    """

    name = "extract"

    def __init__(
        self, engine: str = "resiliparse", main_content: bool = True, keep_raw: bool = False
    ):
        if engine not in ENGINES:
            raise ValueError(f"extraction engine {engine!r} is not one of {ENGINES}")
        self.engine, self.main_content, self.keep_raw = engine, main_content, keep_raw

    def _why_not(self, doc: Document) -> str | None:
        raw = doc.metadata.get("raw")
        ctype = (doc.metadata.get("content_type") or "").lower()
        if raw is None:
            return None if (doc.text or "").strip() else "extract_empty"
        if isinstance(raw, str):  # a reader that already decoded the payload
            return None
        if looks_binary(bytes(raw)):
            return "extract_binary"
        if ctype and not any(t in ctype for t in _HTML_TYPES):
            return "extract_not_html"
        return None

    def apply(self, doc: Document, stats: StepStats) -> Document:
        meta = dict(doc.metadata)
        raw = meta.get("raw") if self.keep_raw else meta.pop("raw", None)
        if isinstance(raw, str):
            html = raw
        elif raw is not None:
            html = decode_html(raw, meta.get("content_type"))
        elif _LOOKS_HTML.match(doc.text or ""):
            html = doc.text
        else:  # already plain text: nothing to extract
            return doc
        bad = html.count("\ufffd")
        if bad:
            meta["encoding_replacements"] = bad
            stats.counters["decoded_with_replacements"] += 1
        ctype = (meta.get("content_type") or "").lower()
        text = (
            html.strip()
            if "text/plain" in ctype
            else html_to_text(html, self.main_content, self.engine)
        )
        stats.counters["extracted"] += 1
        return Document(text, doc.id, meta)

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        for doc in docs:
            stats.seen(doc)
            raw = doc.metadata.get("raw")
            if isinstance(raw, (bytes, bytearray, memoryview)):  # the payload is this step's input
                stats.bytes_in += len(raw)
            why = self._why_not(doc)
            if why is None:
                doc = self.apply(doc, stats)
                why = None if doc.text.strip() else "extract_empty"
            if why is None:
                stats.kept(doc)
                yield doc
            else:
                doc.metadata.pop("raw", None)
                stats.drop(doc, why)


STEPS = {"extract": Extract}
