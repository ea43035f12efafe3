"""The offline crawl: WARC records readable by warcio, labels beside them, near-duplicates at the Jaccard they
claim (recomputed here from the texts), PII counts the replacer finds exactly, and the demo's report."""

import json
import random

import pytest

pytest.importorskip("warcio")

from lmstack.data.corpus import _near_duplicate, read_labels, write_corpus


def test_corpus_writes_warc_and_labels(tmp_path):
    from warcio.archiveiterator import ArchiveIterator

    summary = write_corpus(tmp_path, n_files=2, real_limit=0)  # generated pages only: works with no docs on disk
    labels = read_labels(tmp_path)
    assert summary["records"] == len(labels) and summary["files"] == 2
    urls = []
    for f in sorted(tmp_path.glob("*.warc.gz")):
        with open(f, "rb") as fh:
            for rec in ArchiveIterator(fh):
                if rec.rec_type == "response":
                    urls.append(rec.rec_headers.get_header("WARC-Target-URI"))
                    assert rec.content_stream().read()
    assert sorted(urls) == sorted(labels)
    kinds = {lab["kind"] for lab in labels.values()}
    assert {"clean", "exact_duplicate", "near_duplicate", "binary", "pii", "very_short", "very_long",
            "wrong_encoding", "keyword_spam", "boilerplate_heavy", "nsfw", "toxic"} <= kinds
    again = tmp_path / "again"
    write_corpus(again, n_files=2, real_limit=0)
    for f in sorted(tmp_path.glob("*.warc.gz")):  # deterministic: the same bytes on every run
        assert f.read_bytes() == (again / f.name).read_bytes()


def test_near_duplicates_hit_their_jaccard():
    rng = random.Random(0)
    words = [f"w{rng.randrange(10_000)}" for _ in range(400)]

    def jaccard(a, b, n=5):
        ga = {tuple(a[i:i + n]) for i in range(len(a) - n + 1)}
        gb = {tuple(b[i:i + n]) for i in range(len(b) - n + 1)}
        return len(ga & gb) / len(ga | gb)

    for target in (0.9, 0.7, 0.5, 0.3):
        near, j = _near_duplicate(words, target, random.Random(1))
        assert j == pytest.approx(jaccard(words, near))
        assert target - 0.03 < j <= target  # one replaced word removes at most 5 of ~400 shingles


def test_pii_pages_carry_counts_the_replacer_finds(tmp_path):
    from lmstack.data.corpus import generated_records
    from lmstack.data.extract import decode_html, html_to_text
    from lmstack.data.pii import PIIReplacer

    recs = [r for r in generated_records(random.Random(0), n_clean=2) if r.labels["kind"] == "pii"]
    assert len(recs) == 12
    for r in recs:
        _, counts = PIIReplacer().replace(html_to_text(decode_html(r.payload)))
        assert counts == r.labels["pii"]


@pytest.mark.slow
def test_demo_reports_precision_and_recall(tmp_path, monkeypatch):
    from lmstack.data.demo import run_demo

    monkeypatch.setenv("LMSTACK_CACHE", str(tmp_path / "cache"))
    report = run_demo(tmp_path, real_limit=0, n_files=2, quiet=True)
    rows = report["filters"]
    assert rows["extract (binary records)"]["recall"] == 1.0
    assert rows["pii (replacements)"]["precision"] == 1.0 and rows["pii (replacements)"]["recall"] == 1.0
    assert rows["gopher_quality"]["precision"] > 0.9 and rows["toxic_filter"]["recall"] > 0.9
    assert json.loads((tmp_path / "filters_report.json").read_text())["funnel"][0]["step"] == "read"
    assert report["survivors_by_kind"].get("clean", 0) >= 25  # clean prose survives the whole chain
