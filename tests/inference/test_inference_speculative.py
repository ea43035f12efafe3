"""Speculative decoding (Book of LLMs §2.3 “speculative decoding”): greedy output identical to the target alone, and the
sampled distribution equal to the target's (statistical tests)."""

import pytest
import torch
from inference_helpers import (
    full_recompute_greedy,
    full_recompute_greedy_penalized,
    greedy,
    make_model,
    speculate,
)

from lmstack.inference import DraftModel, PromptLookup, SamplingParams, generate, truncated_draft
from lmstack.inference.speculative import ngram_propose, rejection_sample

# χ² critical values at significance 0.001 (standard tables): df -> value
CHI2_999 = {3: 16.266}


def chi2(counts, probs):
    n = counts.sum()
    return float(((counts - n * probs) ** 2 / (n * probs)).sum())


@pytest.fixture(scope="module")
def target():
    return make_model(n_layers=4, seed=1)


@pytest.fixture(scope="module")
def greedy_refs(target, prompts):
    return {i: full_recompute_greedy(target, prompts[i], 20) for i in (0, 8, 11, 12)}


@pytest.mark.parametrize(
    "proposer,k", [("truncated", 1), ("truncated", 4), ("small-model", 3), ("ngram", 4)]
)
def test_greedy_identical_to_target(target, prompts, greedy_refs, proposer, k):
    draft = {
        "truncated": truncated_draft(target, 1),
        "small-model": make_model(n_layers=1, seed=7),
        "ngram": None,
    }[proposer]
    for i, ref in greedy_refs.items():
        out, stats = speculate(target, prompts[i], 20, draft=draft, k=k)
        assert out == ref
        assert stats.target_forwards <= 20 and stats.tokens_per_target_forward >= 1
        assert 0 <= stats.acceptance_rate <= 1


REPETITIVE = [[3, 4, 5, 6] * 4, [7, 8] * 7 + [7], [10, 20, 30, 10, 20, 40, 10, 20]]


@pytest.mark.parametrize(
    "proposer,k,penalty",
    [
        ("truncated", 3, 1.3),
        ("truncated", 1, 1.3),
        ("truncated", 4, 0.7),
        ("small-model", 2, 1.3),
        ("ngram", 4, 0.7),
    ],
)  # (a penalty > 1 discourages the repeats prompt lookup proposes: it would keep no draft)
def test_greedy_with_repetition_penalty_identical_to_target(target, prompts, proposer, k, penalty):
    """The penalty reads the history, which grows by each draft: row j of the target's verify pass
    must be penalised by the tokens before draft j only (not by draft j itself). Greedy output
    equals plain greedy under the same penalty (the plainly written reference and ``generate``),
    with drafts kept along the way; the filters (top-k, top-p, min-p) ride along."""
    draft = {
        "truncated": truncated_draft(target, 2),
        "small-model": make_model(n_layers=1, seed=7),
        "ngram": None,
    }[proposer]
    params = SamplingParams(
        temperature=0.0, repetition_penalty=penalty, top_k=5, top_p=0.8, min_p=0.05
    )
    accepted = 0
    for p in [prompts[8], prompts[11]] + REPETITIVE:
        ref = full_recompute_greedy_penalized(target, p, 16, penalty)
        assert list(generate(target, p, greedy(16, repetition_penalty=penalty))) == ref
        out, stats = speculate(target, p, 16, params, draft=draft, k=k)
        assert out == ref, p
        accepted += stats.accepted
    assert accepted > 0  # drafts were kept, so rows after a draft were checked


def test_stop_ids_end_speculative_generation(target, prompts, greedy_refs):
    ref = greedy_refs[8]
    out, _ = speculate(target, prompts[8], 20, draft=truncated_draft(target, 2), stop_ids=[ref[6]])
    assert out == ref[: ref.index(ref[6]) + 1]


def test_ngram_proposals():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 3) == [
        9,
        1,
        2,
    ]  # longest suffix [1,2,3] seen before
    assert ngram_propose([5, 6, 7, 8], 2) == []
    assert ngram_propose([4, 4, 4], 2) == [4]


