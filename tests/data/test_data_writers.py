"""Writers: shards read back by plain gzip/zstandard/json and pyarrow, rollover counts by hand, shards whole or
absent when a run dies mid-shard, byte-identical reruns, the exclusion writer, stats merging by hand."""

import gzip
import io
import json
from collections import Counter

import pytest

from lmstack.data.document import Document
from lmstack.data.readers import JsonlReader, ParquetReader
from lmstack.data.step import Filter, StepStats
from lmstack.data.writers import ExclusionWriter, JsonlWriter, ParquetWriter


def docs(n, raw=False):
    for i in range(n):
        meta = {"url": f"http://e/{i}", "score": i / 4}
        if raw:
            meta["raw"] = b"<html>never written</html>"
        yield Document(f"text of document {i} — ünïcode", f"id{i}", meta)


def drain(step, items, rank=0):
    stats = StepStats(step.name)
    out = list(step.for_task(rank, rank + 1).run(items, stats))
    return out, stats


def plain_records(path):
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    elif path.name.endswith(".zst"):
        import zstandard

        data = (
            zstandard.ZstdDecompressor()
            .stream_reader(io.BytesIO(data), read_across_frames=True)
            .read()
        )
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


@pytest.mark.parametrize(
    "compression,suffix", [(None, ".jsonl"), ("gz", ".jsonl.gz"), ("zst", ".jsonl.zst")]
)
def test_jsonl_shards_roll_over_and_read_back(tmp_path, compression, suffix):
    w = JsonlWriter(tmp_path / "out", compression=compression, max_docs=4)
    out, stats = drain(w, docs(10, raw=True), rank=3)
    assert len(out) == 10  # a writer passes documents on
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == [f"00003_0000{i}{suffix}" for i in range(3)]  # 10 docs, 4 per shard: 4 + 4 + 2
    recs = [r for f in files for r in plain_records(tmp_path / "out" / f)]
    assert [len(plain_records(tmp_path / "out" / f)) for f in files] == [4, 4, 2]
    assert recs[7] == {
        "id": "id7",
        "text": "text of document 7 — ünïcode",
        "metadata": {"url": "http://e/7", "score": 1.75},
    }
    assert stats.counters["shards"] == 3 and stats.docs_in == stats.docs_out == 10
    back = list(JsonlReader(str(tmp_path / "out")).run(iter(()), StepStats("r")))
    assert [(d.id, d.text, d.metadata["score"]) for d in back] == [
        (f"id{i}", f"text of document {i} — ünïcode", i / 4) for i in range(10)
    ]


def test_byte_rollover(tmp_path):
    w = JsonlWriter(tmp_path, compression=None, max_bytes=200)
    drain(w, docs(6))
    sizes = [len(p.read_bytes()) for p in sorted(tmp_path.glob("*.jsonl"))]
    lines = [
        len(
            json.dumps(
                {"id": d.id, "text": d.text, "metadata": d.metadata}, ensure_ascii=False
            ).encode()
        )
        + 1
        for d in docs(6)
    ]
    assert lines == [107, 108, 107, 108, 107, 108]  # "score": 0.0, 0.25, 0.5, 0.75, 1.0, 1.25
    # a shard closes after the record that brings it to >= 200 bytes: 107+108 each time
    assert sizes == [215, 215, 215]


def test_reruns_are_byte_identical(tmp_path):
    for name in ("a", "b"):
        drain(JsonlWriter(tmp_path / name, compression="gz", max_docs=3), docs(7))
        drain(JsonlWriter(tmp_path / f"{name}z", compression="zst"), docs(7))
        drain(ParquetWriter(tmp_path / f"{name}p", max_docs=5), docs(7))
    for a, b in (("a", "b"), ("az", "bz"), ("ap", "bp")):
        fa, fb = sorted((tmp_path / a).iterdir()), sorted((tmp_path / b).iterdir())
        assert [p.name for p in fa] == [p.name for p in fb] and fa
        assert all(x.read_bytes() == y.read_bytes() for x, y in zip(fa, fb))
    # RFC 1952: bytes 4-7 of a gzip member are its MTIME; 0 means none (so the same docs give the same bytes
    # whenever they are written), and FLG (byte 3) has no FNAME bit
    head = sorted((tmp_path / "a").iterdir())[0].read_bytes()[:10]
    assert head[:3] == b"\x1f\x8b\x08" and head[4:8] == b"\0\0\0\0" and not head[3] & 0x08


def test_parquet_shards_match_pyarrow(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    drain(ParquetWriter(tmp_path, max_docs=4, row_group=2), docs(9, raw=True))
    files = sorted(tmp_path.glob("*.parquet"))
    assert [p.name for p in files] == [
        "00000_00000.parquet",
        "00000_00001.parquet",
        "00000_00002.parquet",
    ]
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    assert [r["id"] for r in rows] == [f"id{i}" for i in range(9)]
    assert json.loads(rows[2]["metadata"]) == {"url": "http://e/2", "score": 0.5}
    back = list(ParquetReader(str(tmp_path)).run(iter(()), StepStats("r")))
    assert [(d.id, d.metadata["url"]) for d in back] == [
        (f"id{i}", f"http://e/{i}") for i in range(9)
    ]


def test_a_shard_is_whole_or_absent_when_the_run_dies(tmp_path):
    def dying():
        yield from docs(6)
        raise RuntimeError("killed mid-shard")

    with pytest.raises(RuntimeError, match="mid-shard"):
        drain(JsonlWriter(tmp_path, compression="gz", max_docs=4), dying())
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "00000_00000.jsonl.gz"
    ]  # the finished shard; the half-written one and its temp file gone
    assert len(plain_records(tmp_path / names[0])) == 4


