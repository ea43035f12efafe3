"""A realistic crawl to run the data pipeline on, offline: WARC files of real and generated web pages with labels.

Real pages: the HTML documentation that Debian packages install (the Debian Reference in up to eight languages
when ``debian-reference-*`` is installed — ``make data-demo`` installs it —, Python's and other packages' HTML
docs under /usr/share/doc); the generator works with whatever is on disk, including nothing.

Generated pages, each with its labels (so every filter's precision and recall can be measured):
clean prose; exact duplicates; near-duplicates at chosen Jaccard similarities (of word 5-gram sets, the
quantity MinHash estimates); pages sharing boilerplate lines; boilerplate-heavy pages (menus, cookie banners,
footers around a real article) and boilerplate-only pages; keyword spam; bullet lists; "lorem ipsum" and
script-heavy pages; PII pages with known counts of e-mails, phones and IPs; very short and very long pages;
pages in a wrong or undeclared encoding; binary records (PNG, gzip) some lying about their type; NSFW and
toxic pages from :func:`lmstack.data.classifiers.generated_examples` (a different seed from training).

Layout: ``out/crawl-00000.warc.gz ...`` (warcio, gzip per record) and ``out/labels.jsonl`` with one line per
record: ``{"url", "record_id", "kind", "quality": "good"|"bad", "language", "nsfw", "toxic", "pii": {...}, ...}``;
records are joined to documents by URL (``metadata["url"]``).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import random
import struct
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from glob import glob
from html import escape
from pathlib import Path
from typing import Any

from lmstack.utils import atomic_path, atomic_write_text

REAL_HTML_GLOBS = (
    "/usr/share/debian-reference/*.html",
    "/usr/share/doc/python3*/html/**/*.html",
    "/usr/share/doc/*/html/**/*.html",
    "/usr/share/doc/nodejs/**/*.html",
)

# ------------------------------------------------------------------------------------------- prose grammar
# Small parts combined per phrase, so that a page of a few hundred words repeats few word 5-grams (the
# repetition filters must keep clean prose) while every sentence still reads as ordinary English.
_ADJ = [
    "old",
    "new",
    "small",
    "large",
    "quiet",
    "busy",
    "local",
    "careful",
    "simple",
    "modern",
    "early",
    "public",
    "famous",
    "hidden",
    "northern",
    "useful",
    "shared",
    "final",
    "second",
    "annual",
    "green",
    "narrow",
]
_NOUN = [
    "committee",
    "team",
    "system",
    "neighbour",
    "bridge",
    "student",
    "council",
    "reader",
    "museum",
    "village",
    "module",
    "train",
    "library",
    "engineer",
    "garden",
    "station",
    "report",
    "method",
    "region",
    "budget",
    "archive",
    "survey",
    "festival",
    "market",
    "school",
    "harbour",
    "orchestra",
    "workshop",
    "journal",
    "farm",
    "river",
    "kitchen",
    "theatre",
    "hospital",
    "factory",
    "office",
    "painting",
    "letter",
    "schedule",
    "road",
]
_VERB = [
    "finished",
    "reviewed",
    "described",
    "improved",
    "explained",
    "planned",
    "measured",
    "changed",
    "visited",
    "repaired",
    "documented",
    "tested",
    "shared",
    "rebuilt",
    "supported",
    "painted",
    "opened",
    "moved",
    "studied",
    "cleaned",
    "organised",
    "photographed",
    "questioned",
    "admired",
    "restored",
    "announced",
]
_PREP = [
    "near",
    "behind",
    "beside",
    "after",
    "before",
    "during",
    "without",
    "across",
    "under",
    "above",
    "with",
    "for",
    "around",
    "beyond",
    "inside",
    "along",
]
_TIME = [
    "last week",
    "in the spring",
    "this morning",
    "for the first time",
    "once again",
    "by the evening",
    "over the summer",
    "at last",
    "every year",
    "two days later",
    "in the end",
    "that afternoon",
]


def _np(rng: random.Random) -> str:
    det = rng.choice(["the", "a", "our", "their", "that", "one", "every", "the"])
    det = "an" if det == "a" else det
    adj = rng.choice(_ADJ)
    if det == "an" and adj[0] not in "aeiou":
        det = "a"
    return f"{det} {adj} {rng.choice(_NOUN)}"


def sentence(rng: random.Random) -> str:
    s = f"{_np(rng)} {rng.choice(_VERB)} {_np(rng)} {rng.choice(_PREP)} {_np(rng)}"
    r = rng.random()
    if r < 0.3:
        s += f" {rng.choice(_TIME)}"
    elif r < 0.55:
        s += f", and {_np(rng)} {rng.choice(_VERB)} it to be {rng.choice(_ADJ)}"
    elif r < 0.7:
        s += f" so that {_np(rng)} could have {_np(rng)}"
    s = s[0].upper() + s[1:]
    return s + (rng.choice(["!", "?"]) if rng.random() < 0.08 else ".")


def prose(rng: random.Random, paragraphs: tuple[int, int] = (4, 8)) -> list[str]:
    return [
        " ".join(sentence(rng) for _ in range(rng.randint(3, 6)))
        for _ in range(rng.randint(*paragraphs))
    ]


def page(
    title: str,
    paras: list[str],
    head: str = "",
    before: str = "",
    after: str = "",
    charset: str = "utf-8",
) -> str:
    body = "\n".join(f"<p>{escape(p)}</p>" for p in paras)
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="{charset}"><title>{escape(title)}</title>{head}</head>\n'
        f"<body>{before}<main><article><h1>{escape(title)}</h1>\n{body}\n</article></main>{after}</body></html>\n"
    )


NAV = (
    "<nav><ul>"
    + "".join(
        f'<li><a href="/{w.lower()}">{w}</a></li>'
        for w in [
            "Home",
            "News",
            "Sports",
            "Weather",
            "Shop",
            "About us",
            "Contact",
            "Login",
            "Register",
            "Sitemap",
        ]
    )
    + "</ul></nav>"
)
FOOTER = (
    "<footer><p>Copyright 2024 Example Media Group. All rights reserved.</p><p>This site uses cookies. "
    "By continuing you accept our cookie policy and terms of use.</p><ul><li>Privacy policy</li>"
    "<li>Imprint</li><li>Careers</li><li>Advertise</li></ul></footer>"
)


@dataclass
class Record:
    url: str
    payload: bytes
    content_type: str
    labels: dict[str, Any] = field(default_factory=dict)


def _labels(kind: str, quality: str = "good", **kw: Any) -> dict[str, Any]:
    out = {
        "kind": kind,
        "quality": quality,
        "language": "en",
        "nsfw": False,
        "toxic": False,
        "pii": {"email_address": 0, "phone_number": 0, "ip_address": 0},
    }
    out.update(kw)
    return out


def _png(rng: random.Random) -> bytes:
    raw = bytes(rng.randrange(256) for _ in range(3 * 16 * 16 + 16))
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 16, 16, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def _near_duplicate(
    words: list[str], target: float, rng: random.Random, n: int = 5
) -> tuple[list[str], float]:
    """A copy of ``words`` whose word-5-gram-set Jaccard with the original is close to ``target``: replaces
    words at random positions, one at a time, until the measured Jaccard falls to the target."""
    grams = lambda ws: {tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)}
    a, out = grams(words), list(words)
    order = list(range(len(words)))
    rng.shuffle(order)
    j = 1.0
    for k, pos in enumerate(order):
        out[pos] = (
            f"variant{k}" + words[pos][len(words[pos].rstrip(".!?,")) :]
        )  # keep the punctuation
        b = grams(out)
        j = len(a & b) / len(a | b)
        if j <= target:
            break
    return out, j


def generated_records(
    rng: random.Random, n_clean: int = 60, long_pages: int = 2
) -> Iterator[Record]:
    """The labelled generated pages (see the module docstring); ``long_pages`` pages of > 100,000 words."""
    from lmstack.data.classifiers import generated_examples

    base = "http://generated.example"
    clean = []
    for i in range(n_clean):
        paras = prose(rng)
        clean.append(paras)
        yield Record(
            f"{base}/clean/{i}",
            page(f"Notes {i}", paras).encode(),
            "text/html; charset=utf-8",
            _labels("clean"),
        )
    for i in range(8):  # exact duplicates of clean pages
        src = (i * 3) % n_clean
        yield Record(
            f"{base}/exact/{i}",
            page(f"Notes {src}", clean[src]).encode(),
            "text/html; charset=utf-8",
            _labels("exact_duplicate", dup_of=f"{base}/clean/{src}"),
        )
    for i, target in enumerate([0.9, 0.8, 0.7, 0.5, 0.3, 0.9, 0.8, 0.7]):
        src = (1 + i * 3) % n_clean
        lens = [len(p.split()) for p in clean[src]]
        near, j = _near_duplicate(" ".join(clean[src]).split(), target, rng)
        paras, k = [], 0
        for n in lens:  # the same paragraphs, words replaced in place
            paras.append(" ".join(near[k : k + n]))
            k += n
        yield Record(
            f"{base}/near/{i}",
            page(f"Notes {src} again", paras).encode(),
            "text/html; charset=utf-8",
            _labels(
                "near_duplicate", dup_of=f"{base}/clean/{src}", jaccard=round(j, 4), target=target
            ),
        )
    r7 = random.Random(7)
    shared = [sentence(r7) for _ in range(4)]
    for i in range(6):  # pages that share the same boilerplate lines (line-level duplicates)
        paras = shared[:2] + prose(rng, (3, 5)) + shared[2:]
        yield Record(
            f"{base}/lines/{i}",
            page(f"Column {i}", paras).encode(),
            "text/html; charset=utf-8",
            _labels("line_duplicates", shared_lines=shared),
        )
    for i in range(
        10
    ):  # an article inside menus and footers: extraction should keep only the article
        paras = prose(rng, (3, 5))
        yield Record(
            f"{base}/boiler/{i}",
            page(f"Story {i}", paras, before=NAV * 2, after=FOOTER).encode(),
            "text/html; charset=utf-8",
            _labels("boilerplate_heavy", article=paras),
        )
    for i in range(8):  # nothing but menus, teasers and legal lines
        items = [f"<li><a href='/p{k}'>{_np(rng).title()}</a></li>" for k in range(25)]
        html = (
            f"<html><head><title>Index {i}</title></head><body>{NAV}<div><ul>{''.join(items)}</ul></div>"
            f"{FOOTER}</body></html>"
        )
        yield Record(
            f"{base}/boileronly/{i}", html.encode(), "text/html", _labels("boilerplate_only", "bad")
        )
    spam_words = [
        "cheap",
        "watches",
        "best",
        "price",
        "buy",
        "now",
        "replica",
        "online",
        "discount",
        "sale",
    ]
    for i in range(10):
        kw = rng.sample(spam_words, 3)
        lines = [" ".join(kw * rng.randint(3, 6)) + "." for _ in range(20)]
        yield Record(
            f"{base}/spam/{i}",
            page(f"{kw[0]} {kw[1]}", lines).encode(),
            "text/html",
            _labels("keyword_spam", "bad"),
        )
    for i in range(6):
        items = "".join(f"<li>{_np(rng)}</li>" for _ in range(60))
        yield Record(
            f"{base}/bullets/{i}",
            f"<html><body><h1>List {i}</h1><ul>{items}</ul></body></html>".encode(),
            "text/html",
            _labels("bullet_list", "bad"),
        )
    for i in range(5):
        lorem = (
            "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut "
            "labore et dolore magna aliqua."
        )
        yield Record(
            f"{base}/lorem/{i}",
            page("Template", [lorem] + prose(rng, (3, 4))).encode(),
            "text/html",
            _labels("lorem_ipsum", "bad"),
        )
    for i in range(5):
        code = [
            f"function f{k}(x) {{ return x * {k}; }} var y{k} = f{k}(2); console.log(y{k});"
            for k in range(30)
        ]
        yield Record(
            f"{base}/code/{i}",
            page("Widget", code).encode(),
            "text/html",
            _labels("script_text", "bad"),
        )
    for i in range(12):  # PII with known counts
        counts = {"email_address": 0, "phone_number": 0, "ip_address": 0}
        paras = prose(rng, (3, 5))
        extra = []
        for _ in range(rng.randint(1, 3)):
            extra.append(
                f"Write to {rng.choice(['anna', 'bob.smith', 'info', 'j.doe+news'])}@"
                f"{rng.choice(['example.com', 'mail.example.org', 'uni.example.edu'])} for details."
            )
            counts["email_address"] += 1
        for _ in range(rng.randint(1, 3)):
            a, b, c = rng.randint(200, 989), rng.randint(100, 999), rng.randint(1000, 9999)
            fmt = rng.choice(
                [
                    f"({a}) {b}-{c}",
                    f"{a}-{b}-{c}",
                    f"{a}.{b}.{c}",
                    f"+1 {a} {b} {c}",
                    f"{a}{b}{c}",
                    f"+44 20 {b}{c % 10} {c}",
                    f"+49 30 {b}{c}",
                    f"+33 1 {b % 90 + 10} {c % 90 + 10} {a % 90 + 10} {b % 90 + 10}",
                ]
            )
            extra.append(f"Call us at {fmt} during office hours.")
            counts["phone_number"] += 1
        for _ in range(rng.randint(0, 2)):
            ip = rng.choice(
                [
                    f"{rng.randint(11, 99)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
                    f"2001:db8:{rng.randint(1, 9999):x}::{rng.randint(1, 999):x}",
                ]
            )
            extra.append(f"The server at {ip} answered the request.")
            counts["ip_address"] += 1
        yield Record(
            f"{base}/pii/{i}",
            page(f"Contact {i}", paras + extra).encode(),
            "text/html",
            _labels("pii", pii=counts),
        )
    for i in range(6):
        yield Record(
            f"{base}/short/{i}",
            page(f"Hi {i}", [sentence(rng)]).encode(),
            "text/html",
            _labels("very_short", "bad"),
        )
    for i in range(long_pages):  # more than 100,000 words
        paras = [" ".join(sentence(rng) for _ in range(50)) for _ in range(200)]
        yield Record(
            f"{base}/long/{i}",
            page(f"Everything {i}", paras).encode(),
            "text/html",
            _labels("very_long", "bad"),
        )
    for i, (enc, declared) in enumerate(
        [
            ("cp1252", None),
            ("latin-1", "utf-8"),
            ("utf-16", None),
            ("cp1252", "cp1252"),
            ("iso-8859-2", None),
            ("utf-8", "latin-1"),
        ]
    ):
        paras = prose(rng, (3, 4)) + ["Café crème, naïve façade, déjà vu, “quotes” and résumé."]
        html = page(f"Menu {i}", paras, charset=declared or "")
        if declared is None:
            html = html.replace('<meta charset="">', "")
        ctype = f"text/html; charset={declared}" if declared else "text/html"
        yield Record(
            f"{base}/encoding/{i}",
            html.encode(enc, errors="replace"),
            ctype,
            _labels(
                "wrong_encoding",
                encoding=enc,
                declared=declared,
                check=paras[-1].encode(enc, errors="replace").decode(enc),
            ),
        )
    for i in range(6):
        blob = (
            _png(rng)
            if i % 2 == 0
            else gzip.compress(bytes(rng.randrange(256) for _ in range(2000)), mtime=0)
        )
        ctype = ["image/png", "application/gzip", "text/html"][i % 3]  # some lie about their type
        yield Record(f"{base}/binary/{i}", blob, ctype, _labels("binary", "bad"))
    for kind in ("nsfw", "toxic"):
        pos, _ = generated_examples(kind, n=12, seed=99)
        for i, text in enumerate(pos):
            paras = [text] + prose(rng, (3, 4))
            yield Record(
                f"{base}/{kind}/{i}",
                page(f"Post {i}", paras).encode(),
                "text/html",
                _labels(kind, **{kind: True}),
            )


def real_records(limit: int = 120) -> Iterator[Record]:
    """Real HTML from Debian packages' documentation (whatever is installed), at most ``limit`` files."""
    seen, files = set(), []
    for pattern in REAL_HTML_GLOBS:
        for f in sorted(glob(pattern, recursive=True)):
            p = Path(f)
            if p.is_file() and f not in seen and p.stat().st_size > 2000:
                seen.add(f)
                files.append(p)
    rng = random.Random(0)
    if len(files) > limit:
        deb = [f for f in files if "debian-reference" in str(f)]
        other = [f for f in files if "debian-reference" not in str(f)]
        keep = deb[: limit // 2]
        files = keep + rng.sample(other, min(len(other), limit - len(keep)))
    first: dict[
        bytes, str
    ] = {}  # packages that ship the same page (libffi-dev and libffi8): labelled copies
    for p in files:
        parts = p.name.split(".")
        lang = parts[-2] if len(parts) >= 3 and "debian-reference" in str(p) else "en"
        lang = {"zh-cn": "zh", "zh-tw": "zh", "pt-br": "pt"}.get(lang, lang)
        data, url = p.read_bytes(), f"http://docs.local{p}"
        key = hashlib.blake2b(data, digest_size=16).digest()
        same = {"dup_of": first[key]} if key in first else {}
        first.setdefault(key, url)
        yield Record(url, data, "text/html", _labels("real", language=lang, **same))


def write_corpus(
    out_dir: str | Path,
    n_files: int = 4,
    real_limit: int = 120,
    seed: int = 0,
    n_clean: int = 60,
    long_pages: int = 2,
) -> dict[str, Any]:
    """Writes the WARC files and ``labels.jsonl`` (each atomically); returns a summary (records per kind).
    ``n_clean`` clean prose pages and ``long_pages`` very long ones (fewer for a quick run)."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    records = list(real_records(real_limit)) + list(generated_records(rng, n_clean, long_pages))
    random.Random(seed + 1).shuffle(records)
    labels, kinds = [], {}
    for f in range(n_files):
        path = out / f"crawl-{f:05d}.warc.gz"
        with atomic_path(path) as part, open(part, "wb") as fh:
            writer = WARCWriter(fh, gzip=True)
            for k, rec in enumerate(records[f::n_files]):
                http = StatusAndHeaders(
                    "200 OK",
                    [("Content-Type", rec.content_type), ("Content-Length", str(len(rec.payload)))],
                    protocol="HTTP/1.1",
                )
                record_id = f"<urn:uuid:{_uuid(seed, f, k)}>"
                warc = writer.create_warc_record(
                    rec.url,
                    "response",
                    payload=io.BytesIO(rec.payload),
                    http_headers=http,
                    warc_headers_dict={
                        "WARC-Record-ID": record_id,
                        "WARC-Date": "2024-01-01T00:00:00Z",
                    },
                )
                writer.write_record(warc)
                labels.append(
                    {"url": rec.url, "record_id": record_id, "file": path.name, **rec.labels}
                )
                kinds[rec.labels["kind"]] = kinds.get(rec.labels["kind"], 0) + 1
    atomic_write_text(
        out / "labels.jsonl",
        "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in labels),
    )
    return {"records": len(labels), "files": n_files, "kinds": dict(sorted(kinds.items()))}


def _uuid(seed: int, f: int, k: int) -> str:
    return str(
        uuid.UUID(bytes=hashlib.blake2b(f"{seed}/{f}/{k}".encode(), digest_size=16).digest())
    )


def read_labels(out_dir: str | Path) -> dict[str, dict[str, Any]]:
    """``labels.jsonl`` as {url: labels}."""
    with open(Path(out_dir) / "labels.jsonl", encoding="utf-8") as fh:
        return {r["url"]: r for r in map(json.loads, fh)}
