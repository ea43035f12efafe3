"""Gopher quality/repetition, C4 and FineWeb rules: each threshold just inside and just outside (hand-worked
documents), and the same decisions as datatrove's filters on the same documents (datatrove is the reference)."""

import random
from pathlib import Path

import pytest

from lmstack.data.document import Document
from lmstack.data.quality import (
    C4BadWords,
    C4Quality,
    FineWebQuality,
    GopherQuality,
    GopherRepetition,
    split_words,
)


def words(n: int, rng=None, length: int = 5) -> list[str]:
    """n distinct lowercase pseudo-words of ``length`` letters (no stop words, no repeats)."""
    rng = rng or random.Random(0)
    out, seen = [], set()
    while len(out) < n:
        w = "".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(length))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def doc(text: str) -> Document:
    return Document(text, "t")


def gq(text, **kw):
    return GopherQuality(**kw).reason(doc(text))


# ------------------------------------------------------------------------------------- Gopher quality boundaries
def test_gopher_word_count_bounds():
    assert gq(" ".join(["the", "and"] + words(48))) is None  # 50 words
    assert gq(" ".join(["the", "and"] + words(47))) == "gopher_short_doc"  # 49
    assert gq(" ".join(["the", "and"] + words(99_998, length=6))) is None  # 100,000
    assert gq(" ".join(["the", "and"] + words(99_999, length=6))) == "gopher_long_doc"  # 100,001


def test_gopher_mean_word_length_bounds():
    three = ["the", "and"] + words(48, length=3)
    assert gq(" ".join(three)) is None  # mean exactly 3.0
    assert gq(" ".join(three[:-1] + ["ab"])) == "gopher_below_avg_threshold"  # 149/50 < 3
    # 2 x 3 + 14 x 11 + 34 x 10 = 500 characters over 50 words: exactly 10
    ten = ["the", "and"] + words(14, length=11) + words(34, random.Random(1), length=10)
    assert gq(" ".join(ten)) is None
    assert (
        gq(" ".join(ten[:-1] + words(1, random.Random(2), length=11)))
        == "gopher_above_avg_threshold"
    )


def test_gopher_symbol_ratios():
    base = ["the", "and"] + words(48)
    assert gq(" ".join(base + ["#"] * 5)) is None  # 5 / 55 words <= 0.1
    assert gq(" ".join(base + ["#"] * 6)) == "gopher_too_many_hashes"  # 6 / 56 > 0.1
    assert gq(" ".join(["..."] * 5 + base)) is None  # in the middle: no line ends in one
    assert gq(" ".join(["…"] * 6 + base)) == "gopher_too_many_ellipsis"


def test_gopher_bullet_and_ellipsis_lines():
    lines = [" ".join(["the", "and"] + words(6, random.Random(i))) for i in range(100)]
    bullets = lambda k: "\n".join(("- " if i < k else "") + ln for i, ln in enumerate(lines))
    assert gq(bullets(90)) is None and gq(bullets(91)) == "gopher_too_many_bullets"
    ell = lambda k: "\n".join(ln + (" ..." if i < k else ".") for i, ln in enumerate(lines[:10]))
    assert gq(ell(3)) is None and gq(ell(4)) == "gopher_too_many_end_ellipsis"


def test_gopher_alpha_and_stop_words():
    base = ["the", "and"] + words(48)
    assert gq(" ".join(base + ["1234"] * 12)) is None  # 50 / 62 >= 0.8
    assert gq(" ".join(base + ["1234"] * 13)) == "gopher_below_alpha_threshold"  # 50 / 63
    assert gq(" ".join(["the", "the"] + words(48))) == "gopher_enough_stop_words"
    assert gq(" ".join(["The", "And"] + words(48))) is None  # case-insensitive, as Gopher means it
    assert (
        gq(" ".join(["The", "And"] + words(48)), stop_words_case_sensitive=True)
        == "gopher_enough_stop_words"
    )


# ---------------------------------------------------------------------------------- Gopher repetition boundaries
def gr(text, **kw):
    return GopherRepetition(**kw).reason(doc(text))


