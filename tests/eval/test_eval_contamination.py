"""Contamination tests: the exchangeability test is calibrated on a model that never saw the data and
flags a model trained on it in canonical order; n-gram overlap equals a brute-force search."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmstack.eval.contamination import (
    clean_rescore,
    ngram_overlap,
    normalize_words,
    permutation_test,
    sequence_loglik_batch,
    sharded_test,
    text_chunks,
)
from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer

V = 64


def tiny(seed=0):
    cfg = ModelConfig(
        vocab_size=V,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=128,
        init_std=0.2,
    )
    return Transformer(cfg, seed=seed).eval()


def dataset(seed, n=8, length=5):
    g = np.random.default_rng(seed)
    return [g.integers(1, V, length).tolist() for _ in range(n)]


def test_sequence_loglik_equals_direct_sum():
    model = tiny()
    seq = dataset(0, 6, 7)[0] * 4  # 28 tokens
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([seq]))[0, :-1].double(), -1)
    ref = float(logp.gather(-1, torch.tensor(seq[1:])[:, None]).sum())
    assert sequence_loglik_batch(model, [seq])[0] == pytest.approx(ref, rel=1e-6)
    # longer than the context: strided windows, every token after the first scored once
    long = [int(t) for t in np.random.default_rng(1).integers(0, V, 300)]
    got = sequence_loglik_batch(model, [long], max_length=128)[0]
    assert math.isfinite(got) and got < 0


@pytest.mark.slow
def test_false_positive_rate_under_the_null():
    """A model that never saw the data: canonical order is one exchangeable draw, so p is uniform on
    {1/20, ..., 1} and P(p <= 0.05) = 1/20; over 40 datasets we expect 2 rejections."""
    model = tiny(seed=3)
    ps = [
        permutation_test(model, dataset(100 + r), n_permutations=19, seed=r).p_value
        for r in range(40)
    ]
    rejections = sum(p <= 0.05 for p in ps)
    assert rejections <= 6  # P(Binomial(40, 0.05) >= 7) = 0.003
    assert 0.35 < np.mean(ps) < 0.65  # uniform mean 0.525
    sharded = [
        sharded_test(model, dataset(200 + r, n=12), n_shards=4, n_permutations=5, seed=r)[0]
        for r in range(20)
    ]
    assert sum(p <= 0.05 for p in sharded) <= 4


def test_detects_a_model_trained_on_the_canonical_order():
    torch.manual_seed(0)
    model = tiny(seed=4)
    # (the untouched model's p is a uniform draw, <= 0.05 one time in 20: dataset 7 at n=16 drew 0.01, so 8)
    ex = dataset(8, n=24, length=5)
    canon = torch.tensor([sum(ex, [])])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(60):  # memorise the benchmark file, in its order
        loss = F.cross_entropy(model(canon)[0, :-1], canon[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    r = permutation_test(model, ex, n_permutations=99, seed=0)
    assert r.p_value == pytest.approx(0.01)  # canonical beats all 99 permutations
    untouched = permutation_test(tiny(seed=4), ex, n_permutations=99, seed=0)
    assert untouched.p_value > 0.05
    p, diffs = sharded_test(model, ex, n_shards=6, n_permutations=10)
    assert p < 0.05 and min(diffs) > 0, diffs


def brute_force_flags(items, corpus, n):
    out = []
    for it in items:
        grams = [it[i : i + n] for i in range(len(it) - n + 1)]
        if not grams:
            out.append((None, 0.0))
            continue
        hits = sum(any(corpus[j : j + n] == g for j in range(len(corpus) - n + 1)) for g in grams)
        out.append((hits > 0, hits / len(grams)))
    return out


@pytest.mark.parametrize("n", [3, 13])
def test_ngram_overlap_equals_brute_force(n):
    rng = np.random.default_rng(n)
    words = [f"w{i}" for i in range(30)]
    corpus = [words[i] for i in rng.integers(0, 30, 2000)]
    items = [[words[i] for i in rng.integers(0, 30, rng.integers(2, 40))] for _ in range(30)]
    items += [
        corpus[500 : 500 + 20],
        corpus[995 : 1005 + n],
        corpus[10 : 10 + n - 1],
    ]  # planted; one spans chunks
    chunks = [corpus[i : i + 1000] for i in range(0, len(corpus), 1000)]
    got = ngram_overlap(items, chunks, n=n)
    ref = brute_force_flags(items, corpus, n)
    assert got.flags == [f for f, _ in ref]
    assert got.overlap_fraction == pytest.approx([x for _, x in ref])
    assert got.flags[-3] is True and got.flags[-2] is True


def test_text_normalisation_and_chunks(tmp_path):
    assert normalize_words("The Cat's hat, at 3:00!") == ["the", "cat", "s", "hat", "at", "3", "00"]
    p = tmp_path / "c.txt"
    text = "Alpha beta, GAMMA delta epsilon. " * 50
    p.write_text(text)
    got = sum(text_chunks(p, chunk_chars=37), [])
    assert got == normalize_words(text)


def test_clean_rescore_by_hand():
    samples = [{"acc": 1.0}, {"acc": 0.0}, {"acc": 1.0}, {"acc": 1.0}]
    r = clean_rescore(samples, lambda s: s["acc"], [True, False, None, False])
    assert r == {"all": 0.75, "clean": 0.5, "contaminated": 1.0, "n_clean": 2, "n_contaminated": 1}


def test_canonical_order_scoring_lower_than_permutations_is_not_contamination(monkeypatch):
    """Both tests are one-sided: data the model finds *less* likely in its published order (here a stand-in
    scorer: -1 per adjacent pair in file order, so the canonical order is the least likely of all, plus a
    small deterministic jitter) must get p ≈ 1, never a small p. A two-sided t-test flags it (p ~ 1e-5)."""
    from lmstack.eval import contamination

    def loglik(model, seqs, max_length=None):
        out = []
        for s in seqs:
            follows = sum(b == a + 1 for a, b in zip(s, s[1:]))
            out.append(-10.0 * follows + 0.01 * (sum(s[::3]) % 7))
        return out

    monkeypatch.setattr(contamination, "sequence_loglik_batch", loglik)
    ex = [[i] for i in range(24)]  # 24 one-token examples, token i at position i
    r = permutation_test(None, ex, n_permutations=49, seed=0)
    assert r.canonical_loglik < min(r.permuted_logliks)
    assert r.p_value == 1.0  # (1 + 49) / (1 + 49): every permutation scores at least as high
    p, diffs = sharded_test(None, ex, n_shards=4, n_permutations=6, seed=0)
    assert max(diffs) < 0 and len(set(diffs)) > 1
    from scipy import stats

    assert p == pytest.approx(
        stats.ttest_1samp(diffs, 0.0, alternative="greater").pvalue, rel=1e-12
    )
    assert p > 0.999
