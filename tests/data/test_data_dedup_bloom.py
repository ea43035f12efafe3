"""The Bloom filter against its formulas (hand-worked sizes, the measured false-positive rate against the
target p and against (1 - e^(-kn/m))^k), and the paragraph dedup step on hand-written documents."""

import math

import numpy as np
import pytest

from lmstack.data.dedup.bloom import BloomFilter, BloomParagraphDedup, bloom_size
from lmstack.data.document import Document
from lmstack.data.step import StepStats


def test_bloom_size_hand_worked():
    # n = 1000, p = 1%: m = ceil(1000 * 4.60517 / 0.480453) = ceil(9585.06) = 9586, k = round(9.586 * 0.693) = 7
    assert bloom_size(1000, 0.01) == (9586, 7)
    # p = 0.1%: m = ceil(1000 * 6.90776 / 0.480453) = 14378, k = round(14.378 * 0.693) = 10
    assert bloom_size(1000, 0.001) == (14378, 10)
    with pytest.raises(ValueError, match="p=1.5"):
        bloom_size(10, 1.5)
    with pytest.raises(ValueError, match="n=0"):
        bloom_size(0, 0.1)


@pytest.mark.parametrize("p", [0.01, 0.001])
def test_false_positive_rate_near_target(p):
    """n = 20000 random items in, 400000 others asked: no false negative; the false-positive rate is within
    4 binomial standard deviations of (1 - e^(-kn/m))^k and within 15% of the target p."""
    n, q = 20_000, 400_000
    rng = np.random.default_rng(0)
    items = rng.choice(np.iinfo(np.int64).max, size=n + q, replace=False).astype(np.uint64)
    f = BloomFilter(n, p)
    assert not f.add(items[:n]).any()
    assert f.contains(items[:n]).all()
    fp = float(f.contains(items[n:]).mean())
    theory = (1 - math.exp(-f.k * n / f.m)) ** f.k
    assert abs(fp - theory) < 4 * math.sqrt(theory * (1 - theory) / q), (fp, theory)
    assert abs(fp - p) < 0.15 * p, (fp, p)
    assert f.fill_ratio() == pytest.approx(
        1 - math.exp(-f.k * n / f.m), abs=0.01
    )  # about half the bits for optimal k


def test_add_reports_repeats_within_one_call(tmp_path):
    f = BloomFilter(100, 0.01)
    assert f.add(np.array([5, 9, 5], np.uint64)).tolist() == [False, False, True]
    assert f.add(np.array([9, 11], np.uint64)).tolist() == [True, False]
    f.save(tmp_path / "f.npy")
    g = BloomFilter.load(tmp_path / "f.npy", 0.01)
    assert g.contains(np.array([5, 9, 11], np.uint64)).all()
    np.testing.assert_array_equal(g.bits, f.bits)


def test_paragraph_dedup():
    """The first occurrence of each paragraph (compared normalised) survives, later ones are removed from
    every document with the blank-line separators of what is left; a document with nothing new is dropped."""
    docs = [
        Document("Intro paragraph.\n\nSubscribe to our newsletter!\n\nBody one.", "a"),
        Document("SUBSCRIBE to our newsletter\n\nBody two, new.\n\n\nIntro paragraph", "b"),
        Document("Body one.\n\n---\n\nsubscribe, to our newsletter.", "c"),
        Document("Fresh text\n\nfresh text.", "d"),
    ]
    stats = StepStats("bloom")
    out = list(BloomParagraphDedup(n=1000, p=1e-6)(docs, stats))
    assert [(d.id, d.text) for d in out] == [
        ("a", "Intro paragraph.\n\nSubscribe to our newsletter!\n\nBody one."),
        ("b", "Body two, new."),
        ("d", "Fresh text"),
    ]
    assert dict(stats.dropped) == {"duplicate_paragraphs_only": 1}
    assert stats.counters["paragraphs_removed"] == 5


def test_paragraph_dedup_matches_an_exact_set():
    """With p = 1e-9 the Bloom step's output equals an exact dedup with a Python set of the normalised
    paragraphs seen so far, on 300 random documents whose paragraphs repeat."""
    import random
    import re

    from lmstack.data.dedup.normalize import normalize

    rng = random.Random(0)
    pool = [
        " ".join(
            rng.choice(["red", "green", "blue", "cyan", "black"]) for _ in range(rng.randint(1, 6))
        )
        for _ in range(150)
    ]
    docs = [
        Document(
            "\n\n".join(
                rng.choice(pool).capitalize() + rng.choice(["", ".", "!"])
                for _ in range(rng.randint(1, 6))
            ),
            str(i),
        )
        for i in range(300)
    ]
    got = {d.id: d.text for d in BloomParagraphDedup(n=5000, p=1e-9)(docs)}
    seen: set[str] = set()
    for d in docs:
        kept = []
        for para in re.split(r"\n\n", d.text):
            key = normalize(para)
            if key and key in seen:
                continue
            seen.add(key)
            kept.append(para)
        if kept:
            assert got[d.id] == "\n\n".join(kept)
        else:
            assert d.id not in got
