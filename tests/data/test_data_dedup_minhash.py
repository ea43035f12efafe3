"""MinHash and LSH statistics against their formulas and against datasketch; the on-disk merge against numpy.

References: the exact Jaccard similarity of sets built to have it; the MinHash standard error
sqrt(J (1 - J) / k) (Broder 1997); the LSH candidate probability 1 - (1 - s^r)^b (Mining of Massive
Datasets, 3.4); datasketch's MinHash on the same word 5-grams; numpy's sort of everything for the k-way merge;
a brute-force dict of band hashes for the bucket stage; datatrove's simplify_text for the normalisation.
"""

import random

import numpy as np
import pytest

from lmstack.data.dedup.minhash import (
    MinHashConfig,
    MinHasher,
    jaccard,
    minhash_buckets,
    minhash_signatures,
)
from lmstack.data.dedup.normalize import normalize, words
from lmstack.data.dedup.runs import load_array, merge_runs, node, write_run
from lmstack.data.document import Document


def pair_with_jaccard(rng, s: float, union: int = 1000):
    """Two random uint64 sets with |A ∪ B| = union and Jaccard exactly c / union, c = round(s * union),
    the rest split evenly between A only and B only."""
    c = int(round(s * union))
    only = (union - c) // 2
    vals = rng.choice(np.iinfo(np.int64).max, size=c + 2 * only, replace=False).astype(np.uint64)
    common, a_only, b_only = vals[:c], vals[c : c + only], vals[c + only :]
    a, b = np.unique(np.concatenate([common, a_only])), np.unique(np.concatenate([common, b_only]))
    return a, b, c / (c + 2 * only)


def test_jaccard_is_exact():
    rng = np.random.default_rng(0)
    for s in (0.0, 0.3, 0.8, 1.0):
        a, b, j = pair_with_jaccard(rng, s, 200)
        sa, sb = set(a.tolist()), set(b.tolist())
        assert jaccard(a, b) == pytest.approx(len(sa & sb) / len(sa | sb))
        assert jaccard(a, b) == pytest.approx(j)
    assert jaccard(np.empty(0, np.uint64), np.empty(0, np.uint64)) == 0.0


def test_minhash_error_shrinks_as_one_over_sqrt_k():
    """Over 150 pairs with J in [0.1, 0.9]: the RMS error of the estimate is within 25% of
    sqrt(mean J(1-J) / k) for k = 16, 64, 256, so it shrinks 4x from k=16 to k=256, and there is no bias."""
    rng = np.random.default_rng(1)
    pairs = [pair_with_jaccard(rng, s, 600) for s in rng.uniform(0.1, 0.9, 150)]
    rms = {}
    for k in (16, 64, 256):
        h = MinHasher(MinHashConfig(bands=k, rows=1, seed=7))
        errs, var = [], []
        for a, b, j in pairs:
            sa, sb = h.signatures([a, b])
            errs.append(h.estimate(sa, sb) - j)
            var.append(j * (1 - j) / k)
        rms[k] = float(np.sqrt(np.mean(np.square(errs))))
        theory = float(np.sqrt(np.mean(var)))
        assert 0.75 * theory < rms[k] < 1.25 * theory, (k, rms[k], theory)
        assert abs(np.mean(errs)) < 3 * theory / np.sqrt(len(pairs)), (k, np.mean(errs))
    assert 3.0 < rms[16] / rms[256] < 5.3, rms


def _text_pair(rng: random.Random, vocab, n_words: int, frac: float):
    a = [rng.choice(vocab) for _ in range(n_words)]
    b = list(a)
    for i in rng.sample(range(n_words), int(frac * n_words)):
        b[i] = rng.choice(vocab)
    return " ".join(a), " ".join(b).upper()


