"""Readers against the libraries people read these formats with (warcio, pyarrow, gzip/json) and hand counts;
bad input (truncated gzip/zstd/WARC, no HTTP body, non-UTF-8, empty, a 100 MB line, corrupt Parquet) is
counted under its reason and never ends the run."""

import gzip
import hashlib
import io
import json
import os
import tracemalloc

import pytest

from lmstack.data.document import stable_id
from lmstack.data.readers import JsonlReader, ParquetReader, TextReader, WarcReader, WetReader
from lmstack.data.step import StepStats

warcio = pytest.importorskip("warcio")
from warcio.archiveiterator import ArchiveIterator  # noqa: E402
from warcio.statusandheaders import StatusAndHeaders  # noqa: E402
from warcio.warcwriter import WARCWriter  # noqa: E402


def read(reader, rank=0, world=1):
    stats = StepStats(reader.name)
    docs = list(reader.for_task(rank, world).run(iter(()), stats))
    return docs, stats


def blake(source, key):  # the id rule, computed independently of lmstack.data.document
    return hashlib.blake2b(f"{source}\0{key}".encode(), digest_size=8).hexdigest()


def write_warc(path, pages, gz=True, extra=()):
    """pages: (url, body bytes, content type); extra: raw records (type, url, payload) such as request records."""
    with open(path, "wb") as f:
        w = WARCWriter(f, gzip=gz)
        w.write_record(w.create_warcinfo_record(os.path.basename(path), {"software": "test"}))
        for url, body, ctype in pages:
            h = StatusAndHeaders("200 OK", [("Content-Type", ctype)], protocol="HTTP/1.1")
            w.write_record(
                w.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=h)
            )
        for rtype, url, payload in extra:
            w.write_record(w.create_warc_record(url, rtype, payload=io.BytesIO(payload)))


PAGES = [
    (
        f"http://example.com/{i}",
        f"<html><body><p>page {i} é</p>{'word ' * 50}</body></html>".encode(),
        "text/html; charset=utf-8",
    )
    for i in range(6)
]
PAGES.append(
    (
        "http://example.com/latin1",
        "<p>caf\xe9 na\xefve</p>".encode("latin-1"),
        "text/html; charset=iso-8859-1",
    )
)
PAGES.append(("http://example.com/bin", bytes(range(256)) * 4, "image/png"))


@pytest.mark.parametrize("gz", [True, False])
def test_warc_reader_matches_warcio(tmp_path, gz):
    path = tmp_path / ("crawl.warc.gz" if gz else "crawl.warc")
    write_warc(
        path,
        PAGES + [("http://example.com/empty", b"", "text/html")],
        gz=gz,
        extra=[("request", "http://example.com/0", b"GET / HTTP/1.1\r\n\r\n")],
    )
    docs, stats = read(WarcReader(str(path)))
    ref = []
    with open(path, "rb") as f:  # warcio, independently: every response record with a body
        for r in ArchiveIterator(f):
            if r.rec_type == "response":
                body = r.content_stream().read()
                ref.append(
                    (
                        r.rec_headers.get_header("WARC-Record-ID"),
                        r.rec_headers.get_header("WARC-Target-URI"),
                        body,
                        r.http_headers.get_header("Content-Type"),
                        r.rec_headers.get_header("WARC-Date"),
                    )
                )
    got = [
        (
            d.metadata["warc_record_id"],
            d.metadata["url"],
            d.metadata["raw"],
            d.metadata["content_type"],
            d.metadata["warc_date"],
        )
        for d in docs
    ]
    assert got == [
        r for r in ref if r[2]
    ]  # the raw bytes, undecoded (latin-1 and binary bodies too)
    assert all(d.text == "" and d.metadata["http_status"] == 200 for d in docs)
    assert [d.id for d in docs] == [blake(str(path), r[0]) for r in ref if r[2]]
    assert stats.docs_in == 9 and stats.docs_out == 8 and dict(stats.dropped) == {"no_http_body": 1}
    assert stats.bytes_out == sum(len(p[1]) for p in PAGES)