def test_a_relaunched_task_replaces_its_leftovers(tmp_path):
    (tmp_path / "00000_00007.jsonl.gz").write_bytes(b"from a killed run")
    (tmp_path / ".00000_00001.jsonl.gz.abc.tmp").write_bytes(b"half")
    (tmp_path / "00001_00000.jsonl.gz").write_bytes(b"another task's shard")
    drain(JsonlWriter(tmp_path, max_docs=4), docs(5))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "00000_00000.jsonl.gz",
        "00000_00001.jsonl.gz",
        "00001_00000.jsonl.gz",
    ]
    assert (tmp_path / "00001_00000.jsonl.gz").read_bytes() == b"another task's shard"


class Odd(Filter):
    def reason(self, doc):
        return "odd" if int(doc.id[2:]) % 2 else None


def test_exclusion_writer_keeps_each_drop_with_step_and_reason(tmp_path):
    ex = ExclusionWriter(tmp_path / "excluded", rank=2)
    stats = StepStats("odd")
    stats.on_drop = ex
    kept = list(Odd().run(docs(5, raw=True), stats))
    ex.close()
    assert [d.id for d in kept] == ["id0", "id2", "id4"]
    recs = plain_records(tmp_path / "excluded" / "00002.jsonl.gz")
    assert [(r["id"], r["step"], r["reason"]) for r in recs] == [
        ("id1", "odd", "odd"),
        ("id3", "odd", "odd"),
    ]
    assert recs[0]["text"] == "text of document 1 — ünïcode" and "raw" not in recs[0]["metadata"]
    assert dict(stats.dropped) == {"odd": 2} and stats.docs_in == 5 and stats.docs_out == 3


def test_stats_merge_by_hand():
    a = StepStats(
        "gopher", 10, 7, 1000, 600, Counter({"too_short": 2, "no_stop_words": 1}), Counter({"x": 1})
    )
    b = StepStats("gopher", 5, 4, 300, 250, Counter({"too_short": 1}))
    m = StepStats.from_dict(json.loads(json.dumps(a.to_dict()))).merge(b)
    assert m.to_dict() == {
        "name": "gopher",
        "docs_in": 15,
        "docs_out": 11,
        "bytes_in": 1300,
        "bytes_out": 850,
        "dropped": {"no_stop_words": 1, "too_short": 3},
        "counters": {"x": 1},
    }
    with pytest.raises(ValueError, match="cannot merge"):
        a.merge(StepStats("c4"))


@pytest.mark.parametrize("writer", ["jsonl", "parquet"])
def test_split_by_routes_documents_to_one_folder_per_value(tmp_path, writer):
    """split_by="language": one subfolder per value with its own shards and rollover (unknown when the key
    is absent, unsafe characters replaced); a relaunch of the task replaces its files in every subfolder."""
    langs = ["en", "de", "en", None, "en", "de", "x/../y"]
    items = [
        Document(f"doc {i}", f"id{i}", {} if lang is None else {"language": lang})
        for i, lang in enumerate(langs)
    ]
    out = tmp_path / "out"
    make = (
        (lambda: JsonlWriter(str(out), max_docs=2, split_by="language"))
        if writer == "jsonl"
        else (lambda: ParquetWriter(str(out), max_docs=2, split_by="language"))
    )
    (out / "en").mkdir(parents=True)
    (out / "en" / "00000_00009.jsonl.gz").write_bytes(b"left by a killed run")
    kept, stats = drain(make(), iter(items))
    assert [d.id for d in kept] == [d.id for d in items]  # passed on, in order
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    ext = ".jsonl.gz" if writer == "jsonl" else ".parquet"
    assert files == sorted(
        [f"en/00000_00000{ext}", f"en/00000_00001{ext}", f"de/00000_00000{ext}"]
        + [f"unknown/00000_00000{ext}", f"x_.._y/00000_00000{ext}"]
    )
    assert stats.counters["shards"] == 5

    def ids(path):
        if writer == "jsonl":
            return [r["id"] for r in plain_records(path)]
        import pyarrow.parquet as pq

        return pq.read_table(path).column("id").to_pylist()

    assert ids(out / "en" / f"00000_00000{ext}") == ["id0", "id2"]
    assert ids(out / "en" / f"00000_00001{ext}") == ["id4"]
    assert ids(out / "de" / f"00000_00000{ext}") == ["id1", "id5"]
    assert ids(out / "unknown" / f"00000_00000{ext}") == ["id3"]
    with pytest.raises(ValueError, match="split_by=3"):
        JsonlWriter(str(out), split_by=3)