def test_minhash_agrees_with_datasketch():
    """datasketch's MinHash over the same word 5-gram strings (its own hashes and permutations): the exact
    Jaccard of the string sets equals ours on the hashed sets, and both estimators have the same error
    statistics (mean absolute error within 30% of each other, both near the standard error)."""
    datasketch = pytest.importorskip("datasketch")
    rng = random.Random(0)
    vocab = [
        "".join(rng.choice("abcdefghijklmnopqrst") for _ in range(rng.randint(2, 8)))
        for _ in range(3000)
    ]
    k = 128
    h = MinHasher(MinHashConfig(bands=16, rows=8, seed=3))
    ours, theirs, exact, se = [], [], [], []
    for _i in range(120):
        ta, tb = _text_pair(rng, vocab, 200, rng.uniform(0.0, 0.25))
        grams = []
        for t in (ta, tb):
            w = words(t)
            grams.append({" ".join(w[j : j + 5]) for j in range(len(w) - 4)})
        j_strings = len(grams[0] & grams[1]) / len(grams[0] | grams[1])
        a, b = h.shingles(ta), h.shingles(tb)
        assert jaccard(a, b) == pytest.approx(j_strings)
        sa, sb = h.signatures([a, b])
        ours.append(h.estimate(sa, sb))
        ma, mb = datasketch.MinHash(num_perm=k, seed=1), datasketch.MinHash(num_perm=k, seed=1)
        ma.update_batch([g.encode() for g in grams[0]])
        mb.update_batch([g.encode() for g in grams[1]])
        theirs.append(ma.jaccard(mb))
        exact.append(j_strings)
        se.append(np.sqrt(j_strings * (1 - j_strings) / k))
    ours, theirs, exact = map(np.array, (ours, theirs, exact))
    mae_ours, mae_theirs = np.abs(ours - exact).mean(), np.abs(theirs - exact).mean()
    expected = np.sqrt(2 / np.pi) * np.mean(se)  # E|N(0, se^2)| = se sqrt(2/pi)
    assert abs(mae_ours - mae_theirs) < 0.3 * max(mae_ours, mae_theirs), (mae_ours, mae_theirs)
    for mae in (mae_ours, mae_theirs):
        assert 0.7 * expected < mae < 1.3 * expected, (mae, expected)
    assert np.corrcoef(ours, theirs)[0, 1] > 0.95


@pytest.mark.parametrize("bands,rows", [(14, 8), (20, 5)])
def test_lsh_candidate_probability(bands, rows):
    """Over 300 random pairs at each similarity s, the fraction sharing a band agrees with
    1 - (1 - s^r)^b within 4 binomial standard deviations + 0.02 (seeded: the same draw every run)."""
    cfg = MinHashConfig(bands=bands, rows=rows, seed=11)
    h = MinHasher(cfg)
    rng = np.random.default_rng(bands)
    n = 300
    for s in (0.4, 0.55, 0.65, 0.72, 0.8, 0.9):
        hits, js = 0, []
        for _ in range(n):
            a, b, j = pair_with_jaccard(rng, s, 400)
            js.append(j)
            bh = h.band_hashes(h.signatures([a, b]))
            hits += bool((bh[0] == bh[1]).any())
        p = float(np.mean(cfg.candidate_probability(np.array(js))))
        tol = 4 * np.sqrt(p * (1 - p) / n) + 0.02
        assert abs(hits / n - p) < tol, (s, hits / n, p, tol)


def test_signatures_of_a_batch_equal_one_at_a_time():
    """The batched product (documents chunked, a long one in parts) gives each set's own minima."""
    rng = np.random.default_rng(5)
    h = MinHasher()
    sets = [
        np.unique(rng.integers(0, 2**63, size=n).astype(np.uint64))
        for n in (3, 0, 5000, 1, 700, 2100, 40)
    ]
    batch = h.signatures(sets)
    for s, row in zip(sets, batch):
        if len(s) == 0:
            assert (row == 0xFFFFFFFF).all()
            continue
        x = s >> np.uint64(32)  # the 32-bit keys
        ref = ((x[:, None] * h.a + h.b).min(axis=0) >> np.uint64(32)).astype(
            np.uint32
        )  # one set, no chunks
        np.testing.assert_array_equal(row, ref)


