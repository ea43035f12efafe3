"""Speculative decoding inside the batching engine (prompt lookup, Book of LLMs §2.3 “speculative decoding”): greedy output
equals full-recompute greedy token for token while drafts are accepted, under chunked prefill,
preemption and prefix sharing; stop rules and logprobs are unchanged; the sampling rule keeps the
target's distribution (checked against the softmax it should reproduce)."""

import pytest
import torch
from inference_helpers import full_recompute_greedy, full_recompute_greedy_penalized

from lmstack.inference import LLM, LLMEngine, SamplingParams
from lmstack.inference.speculative import verify_drafts

GREEDY = SamplingParams(temperature=0.0, max_tokens=14)


@pytest.fixture(scope="module")
def spec_prompts(prompts):
    # the random prompts plus two that repeat themselves, so prompt lookup has something to find
    return prompts + [[3, 4, 5, 6] * 5, [7, 8] * 9 + [7]]


@pytest.fixture(scope="module")
def spec_reference(model, spec_prompts):
    return [full_recompute_greedy(model, p, GREEDY.max_tokens) for p in spec_prompts]


def all_free(engine):
    a = engine.cache.blocks
    return (
        all(r == 0 for r in a.ref_count)
        and a.num_free == a.num_blocks - 1
        and not engine.cache.blocks.tables
    )


@pytest.mark.parametrize(
    "opts",
    [
        dict(block_size=4, num_blocks=200, max_num_batched_tokens=512),
        dict(
            block_size=4, num_blocks=200, max_num_batched_tokens=7, max_num_seqs=5
        ),  # chunked prefill, small budget
        dict(block_size=4, num_blocks=14, max_num_batched_tokens=32, max_num_seqs=16),  # preemption
        dict(
            block_size=16,
            num_blocks=40,
            max_num_batched_tokens=64,
            max_num_seqs=8,
            num_speculative_tokens=2,
        ),
    ],
    ids=["one-batch", "chunked", "preemption", "block16-k2"],
)
def test_speculative_greedy_equals_full_recompute(model, spec_prompts, spec_reference, opts):
    llm = LLM(model, **{"num_speculative_tokens": 4, **opts})
    outs = llm.generate(spec_prompts, GREEDY)
    assert [o.token_ids for o in outs] == spec_reference
    st = llm.engine.stats
    assert st["spec_accepted"] > 0 and st["spec_proposed"] >= st["spec_accepted"]
    assert st["generated_tokens"] == sum(len(r) for r in spec_reference)
    assert all_free(llm.engine)


@pytest.mark.parametrize("penalty", [0.7, 1.2])
def test_speculative_greedy_with_repetition_penalty_equals_plain(model, spec_prompts, penalty):
    """The repetition penalty reads the history, which grows by each kept draft: the engine's
    verification must penalise row j by the tokens before draft j only. Batched greedy output with
    speculation equals the plainly written penalised reference and the engine without speculation."""
    params = SamplingParams(
        temperature=0.0, max_tokens=14, repetition_penalty=penalty, top_k=4, min_p=0.1
    )
    ps = spec_prompts[-6:]
    ref = [full_recompute_greedy_penalized(model, p, params.max_tokens, penalty) for p in ps]
    spec = LLM(
        model, block_size=4, num_blocks=200, max_num_batched_tokens=64, num_speculative_tokens=4
    )
    assert [o.token_ids for o in spec.generate(ps, params)] == ref
    assert spec.engine.stats["spec_accepted"] > 0
    plain = LLM(model, block_size=4, num_blocks=200, max_num_batched_tokens=64)
    assert [o.token_ids for o in plain.generate(ps, params)] == ref
    assert all_free(spec.engine)


def test_speculation_saves_forwards_on_a_repetitive_sequence(model, spec_prompts, spec_reference):
    """One sequence alone: every accepted draft is one decode forward fewer."""
    prompt, ref = spec_prompts[-1], spec_reference[-1]
    plain, spec = (
        LLM(model, block_size=4, num_blocks=50),
        LLM(model, block_size=4, num_blocks=50, num_speculative_tokens=4),
    )
    for llm in (plain, spec):
        assert llm.generate([prompt], GREEDY)[0].token_ids == ref
    p, s = plain.engine.stats, spec.engine.stats
    assert p["forwards"] == GREEDY.max_tokens  # prefill + 13 decodes
    assert s["forwards"] == p["forwards"] - s["spec_accepted"] and s["spec_accepted"] >= 4


