"""HTML extraction: real HTML against hand-checked text, boilerplate out in main-content mode, encodings
detected from the bytes, undecodable and binary input never crashing."""

import os
from pathlib import Path

import pytest

pytest.importorskip("resiliparse")

from lmstack.data.document import Document
from lmstack.data.extract import Extract, decode_html, html_to_text
from lmstack.data.step import StepStats

FIXTURE = (
    Path(__file__).parent / "fixtures" / "libffi_simple_example.html"
)  # libffi's manual (MIT), as Debian ships it


def test_real_html_matches_hand_checked_text():
    text = html_to_text(decode_html(FIXTURE.read_bytes()))
    lines = text.splitlines()
    # checked by reading the page in a browser: heading, the sentence, the code with its indentation
    assert "2.2 Simple Example" in lines
    assert "Here is a trivial example that calls puts a few times." in lines
    assert "#include <ffi.h>" in lines
    assert '      s = "Hello World!";' in lines
    assert lines[-1] == "}"
    assert "<" not in text.replace("<stdio.h>", "").replace("<ffi.h>", "")  # no markup left
    # the navigation links' targets are dropped in main-content mode, kept without it
    full = html_to_text(decode_html(FIXTURE.read_bytes()), main_content=False)
    assert "Next: Types, Previous: The Basics" in full
    assert "Types" not in text.splitlines()[0]


def test_main_content_drops_menus_and_footers():
    from lmstack.data.corpus import FOOTER, NAV, page

    paras = [
        "The committee reviewed the annual report near the market and the harbour.",
        "A small team repaired the old bridge before the festival in the spring.",
    ]
    html = page("Story", paras, before=NAV * 2, after=FOOTER)
    text = html_to_text(html)
    for p in paras:
        assert p in text
    for junk in ("Sitemap", "Login", "All rights reserved", "cookie policy", "Careers"):
        assert junk not in text, junk
    assert "Sitemap" in html_to_text(html, main_content=False)


@pytest.mark.parametrize(
    "enc,header",
    [
        ("cp1252", None),
        ("latin-1", "text/html; charset=utf-8"),
        ("utf-16", None),
        ("utf-8", "text/html; charset=iso-8859-1"),
        ("shift_jis", "text/html; charset=shift_jis"),
        ("cp1251", "text/html; charset=utf-8"),  # a header the bytes do not fit: detected instead
        ("shift_jis", "text/html; charset=utf-8"),
    ],
)
def test_encodings_detected_from_the_bytes(enc, header):
    s = {
        "shift_jis": "こんにちは、世界。今日は良い天気です。",
        "cp1251": "Это простой текст на русском языке для проверки кодировки.",
    }.get(enc, "Café crème, naïve façade, déjà vu, résumé.")
    html = f"<html><body><p>{s}</p><p>{s}</p></body></html>"
    assert s in html_to_text(decode_html(html.encode(enc), header))


@pytest.mark.parametrize(
    "header", [None, "text/html; charset=iso-8859-1", "text/html; charset=utf-8"]
)
def test_mixed_utf8_and_latin1_bytes_read_right(header):
    """A page pasted together from a UTF-8 part and a Latin-1 part: each part decoded in its own encoding
    (was: the whole page as cp1252, so the UTF-8 part became "cafÃ©")."""
    raw = "<html><body><p>Le café est très bon. ".encode() + "Une façade naïve.".encode("latin-1")
    raw += b"</p></body></html>"
    assert html_to_text(decode_html(raw, header)) == "Le café est très bon. Une façade naïve."
    legacy = "<p>Une façade naïve, déjà vu, à côté.</p>".encode(
        "cp1252"
    )  # no UTF-8 part: unchanged
    assert "façade naïve, déjà vu, à côté" in decode_html(legacy)