def test_merge_runs_equals_a_global_sort(tmp_path):
    """Runs with many equal keys, merged with a 3-record block (many rounds, carried groups): the output is
    numpy's sort of everything, within a key range too, and no group of equal keys is split."""
    rng = np.random.default_rng(2)
    all_k, all_v, paths = [], [], []
    for t in range(5):
        k = rng.integers(0, 20, size=rng.integers(0, 40)).astype(np.uint64)
        v = node(t, np.arange(len(k)))
        paths.append(write_run(tmp_path / f"{t}.npy", k, v))
        all_k.append(k)
        all_v.append(v)
    k, v = np.concatenate(all_k), np.concatenate(all_v)
    order = np.lexsort((v, k))
    for lo, hi in ((0, None), (5, 12)):
        blocks = list(merge_runs(paths, lo, hi, block=3))
        got_k = np.concatenate([b[0] for b in blocks])
        got_v = np.concatenate([b[1] for b in blocks])
        sel = (k[order] >= lo) & (k[order] < (hi if hi is not None else 1 << 63))
        np.testing.assert_array_equal(got_k, k[order][sel])
        np.testing.assert_array_equal(got_v, v[order][sel])
        last = [int(b[0][-1]) for b in blocks[:-1]]
        first = [int(b[0][0]) for b in blocks[1:]]
        assert all(x < y for x, y in zip(last, first))


def test_bucket_pairs_match_brute_force(tmp_path):
    """The bucket stage's candidate pairs are exactly the pairs of documents with an equal band hash
    (a brute-force dict over all band hashes), with buckets of 2, 3 and 40 documents."""
    rng = random.Random(4)
    vocab = ["".join(rng.choice("abcdefgh") for _ in range(5)) for _ in range(400)]
    base = [" ".join(rng.choice(vocab) for _ in range(60)) for _ in range(6)]
    shards = [
        [Document(base[0], "a"), Document(base[1], "b"), Document(base[2] + " x", "c")],
        [Document(base[0] + " tail words here", "d"), Document(base[3], "e")]
        + [Document(base[4], f"f{i}") for i in range(20)],
        [Document(base[4], f"g{i}") for i in range(20)]
        + [Document(base[2], "h"), Document(base[5], "i")],
    ]
    cfg = MinHashConfig(bands=10, rows=2, max_group=3)
    h = MinHasher(cfg)
    buckets: dict = {}
    for t, docs in enumerate(shards):
        minhash_signatures(docs, tmp_path, t, cfg, batch=4)
        bh = h.band_hashes(h.signatures([h.shingles(d.text) for d in docs]))
        for i in range(len(docs)):
            for band in range(cfg.bands):
                buckets.setdefault((band, int(bh[i, band])), []).append(int(node(t, i)))
    for task in range(3):  # bands 0, 3, 6, 9 / 1, 4, 7 / 2, 5, 8
        minhash_buckets(tmp_path, task, 3, cfg, block=5)
        got = {
            (int(a), int(b)) for a, b in load_array(tmp_path / "pairs" / f"{task:05d}.npy").tolist()
        }
        want = set()
        for (bd, _), members in buckets.items():
            if bd % 3 != task or len(members) < 2:
                continue
            m = sorted(members)
            if len(m) <= cfg.max_group:
                want |= {(x, y) for i, x in enumerate(m) for y in m[i + 1 :]}
            else:  # a large bucket: star from its first member + chain
                want |= {(m[0], y) for y in m[1:]} | {(x, y) for x, y in zip(m[1:], m[2:])}
        assert got == want, task


def test_normalize_matches_datatrove():
    """Our normalize() equals datatrove's simplify_text (numbers not folded) on punctuation, symbols,
    accents, case and whitespace."""
    text_mod = pytest.importorskip("datatrove.utils.text")
    cfg = text_mod.TextNormConfig(norm_numbers=False)
    for t in [
        "Hello, World!  It's 3.5% — “quoted” «fr»\tnaïve café_x",
        "$100 a+b=c #tag @user (p) [s] {c} 10:30 a/b",
        "Ünïcödé ÅNGSTRÖM Crème Brûlée\n\nnext   para",
        "   ",
        "e\u0301te\u0301 decomposed",
        "snake_case-and-dash",
    ]:
        assert normalize(t) == text_mod.simplify_text(t, cfg), t
    assert normalize("  Crème   Brûlée, s'il vous plaît!\n") == "creme brulee s il vous plait"


def test_bad_config_names_the_value(tmp_path):
    with pytest.raises(ValueError, match="threshold=0"):
        MinHashConfig(threshold=0)
    with pytest.raises(ValueError, match="bands=0"):
        MinHashConfig(bands=0)
    with pytest.raises(FileNotFoundError, match="did the previous stage run"):
        minhash_buckets(tmp_path, 0, 1)