def test_truncated_warc_keeps_the_records_before_the_cut(tmp_path):
    full = tmp_path / "full.warc"
    write_warc(full, PAGES[:4], gz=False)
    data = full.read_bytes()
    cut = tmp_path / "cut.warc"
    cut.write_bytes(data[: data.rfind(b"page 3") + 3])  # inside the last record's body
    docs, stats = read(WarcReader(str(cut)))
    assert [d.metadata["url"] for d in docs] == [p[0] for p in PAGES[:3]]
    assert dict(stats.dropped) == {"truncated_record": 1}

    gzpath = tmp_path / "full.warc.gz"
    write_warc(gzpath, PAGES[:4], gz=True)
    data = gzpath.read_bytes()
    (tmp_path / "cut.warc.gz").write_bytes(data[: len(data) - 40])  # inside the last gzip member
    docs, stats = read(WarcReader(str(tmp_path / "cut.warc.gz")))
    assert [d.metadata["url"] for d in docs] == [p[0] for p in PAGES[:3]]
    assert dict(stats.dropped) == {"truncated_record": 1}


def test_corrupt_gzip_warc_and_zstd_warc(tmp_path):
    """A gzip WARC with garbage inside a member: the records before it kept, the file counted as
    corrupt_compression (as a corrupt .jsonl.gz is; fastwarc raises a plain OSError); a .warc.zst reads
    the same records as the .warc it compresses."""
    import zstandard

    gzpath = tmp_path / "full.warc.gz"
    write_warc(gzpath, PAGES[:4], gz=True)
    data = gzpath.read_bytes()
    cut = data.find(b"\x1f\x8b", data.find(b"\x1f\x8b", 1) + 1)  # the third member: the second page
    bad = tmp_path / "bad.warc.gz"
    bad.write_bytes(data[: cut + 40] + b"\x00garbage" * 20 + data[cut + 240 :])
    docs, stats = read(WarcReader(str(bad)))
    assert [d.metadata["url"] for d in docs] == [PAGES[0][0]]
    assert dict(stats.dropped) == {"corrupt_compression": 1}

    plain = tmp_path / "c.warc"
    write_warc(plain, PAGES[:4], gz=False)
    zst = tmp_path / "c.warc.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    ref, _ = read(WarcReader(str(plain)))
    got, stats = read(WarcReader(str(zst)))
    assert [d.metadata["raw"] for d in got] == [p[1] for p in PAGES[:4]]
    assert [d.metadata["warc_record_id"] for d in got] == [
        d.metadata["warc_record_id"] for d in ref
    ]
    assert not stats.dropped


def test_a_warc_record_over_the_limit_is_dropped_unread(tmp_path):
    path = tmp_path / "c.warc.gz"
    write_warc(path, PAGES)
    docs, stats = read(WarcReader(str(path), max_doc_bytes=1000))
    assert [d.metadata["url"] for d in docs] == [
        p[0] for p in PAGES if p[0] != "http://example.com/bin"
    ]
    assert dict(stats.dropped) == {"too_long": 1}  # the 1 KiB binary body plus its HTTP headers


def test_wet_reader(tmp_path):
    path = tmp_path / "crawl.warc.wet.gz"
    texts = [
        b"Plain text one.\nSecond line.",
        "caf\xe9".encode("latin-1"),
        b"   ",
        "Ünïcode ok".encode(),
    ]
    with open(path, "wb") as f:
        w = WARCWriter(f, gzip=True)
        for i, t in enumerate(texts):
            rec = w.create_warc_record(
                f"http://e.org/{i}",
                "conversion",
                payload=io.BytesIO(t),
                warc_content_type="text/plain",
            )
            w.write_record(rec)
    docs, stats = read(WetReader(str(path)))
    assert [d.text for d in docs] == ["Plain text one.\nSecond line.", "caf\ufffd", "Ünïcode ok"]
    assert [d.metadata["url"] for d in docs] == [
        "http://e.org/0",
        "http://e.org/1",
        "http://e.org/3",
    ]
    assert dict(stats.dropped) == {"empty": 1} and stats.counters["utf8_replaced"] == 1


def write_jsonl(path, lines: list[bytes]):
    data = b"".join(lines)
    if str(path).endswith(".gz"):
        data = gzip.compress(data)
    elif str(path).endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