def test_undecodable_and_binary_input_never_crash():
    rnd = os.urandom(5000)
    for raw in (
        rnd,
        b"<html><body><p>ok \xff\xfe\x80 bytes</p></body></html>",
        b"",
        b"\x00" * 100,
        b"<html><body>" + b"<div>" * 5000 + b"deep</body></html>",
    ):
        assert isinstance(html_to_text(decode_html(raw)), str)
    docs = [
        Document("", "a", {"raw": b"\x89PNG\r\n\x1a\n" + rnd, "content_type": "text/html"}),
        Document("", "b", {"raw": b"%PDF-1.4 ...", "content_type": "application/pdf"}),
        Document(
            "",
            "c",
            {
                "raw": b"<html><body><p>Hello there, reader.</p></body></html>",
                "content_type": "text/html",
            },
        ),
        Document("", "d", {"raw": b"<html><body></body></html>", "content_type": "text/html"}),
    ]
    docs_copy = [Document(d.text, d.id, dict(d.metadata)) for d in docs]
    st = StepStats("extract")
    out = list(Extract()(docs, st))
    assert [d.id for d in out] == ["c"] and out[0].text == "Hello there, reader."
    assert "raw" not in out[0].metadata
    assert dict(st.dropped) == {"extract_binary": 1, "extract_not_html": 1, "extract_empty": 1}
    # bytes in are the payloads' (the reader's bytes out), bytes out the kept text's
    assert st.bytes_in == sum(len(d.metadata.get("raw", b"")) for d in docs_copy)
    assert st.bytes_out == len(b"Hello there, reader.")


def test_trafilatura_engine_extracts_the_article():
    pytest.importorskip("trafilatura")
    from lmstack.data.corpus import FOOTER, NAV, page

    paras = [
        " ".join(["The committee reviewed the annual report near the market and the harbour."] * 3)
    ] * 2
    text = html_to_text(page("Story", paras, before=NAV, after=FOOTER), engine="trafilatura")
    assert paras[0] in text and "Sitemap" not in text
    with pytest.raises(ValueError, match="engine"):
        html_to_text("<p>x</p>", engine="lynx")


def test_html_already_decoded_or_in_the_text():
    st = StepStats("extract")
    docs = [
        Document("", "s", {"raw": "<html><body><p>Decoded already.</p></body></html>"}),
        Document("<!DOCTYPE html><html><body><p>In the text field.</p></body></html>", "t"),
        Document("Plain text stays as it is.", "p"),
    ]
    assert [d.text for d in Extract()(docs, st)] == [
        "Decoded already.",
        "In the text field.",
        "Plain text stays as it is.",
    ]


def test_trafilatura_engine_equals_trafilatura_on_the_string():
    """The engine parses the page itself (lxml's C class lookup) and gives trafilatura the tree: the text
    must be what trafilatura.extract makes of the string, on pages that take each of load_html's paths."""
    trafilatura = pytest.importorskip("trafilatura")
    import random

    from lmstack.data.corpus import FOOTER, NAV, page, prose

    body = prose(random.Random(3))
    form = "<form><label>Name</label><input value='x'><select><option>a</option></select></form>"
    pages = [
        page("Story", body, before=NAV, after=FOOTER),
        page("Form", body[:2] + [form] + body[2:]),
        '<?xml version="1.0" encoding="utf-8"?>\n' + page("Declared", body),  # lxml wants bytes
        "<!DOCTYPE html>\n" + page("Doctype", body),
        "<html/>\n<body><p>" + " ".join(body) + "</p></body>",  # self-closing <html/>
        "<div><p>" + "</p><p>".join(body) + "</p></div>",  # no <html>: the dubious-HTML check
        "<p>only one block</p>",
        "plain words, no markup at all " * 20,
        "<html><body><table><tr><td>" + "</td><td>".join(body) + "</td></tr></table></body></html>",
        FIXTURE.read_bytes().decode("utf-8"),
    ]
    for html in pages:
        want = trafilatura.extract(
            html, include_comments=False, include_tables=True, favor_precision=True
        )
        assert html_to_text(html, engine="trafilatura") == (want or "").strip(), html[:60]
