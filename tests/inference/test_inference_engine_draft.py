"""Draft-model speculation inside the batching engine (Book of LLMs §2.3 “speculative decoding”, ``DraftRunner``): greedy output
equals the target's full recompute (no cache, the whole sequence rerun per token) across chunked
prefill, preemption, block sizes and aborts, with the target's first layers as the draft or an
independent model; sampled output keeps the target's distribution (exact softmax probabilities
computed by hand from the target's full forwards); every draft block comes back."""

import pytest
import torch
from inference_helpers import full_recompute_greedy, make_model

from lmstack.inference import LLM, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=14)


@pytest.fixture(scope="module")
def draft_prompts(prompts):
    return prompts[::2] + [[3, 4, 5, 6] * 5]


@pytest.fixture(scope="module")
def reference(model, draft_prompts):
    return [full_recompute_greedy(model, p, GREEDY.max_tokens) for p in draft_prompts]


def all_free(engine):
    for blocks in (engine.cache.blocks, engine.speculator.cache.blocks):
        if blocks.num_free != blocks.num_blocks - 1 or blocks.tables:
            return False
    return not engine.speculator.fed


OPTS = {
    "one-batch": dict(block_size=4, num_blocks=200),
    "chunked": dict(block_size=4, num_blocks=200, max_num_batched_tokens=7, max_num_seqs=5),
    "preemption": dict(block_size=4, num_blocks=14, max_num_batched_tokens=32, max_num_seqs=16),
    "block16-k2": dict(block_size=16, num_blocks=40, num_speculative_tokens=2),
}


@pytest.mark.parametrize("opts", OPTS.values(), ids=OPTS.keys())
@pytest.mark.parametrize("draft", ["truncated", "independent"])
def test_draft_greedy_equals_full_recompute(model, draft_prompts, reference, opts, draft):
    d = 1 if draft == "truncated" else make_model(n_layers=1, seed=7)
    llm = LLM(model, draft_model=d, **{"num_speculative_tokens": 3, **opts})
    outs = llm.generate(draft_prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    st = llm.engine.stats
    assert st["spec_proposed"] > 0 and st["spec_proposed"] >= st["spec_accepted"]
    if draft == "truncated":  # the target's own first layer agrees with it often
        assert st["spec_accepted"] > 0
        assert st["forwards"] < sum(map(len, reference))  # fewer target forwards than tokens
    if opts is OPTS["preemption"]:
        assert st["preemptions"] > 0
    assert all_free(llm.engine)


def test_abort_mid_speculation_frees_the_draft_blocks(model, draft_prompts, reference):
    engine = LLMEngine(model, block_size=4, num_blocks=200, num_speculative_tokens=3, draft_model=1)
    ids = [engine.add_request(None, p, GREEDY) for p in draft_prompts]
    done = {}
    for step in range(100):
        if step == 3:
            assert engine.speculator.fed  # the draft holds K/V for running sequences
            assert engine.abort_request(ids[1]) and engine.abort_request(ids[-1])
            assert ids[1] not in engine.speculator.fed
            assert ids[1] not in engine.speculator.cache.blocks.tables
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    kept = [i for i in range(len(ids)) if i not in (1, len(ids) - 1)]
    assert [done[ids[i]].token_ids for i in kept] == [reference[i] for i in kept]
    assert ids[1] not in done and ids[-1] not in done  # aborted: no output from step()
    assert all_free(engine)


@pytest.mark.slow
def test_sampled_draft_keeps_the_target_distribution():
    """Monte Carlo against exact probabilities: a 5-token vocabulary, random models (init
    std 0.1), the draft an independent model (q ≠ p). The first two tokens (t1 from the prefill, t2
    through one draft and the accept/reject rule with q) follow p(t1)·p(t2 | t1), computed from the
    target's own full forwards. The acceptance rate of draft 2 is α = Σ_t1 p(t1) Σ_x min(p(x), q(x))
    (Leviathan et al. 2023), q the draft's own full forward; verifying as if the draft were one-hot
    (prompt lookup's rule, still lossless) would accept Σ p·q instead."""
    target = make_model(vocab_size=5, init_std=0.1, seed=3)
    draft = make_model(vocab_size=5, init_std=0.1, seed=11, n_layers=1)
    prompt = [0, 1, 2]
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt]))[0, -1], -1)
        joint = torch.stack(
            [
                p1[a] * torch.softmax(target(torch.tensor([prompt + [a]]))[0, -1], -1)
                for a in range(5)
            ]
        )  # (5, 5): p(t1 = a, t2 = b)
        q2 = torch.stack(
            [torch.softmax(draft(torch.tensor([prompt + [a]]))[0, -1], -1) for a in range(5)]
        )  # (5, 5): q(t2 = b | t1 = a)
    p2 = joint / p1[:, None]
    alpha = float((p1 * torch.minimum(p2, q2).sum(-1)).sum())
    assert abs(alpha - float((p1 * (p2 * q2).sum(-1)).sum())) > 0.1  # the two rules differ here
    n = 2400
    llm = LLM(target, block_size=4, max_num_seqs=64, num_speculative_tokens=2, draft_model=draft)
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=i) for i in range(n)]
    outs = llm.generate([prompt] * n, params)
    counts = torch.zeros(5, 5, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    tv = 0.5 * float((counts / n - joint).abs().sum())
    st = llm.engine.stats
    assert st["spec_proposed"] == n  # one draft per request, for t2
    assert st["spec_accepted"] / n == pytest.approx(alpha, abs=0.035)
    assert tv < 0.06, f"total variation {tv:.3f} from the target's distribution"
    assert all_free(llm.engine)


@pytest.mark.slow
def test_compiled_engine_with_a_draft_model(model, draft_prompts, reference):
    """Both decode steps compiled (the target's for draft-free iterations, the draft's for its
    single-token steps): greedy output equals full recompute under preemption, and no graph is
    compiled after warm-up (counted)."""
    llm = LLM(
        model,
        block_size=4,
        num_blocks=14,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        num_speculative_tokens=2,
        draft_model=1,
        compile={"cpp_wrapper": False},
    )
    target, draft = llm.engine.runner.decode, llm.engine.speculator.decode
    target.buckets = draft.buckets = (2, 4)  # two compilations each: 1-2 rows pad to 2, 3 to 4
    llm.engine.warm_up()
    assert (target.graphs, draft.graphs) == (2, 2)
    outs = llm.generate(draft_prompts[3:], GREEDY)  # 8-21 tokens: three do not fit at once
    assert [o.token_ids for o in outs] == reference[3:]
    assert llm.engine.stats["preemptions"] > 0 and llm.engine.stats["spec_accepted"] > 0
    assert (target.graphs, draft.graphs) == (2, 2)  # no recompilation after warm-up
    assert all_free(llm.engine)


def test_bad_draft_options(model):
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        LLMEngine(model, draft_model=1)
    with pytest.raises(ValueError, match="vocab_size=50"):
        LLMEngine(model, num_speculative_tokens=2, draft_model=make_model(vocab_size=50))
    with pytest.raises(ValueError, match="n_layers=5"):
        LLMEngine(model, num_speculative_tokens=2, draft_model=5)