def test_stop_tokens_and_logprobs_under_speculation(model, spec_prompts, spec_reference):
    stop = spec_reference[-2][5]  # a token the repetitive prompt produces mid-way
    params = SamplingParams(temperature=0.0, max_tokens=14, stop_token_ids=[stop], logprobs=2)
    outs = [
        LLM(model, block_size=4, num_blocks=200, num_speculative_tokens=k).generate(
            spec_prompts, params
        )
        for k in (0, 4)
    ]
    for p, o, s in zip(spec_prompts, *outs):
        want = full_recompute_greedy(model, p, 14, stop_ids=[stop])
        assert o.token_ids == s.token_ids == want
        assert (o.finish_reason, len(o.logprobs)) == (s.finish_reason, len(s.logprobs))
        for (a, top_a), (b, top_b) in zip(
            o.logprobs, s.logprobs
        ):  # same distributions at every token
            assert a == pytest.approx(b, abs=1e-9) and top_a.keys() == top_b.keys()


def test_verify_drafts_keeps_the_target_distribution():
    """Monte Carlo against the softmax itself: the first emitted token is distributed as p0, and
    after a kept first draft the second as p1 (the accept/reject rule with a one-hot q)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor(
        [[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 1.5, -0.5, 1.0, 0.3], [1.0, 0.0, 0.0, 0.0, 2.0]]
    )
    p = torch.softmax(logits, dim=-1)
    drafts = [1, 3]
    n = 20000
    first = torch.zeros(5)
    second = torch.zeros(5)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    for _ in range(n):
        out, _ = verify_drafts(logits, drafts, params, [0], g)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    torch.testing.assert_close(first / n, p[0], atol=0.012, rtol=0)
    torch.testing.assert_close(second / second.sum(), p[1], atol=0.02, rtol=0)
    # greedy: drafts are kept while they are the argmax, then the argmax follows
    assert verify_drafts(logits, [0, 1], SamplingParams(temperature=0.0), [], None) == (
        [0, 1, 4],
        2,
    )
    assert verify_drafts(logits, [2, 1], SamplingParams(temperature=0.0), [], None) == ([0], 0)
    with pytest.raises(ValueError, match="k\\+1=3 rows"):
        verify_drafts(logits[:2], drafts, params, [], g)


def test_verify_drafts_penalises_each_row_by_the_drafts_before_it():
    """Greedy, repetition penalty 2, history [0], drafts [1, 2] (not in the history, unlike
    prompt-lookup drafts, for which adding a draft to the history changes nothing). Worked by hand:
    row 0, token 0 penalised: [1.5, 2, 0, 0] -> 1 = draft 1, kept; row 1, tokens 0, 1 penalised:
    [0, 0, 1, 0.9] -> 2 = draft 2, kept; row 2, tokens 0, 1, 2 penalised: [0, 0, 0.5, 0.8] -> 3.
    Penalising row j by draft j itself rejects draft 1 (row 0 -> [1.5, 1, 0, 0] -> 0)."""
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.9], [0.0, 0.0, 1.0, 0.8]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert verify_drafts(logits, [1, 2], params, [0], None) == ([1, 2, 3], 2)
    assert verify_drafts(logits, [0, 2], params, [0], None) == (
        [1],
        0,
    )  # draft 0 is not the penalised argmax


def test_engine_rejects_bad_speculation_options(model):
    with pytest.raises(ValueError, match="num_speculative_tokens=-1"):
        LLMEngine(model, num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="ngram=\\(1, 2\\)"):
        LLMEngine(model, num_speculative_tokens=2, ngram=(1, 2))


def test_sampled_requests_with_speculation_run_to_completion(model, spec_prompts):
    """Sampling (temperature, top-p, repetition penalty) through the engine's accept/reject path:
    every request ends by length with valid ids, drafts were both kept and rejected, and every
    block is free afterwards (a rejected draft's slots never leak). The tiny random model rarely
    agrees with a prompt-lookup draft (about 1 in 100), so four seed sets are pooled."""
    accepted = proposed = 0
    for base in range(0, 400, 100):
        params = [
            SamplingParams(
                temperature=t, top_p=0.9, repetition_penalty=r, max_tokens=12, seed=base + i
            )
            for i, (t, r) in enumerate([(0.3, 1.0), (1.0, 1.1)] * (len(spec_prompts) // 2))
        ]
        llm = LLM(
            model, block_size=4, num_blocks=60, max_num_batched_tokens=24, num_speculative_tokens=4
        )
        outs = llm.generate(spec_prompts[: len(params)], params)
        assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)
        assert all(0 <= t < model.config.vocab_size for o in outs for t in o.token_ids)
        accepted += llm.engine.stats["spec_accepted"]
        proposed += llm.engine.stats["spec_proposed"]
        assert all_free(llm.engine)
    assert 0 < accepted < proposed