LINES = [
    json.dumps({"text": "first doc", "url": "u1"}).encode() + b"\n",
    json.dumps({"id": "given-7", "text": "keeps its id", "metadata": {"lang": "en"}}).encode()
    + b"\n",
    b"\n",  # blank: not a record
    b'{"text": "caf\xe9 latin-1 inside"}\n',  # not UTF-8
    b"{broken json\n",
    json.dumps({"text": "   "}).encode() + b"\n",  # empty
    json.dumps({"title": "no text key"}).encode() + b"\n",
    json.dumps([1, 2]).encode() + b"\n",  # not an object
    json.dumps({"text": "last, no newline"}).encode(),
]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_reader_counts_every_bad_line(tmp_path, suffix):
    path = tmp_path / f"part{suffix}"
    write_jsonl(path, LINES)
    dropped = []
    stats = StepStats(
        "jsonl_reader", on_drop=lambda doc, step, reason: dropped.append((reason, doc))
    )
    docs = list(JsonlReader(str(path)).for_task(0, 1).run(iter(()), stats))
    # the exclusion keeps each bad line as it was (its line number and the parser's message beside it)
    assert [(r, d.text, d.metadata.get("line")) for r, d in dropped] == [
        ("bad_json", "{broken json", 5),
        ("empty", LINES[5].decode().strip(), 6),
        ("no_text", LINES[6].decode().strip(), 7),
        ("bad_json", "[1, 2]", 8),
    ]
    assert [d.text for d in docs] == [
        "first doc",
        "keeps its id",
        "caf\ufffd latin-1 inside",
        "last, no newline",
    ]
    src = str(path)
    assert [d.id for d in docs] == [blake(src, 1), "given-7", blake(src, 4), blake(src, 9)]
    assert docs[0].metadata == {"url": "u1", "source": src} and docs[1].metadata == {
        "lang": "en",
        "source": src,
    }
    # hand count: 8 records (the blank line is none), 4 kept
    assert stats.docs_in == 8 and stats.docs_out == 4
    assert dict(stats.dropped) == {"bad_json": 2, "empty": 1, "no_text": 1}
    assert stats.counters["utf8_replaced"] == 1


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_truncated_compressed_jsonl_keeps_what_was_read(tmp_path, suffix):
    lines = [
        json.dumps({"text": f"document number {i} " + "filler " * (i % 7)}).encode() + b"\n"
        for i in range(30000)
    ]
    good = tmp_path / f"a{suffix}"
    write_jsonl(good, lines)
    bad = tmp_path / f"b{suffix}"
    data = good.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    docs, stats = read(JsonlReader([str(bad), str(good)]))
    n_bad = sum(1 for d in docs if d.metadata["source"] == str(bad))
    # the reference: the same decoder given the same cut bytes, without the end-of-stream check
    if suffix == ".jsonl.gz":
        import zlib

        ref = zlib.decompressobj(31).decompress(data[: len(data) // 2])
    else:
        import zstandard

        ref = zstandard.ZstdDecompressor().decompressobj().decompress(data[: len(data) // 2])
    assert (
        n_bad == ref.count(b"\n") > 0
    )  # every complete line before the cut (a torn last line is dropped)
    assert sum(1 for d in docs if d.metadata["source"] == str(good)) == 30000
    assert stats.dropped["truncated_file"] == 1


def test_not_gzip_is_counted_and_the_run_goes_on(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(b"this is not gzip at all\n")
    write_jsonl(tmp_path / "b.jsonl", [b'{"text": "fine"}\n'])
    docs, stats = read(JsonlReader(str(tmp_path)))
    assert [d.text for d in docs] == ["fine"] and dict(stats.dropped) == {"corrupt_compression": 1}


def test_a_100mb_line_is_skipped_without_holding_it(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"text": "before"}\n')
        f.write(b'{"text": "')
        block = b"a" * (1 << 20)
        for _ in range(100):
            f.write(block)
        f.write(b'"}\n{"text": "after"}\n')
    tracemalloc.start()
    docs, stats = read(JsonlReader(str(path), max_doc_bytes=4 << 20))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [d.text for d in docs] == ["before", "after"]
    assert dict(stats.dropped) == {"too_long": 1}
    assert peak < 24 << 20, peak  # a few 1 MiB chunks and the 4 MiB limit, not the 100 MB line


def test_parquet_reader_matches_pyarrow_and_survives_a_corrupt_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {"text": f"row {i}" if i != 5 else "", "url": f"http://x/{i}", "score": i / 10}
        for i in range(2500)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=700)
    good = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "b.parquet").write_bytes(good[: len(good) // 2])  # footer gone
    (tmp_path / "c.parquet").write_bytes(b"PAR1 not really")
    docs, stats = read(ParquetReader(str(tmp_path), batch_size=300))
    ref = pq.read_table(tmp_path / "a.parquet").to_pylist()
    kept = [r for r in ref if r["text"]]
    assert [d.text for d in docs] == [r["text"] for r in kept]
    assert [d.metadata["score"] for d in docs] == [r["score"] for r in kept]
    src = f"{tmp_path}/a.parquet"
    assert docs[5].id == blake(src, 6)  # row index, 0-based (row 5 was empty)
    assert dict(stats.dropped) == {"empty": 1, "corrupt_parquet": 2}


def test_text_folder_one_document_per_file(tmp_path):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("Alpha text.")
    (root / "sub" / "b.md").write_bytes("b\xe9ta".encode("latin-1"))
    (root / "empty.txt").write_text("  \n")
    (root / ".hidden.txt").write_text("never read")
    docs, stats = read(TextReader(str(root)))
    assert [(d.metadata["source"], d.text) for d in docs] == [
        (f"{root}/a.txt", "Alpha text."),
        (f"{root}/sub/b.md", "b\ufffdta"),
    ]
    assert docs[0].id == blake(f"{root}/a.txt", 0)
    assert dict(stats.dropped) == {"empty": 1} and stats.counters["utf8_replaced"] == 1
    only_md, _ = read(TextReader(str(root), glob="**/*.md"))
    assert [d.text for d in only_md] == ["b\ufffdta"]


def test_ids_are_stable_across_runs_and_working_directories(tmp_path, monkeypatch):
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "x.jsonl", [b'{"text": "one"}\n', b'{"text": "two"}\n'])
    monkeypatch.chdir(tmp_path)
    first = [d.id for d in read(JsonlReader("in"))[0]]
    reader = JsonlReader("in")  # built here ...
    monkeypatch.chdir(tmp_path / "in")  # ... run from elsewhere (a worker with another cwd)
    again = [d.id for d in read(reader)[0]]
    assert (
        first
        == again
        == [blake("in/x.jsonl", 1), blake("in/x.jsonl", 2)]
        == [stable_id("in/x.jsonl", n) for n in (1, 2)]
    )


def test_tasks_split_the_files(tmp_path):
    for i in range(5):
        write_jsonl(tmp_path / f"{i}.jsonl", [json.dumps({"text": f"file {i}"}).encode() + b"\n"])
    got = [[d.text for d in read(JsonlReader(str(tmp_path)), rank, 2)[0]] for rank in range(2)]
    assert got == [["file 0", "file 2", "file 4"], ["file 1", "file 3"]]
    by_glob = read(JsonlReader(f"{tmp_path}/[13].jsonl"))[0]
    assert [d.metadata["source"] for d in by_glob] == [f"{tmp_path}/1.jsonl", f"{tmp_path}/3.jsonl"]


def test_a_missing_input_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read(JsonlReader(str(tmp_path / "nope.jsonl")))
    with pytest.raises(FileNotFoundError, match=r"no file matches"):
        read(JsonlReader(str(tmp_path / "*.jsonl")))


def test_chunked_and_gzip_bodies_are_decoded(tmp_path):
    html = b"<html><body><p>stored as the server sent it</p></body></html>"
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (html[:20], html[20:])) + b"0\r\n\r\n"
    path = tmp_path / "raw.warc.gz"
    with open(path, "wb") as f:
        w = WARCWriter(f, gzip=True)
        for url, body, headers in [
            ("http://a/gzip", gzip.compress(html, mtime=0), [("Content-Encoding", "gzip")]),
            ("http://a/chunked", chunked, [("Transfer-Encoding", "chunked")]),
            ("http://a/bad", b"\x1f\x8b not really gzip", [("Content-Encoding", "gzip")]),
        ]:
            h = StatusAndHeaders(
                "200 OK", [("Content-Type", "text/html")] + headers, protocol="HTTP/1.1"
            )
            w.write_record(
                w.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=h)
            )
    docs, stats = read(WarcReader(str(path)))
    assert [d.metadata["raw"] for d in docs] == [html, html, b"\x1f\x8b not really gzip"]
    assert stats.counters["undecodable_http_encoding"] == 1
