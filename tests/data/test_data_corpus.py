"""The offline crawl: WARC records readable by warcio, labels beside them, near-duplicates at the Jaccard they
claim (recomputed here from the texts), PII counts the replacer finds exactly, and the demo's report."""

import random

import pytest

pytest.importorskip("warcio")

from lmstack.data.corpus import _near_duplicate, read_labels, write_corpus


def test_corpus_writes_warc_and_labels(tmp_path):
    from warcio.archiveiterator import ArchiveIterator

    summary = write_corpus(
        tmp_path, n_files=2, real_limit=0
    )  # generated pages only: works with no docs on disk
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
    assert {
        "clean",
        "exact_duplicate",
        "near_duplicate",
        "binary",
        "pii",
        "very_short",
        "very_long",
        "wrong_encoding",
        "keyword_spam",
        "boilerplate_heavy",
        "nsfw",
        "toxic",
    } <= kinds
    again = tmp_path / "again"
    write_corpus(again, n_files=2, real_limit=0)
    for f in sorted(tmp_path.glob("*.warc.gz")):  # deterministic: the same bytes on every run
        assert f.read_bytes() == (again / f.name).read_bytes()


def test_near_duplicates_hit_their_jaccard():
    rng = random.Random(0)
    words = [f"w{rng.randrange(10_000)}" for _ in range(400)]

    def jaccard(a, b, n=5):
        ga = {tuple(a[i : i + n]) for i in range(len(a) - n + 1)}
        gb = {tuple(b[i : i + n]) for i in range(len(b) - n + 1)}
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
def test_demo_runs_the_pipeline_on_a_tiny_crawl(tmp_path, monkeypatch):
    """`lmstack data demo --tiny` end to end (one worker): the planted labels are the reference."""
    from lmstack.data.demo import run_demo
    from lmstack.tokenizer import read_sidecar

    monkeypatch.setenv("LMSTACK_CACHE", str(tmp_path / "cache"))
    report = run_demo(tmp_path, n_files=2, quiet=True, workers=1, tiny=True)
    rows, piped = report["filters"], report["pipeline"]
    assert rows["extract (binary records)"]["recall"] == 1.0
    assert (
        rows["pii (replacements)"]["precision"] == 1.0
        and rows["pii (replacements)"]["recall"] == 1.0
    )
    assert rows["gopher_quality"]["precision"] > 0.9 and rows["toxic_filter"]["recall"] > 0.9
    # 8 exact copies of 8 clean pages: exactly one of each pair goes; the near copies at J >= 0.8 go too
    assert piped["exact_filter"]["flagged"] == 8
    assert piped["exact_filter"]["precision"] == 1.0 and piped["exact_filter"]["recall"] == 1.0
    assert piped["minhash_filter"]["precision"] == 1.0 and piped["minhash_filter"]["recall"] == 1.0
    chain = report["chain"]
    assert chain["duplicate_groups_left_with_one"] == chain["duplicate_groups"] > 0
    assert chain["wanted_generated_kept"] == 1.0 and chain["unwanted_generated_removed"] > 0.9
    assert [f["step"] for f in report["funnel"]][:3] == ["input", "warc_reader", "extract"]
    tokens = sorted((tmp_path / "tokens").glob("*.bin"))
    assert len(tokens) == 2 and sum(read_sidecar(t).n_tokens for t in tokens) == chain["tokens"] > 0
    assert (tmp_path / "funnel.png").read_bytes()[:4] == b"\x89PNG"