def test_gopher_duplicate_lines_and_paragraphs():
    uniq = [" ".join(words(8, random.Random(i))) for i in range(7)]
    text = "\n".join(uniq + ["ok"] * 3)  # 10 lines, 2 repeat an earlier line
    assert gr(text) is None
    text = "\n".join(uniq[:6] + ["ok"] * 4)  # 10 lines, 3 repeats = 0.3: inside
    assert gr(text) is None
    assert gr("\n".join(uniq[:6] + ["ok"] * 5)) == "dup_line_frac"  # 11 lines, 4 repeats
    paras = "\n\n".join(uniq[:6] + ["ok"] * 5)
    assert gr(paras) == "dup_para_frac"
    # character fraction: a repeated line of c characters in a text of T characters, threshold c / T
    t = "\n".join(uniq[:5] + [uniq[0]])
    frac = len(uniq[0]) / len(t)
    only = {
        "dup_line_frac": None,
        "top_n_grams": [],
        "dup_n_grams": [],
    }  # the n-gram rules would see it too
    assert gr(t, dup_line_char_frac=frac, **only) is None
    assert gr(t, dup_line_char_frac=frac - 1e-9, **only) == "dup_line_char_frac"


def test_gopher_top_and_duplicated_ngrams_hand_worked():
    w = words(30)
    text = " ".join(w[:10] + w[:2] + w[10:30])  # the 2-gram (w0 w1) occurs twice: 2 x 11 characters
    top2 = 2 * len(f"{w[0]} {w[1]}") / len(text)
    assert gr(text, top_n_grams=[(2, top2)], dup_n_grams=[]) is None
    assert gr(text, top_n_grams=[(2, top2 - 1e-9)], dup_n_grams=[]) == "top_2_gram"
    text = " ".join(w[:10] + w[:5] + w[10:30])  # one repeated 5-gram: its 25 letters count
    dup5 = 25 / len(text)
    assert gr(text, top_n_grams=[], dup_n_grams=[(5, dup5)]) is None
    assert gr(text, top_n_grams=[], dup_n_grams=[(5, dup5 - 1e-9)]) == "duplicated_5_n_grams"


# ------------------------------------------------------------------------------------------------ C4 boundaries
def sent(i: int) -> str:
    return " ".join(words(5, random.Random(100 + i))).capitalize() + "."


def test_c4_sentences_lines_and_page_rules():
    five = "\n".join(sent(i) for i in range(5))
    assert C4Quality().reason(doc(five)) is None
    assert C4Quality().reason(doc("\n".join(sent(i) for i in range(4)))) == "too_few_sentences"
    d = doc(
        five + "\nNo end punctuation here\nTwo words.\nEnable javascript to see this page.\n"
        "We use cookies, see the cookie policy.\nA citation here[1].\n" + "x" * 1001 + " long word."
    )
    assert C4Quality().reason(d) is None  # the bad lines go, the page stays
    assert d.text.splitlines() == five.splitlines() + ["A citation here."]
    assert C4Quality().reason(doc(five + "\nThis is lorem ipsum dolor.")) == "lorem_ipsum"
    assert C4Quality().reason(doc(five + "\nfunction f() { return 1; }.")) == "curly_bracket"
    assert C4Quality().reason(doc(five.replace(".", "..."))) == "too_few_sentences"
    d = doc(
        five + "\nThree words here.\n" + "y" * 1000 + " is long."
    )  # both just inside their line rules
    assert C4Quality().reason(d) is None and d.text.splitlines()[-2:] == [
        "Three words here.",
        "y" * 1000 + " is long.",
    ]


def test_c4_bad_words():
    f = C4BadWords(words=["badword", "two words"])
    assert f.reason(doc("A clean sentence.")) is None
    assert f.reason(doc("This has a BadWord in it.")) == "document_removed_with_badwords"
    assert f.reason(doc("Say two words now.")) == "document_removed_with_badwords"
    assert f.reason(doc("Notabadwordhere.")) is None  # whole words only
    with pytest.raises(ValueError, match="bad-words"):
        C4BadWords()


# ------------------------------------------------------------------------------------------- FineWeb boundaries
def fw_lines(n_punct: int, n_short: int, n: int = 100) -> str:
    out = []
    for i in range(n):
        ln = (
            " ".join(words(3, random.Random(i), 4))
            if i < n_short
            else " ".join(words(7, random.Random(i), 5))
        )
        out.append(ln + ("." if i >= n - n_punct else ""))
    return "\n".join(out)