def test_rejection_sampling_outputs_p():
    """One verification step: the first emitted token is distributed exactly as p (not q)."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    n = 8000
    counts = torch.zeros(4)
    accepted = 0
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=g))
        out, acc = rejection_sample(p, q, [x], g)
        counts[out[0]] += 1
        accepted += acc
    assert chi2(counts, p[0]) < CHI2_999[3]
    alpha = float(torch.minimum(p[0], q[0]).sum())  # CS336 notes: α = Σ min(p, q)
    assert abs(accepted / n - alpha) < 0.03


def chi2_quantile_999(df: int) -> float:
    """The 0.999 quantile of χ²(df) by the Wilson–Hilferty cube approximation (z_0.999 = 3.0902);
    slightly above the tables for df >= 10 (df 15: 37.84 vs 37.697; df 50: 86.74 vs 86.661), i.e.
    a significance a little under 0.001."""
    a = 2 / (9 * df)
    return df * (1 - a + 3.0902 * a**0.5) ** 3


def test_speculative_sampling_is_lossless_end_to_end():
    """``generate`` with a ``DraftModel`` samples exactly the target's distribution:
    the first token is distributed as p(x1) and the first two as p(x1) p(x2 | x1), computed from
    the target alone (temperature 1.5, V = 16, every p(x1) >= 0.016).

    The draft is far from the target (total variation 1 - α = 0.52, α = Σ min(p, q)) but not
    disjoint: the textbook bug — resampling from p instead of the residual max(0, p − q) at a
    rejection — emits P_bug(x) = min(p, q)(x) + (1 − α) p(x), which equals p only when α is 0 or 1.

    Power, first-token χ² test (df 15, critical value 37.70 at significance 0.001), n = 2,500
    draws: the non-centrality is λ = n Σ (P_bug − p)² / p = 2,500 × 0.154 ≈ 385, and a χ²(15, λ)
    variable (mean 15 + λ = 400, sd √(2(15 + 2λ)) ≈ 40) exceeds 37.70 with probability ≈ 1
    (9 sd below the mean); the test re-derives λ from the models and also checks the power by
    simulating 2,000 multinomial samples of size n from P_bug. The joint test (cells with an
    expected count under 5 pooled into one) has the same n. False alarm rate: 0.002 for both.
    """
    V, n = 16, 2500
    tgt = make_model(vocab_size=V, n_layers=2, seed=5, init_std=0.2)
    dft = make_model(vocab_size=V, n_layers=1, seed=27, init_std=0.2)
    prompt = [1, 2, 0]
    params = SamplingParams(temperature=1.5)
    with torch.no_grad():
        p1 = torch.softmax(tgt(torch.tensor([prompt]))[0, -1] / 1.5, -1)
        q1 = torch.softmax(dft(torch.tensor([prompt]))[0, -1] / 1.5, -1)
        cond = torch.stack(
            [torch.softmax(tgt(torch.tensor([prompt + [a]]))[0, -1] / 1.5, -1) for a in range(V)]
        )
    joint = p1[:, None] * cond  # (V, V): p(x1) p(x2 | x1)
    alpha = float(torch.minimum(p1, q1).sum())
    assert 0.3 < 1 - alpha < 0.8 and float(p1.min()) > 0.015
    # power against the textbook bug, from the models' own p and q
    p_bug = torch.minimum(p1, q1) + (1 - alpha) * p1
    crit = 37.697  # χ²(15) at 0.999, tables
    assert n * float(((p_bug - p1) ** 2 / p1).sum()) > 300
    g = torch.Generator().manual_seed(0)
    sims = torch.stack(
        [
            torch.bincount(torch.multinomial(p_bug, n, replacement=True, generator=g), minlength=V)
            for _ in range(2000)
        ]
    ).double()
    power = float((((sims - n * p1) ** 2 / (n * p1)).sum(-1) > crit).double().mean())
    assert power > 0.99
    counts = torch.zeros(V, V, dtype=torch.float64)
    for seed in range(n):
        out, _ = speculate(tgt, prompt, 4, params, draft=dft, k=3, seed=seed)
        counts[out[0], out[1]] += 1
    assert chi2(counts.sum(1), p1.double()) < crit
    expected = (n * joint).flatten().double()
    big = expected >= 5
    pooled_counts = torch.cat([counts.flatten()[big], counts.flatten()[~big].sum()[None]])
    pooled_p = torch.cat([joint.flatten()[big], joint.flatten()[~big].sum()[None]]).double()
    assert chi2(pooled_counts, pooled_p) < chi2_quantile_999(len(pooled_p) - 1)


def test_errors(target):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        PromptLookup(-1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        DraftModel(target, 0)
    with pytest.raises(ValueError, match="vocab_size"):
        speculate(target, [1], 3, draft=make_model(vocab_size=50))
    with pytest.raises(ValueError, match="max_seq_len"):
        speculate(target, [1] * 250, 10)
    with pytest.raises(ValueError, match="n_layers"):
        truncated_draft(target, 9)


@pytest.mark.parametrize("strategy", ["static", "static-compiled", "recompute"])
def test_speculation_is_a_strategy_of_every_batch1_step(target, prompts, greedy_refs, strategy):
    """Speculation rides on the static decoder (eager, and compiled: its one-token steps call the captured
    graph while verification runs eagerly over the same cache, rolled back by ``truncate``) and on full
    recomputation too (one loop, step strategies): greedy output equals the plainly written full-recompute
    reference, drafts kept."""
    from lmstack.inference.static import StaticDecoder

    kw = (
        dict(decoder=StaticDecoder(target, 64, compile=strategy == "static-compiled"))
        if strategy.startswith("static")
        else dict(use_cache=False)
    )
    kept = 0
    for i, ref in greedy_refs.items():
        for spec in (DraftModel(truncated_draft(target, 2), 3), PromptLookup(4)):
            assert list(generate(target, prompts[i], greedy(20), speculation=spec, **kw)) == ref
            kept += spec.stats.accepted
    assert kept > 0