def test_fineweb_boundaries():
    f = FineWebQuality()
    assert f.reason(doc(fw_lines(12, 0))) is None
    assert f.reason(doc(fw_lines(11, 0))) == "line_punct_ratio"
    assert f.reason(doc(fw_lines(50, 67))) is None  # 67 lines of <= 30 characters of 100
    assert f.reason(doc(fw_lines(50, 68))) == "short_line_ratio"
    assert (
        len("x" * 30) <= 30
        and f.reason(doc("\n".join(["y" * 30 + "."] * 1 + [fw_lines(50, 0)]))) is None
    )
    base = fw_lines(50, 0, 20).splitlines()
    t = "\n".join(base + [base[0]])
    frac = len(base[0]) / (len(t) - t.count("\n"))
    assert FineWebQuality(char_duplicates_ratio=frac).reason(doc(t)) is None
    assert FineWebQuality(char_duplicates_ratio=frac - 1e-9).reason(doc(t)) == "char_dup_ratio"
    assert f.reason(doc("\n\n  \n")) == "empty"
    assert (
        f.reason(
            doc("\n".join(["Aaaaaa bbbbbbbbb ccccccccc dddddddd eeeeee."] * 1 + ["Ok fine."] * 9))
        )
        == "short_line_ratio"
    )


# ------------------------------------------------------------------------ the same survivors as datatrove's filters
def reference_docs() -> list[str]:
    """Texts of the labelled generated corpus (extracted) plus the boundary documents above."""
    from lmstack.data.corpus import generated_records
    from lmstack.data.extract import decode_html, html_to_text, looks_binary

    texts = []
    for rec in generated_records(random.Random(0), n_clean=30):
        if rec.labels["kind"] in ("binary", "very_long") or looks_binary(rec.payload):
            continue
        t = html_to_text(decode_html(rec.payload, rec.content_type))
        if t:
            texts.append(t)
    fixture = (
        Path(__file__).parent / "fixtures" / "libffi_simple_example.html"
    )  # real documentation with code
    texts.append(html_to_text(decode_html(fixture.read_bytes())))
    texts += [
        fw_lines(12, 0),
        fw_lines(11, 0),
        fw_lines(50, 68),
        "\n".join(sent(i) for i in range(5)),
        " ".join(["the", "and"] + words(48) + ["#"] * 6),
        " ".join(["the", "and"] + words(47)),
    ]
    return texts


@pytest.fixture(scope="module")
def dt():
    pytest.importorskip("spacy")  # datatrove's English word tokenizer
    return pytest.importorskip("datatrove.pipeline.filters")


def _dt_reason(flt, text):
    from datatrove.data import Document as DTDocument

    d = DTDocument(text=text, id="t")
    r = flt.filter(d)
    return (None if r is True else r[1]), d.text


@pytest.mark.slow
def test_same_decisions_as_datatrove(dt):
    texts = reference_docs()
    pairs = [
        (GopherQuality(stop_words_case_sensitive=True), dt.GopherQualityFilter()),
        (GopherRepetition(), dt.GopherRepetitionFilter()),
        (C4Quality(), dt.C4QualityFilter()),
        (FineWebQuality(char_duplicates_ratio=0.01), dt.FineWebQualityFilter()),
    ]
    for ours, ref in pairs:
        got, want = [], []
        for t in texts:
            d = doc(t)
            got.append((ours.reason(d), d.text))
            want.append(_dt_reason(ref, t))
        assert got == want, (
            ours.name
        )  # same reason for every drop, same rewritten text (C4) for every keep
        assert any(r is None for r, _ in got) and any(r is not None for r, _ in got)


def test_word_splitter_matches_spacy_on_common_shapes(dt):
    from datatrove.utils.text import split_into_words

    s = (
        "Linux kernel (see \"capabilities(7)\") has /etc/passwd and ~/.bashrc; it's isn't 50% $5 C++ a/b "
        "e.g. U.S. 1,000.50 2024-01-01 well-known x--y wait... «quoted» e-mail me@example.com #tag done."
    )
    assert split_words(s) == split_into_words(s)
