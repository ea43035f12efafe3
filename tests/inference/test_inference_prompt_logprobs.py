"""Prompt logprobs (``SamplingParams.prompt_logprobs``, as vLLM's): every prompt token's log-probability
given its prefix, from the engine's prefill, equals HF transformers' log_softmax over the same tokens —
with chunked prefill, several requests in one forward, a prompt whose prefix is in the prefix cache
(the hit is not taken, nothing is dropped) and preemption by recomputation."""

import pytest
import torch

from lmstack.inference import SamplingParams
from lmstack.inference.engine import LLMEngine

transformers = pytest.importorskip("transformers", reason="HF transformers is the reference")


@pytest.fixture(scope="module")
def models(hf_llama_pair):
    """A random HF Llama (fp32) and the same weights loaded by lmstack's loader."""
    return hf_llama_pair(vocab_size=120)


def hf_prompt_logprobs(hf, ids, n_top):
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].double(), -1)  # (P-1, V)
    lp = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    top = torch.topk(logp, n_top, dim=-1)
    return lp.tolist(), [dict(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]


def check(out, hf, n_top):
    ids = out.prompt_token_ids
    want_lp, want_top = hf_prompt_logprobs(hf, ids, n_top)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    got_lp = [e[0] for e in out.prompt_logprobs[1:]]
    assert got_lp == pytest.approx(want_lp, abs=1e-4)
    for (_, top), wt in zip(out.prompt_logprobs[1:], want_top):
        assert sorted(top) == sorted(wt)  # random weights: no near-ties among the top 3 here
        assert [top[k] for k in sorted(top)] == pytest.approx([wt[k] for k in sorted(wt)], abs=1e-4)


def run(engine, prompts, params):
    rids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[r] for r in rids]


def test_prompt_logprobs_equal_hf(models):
    hf, model = models
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 120, (n,), generator=g).tolist() for n in (2, 5, 17, 40, 63)]
    engine = LLMEngine(
        model, block_size=4, max_num_batched_tokens=24
    )  # chunked prefill, batched requests
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    for out in run(engine, prompts, params):
        check(out, hf, 3)


def test_prefix_cache_hit_does_not_drop_them(models):
    hf, model = models
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 120, (20,), generator=g).tolist()
    engine = LLMEngine(model, block_size=4, enable_prefix_caching=True)
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    run(engine, [shared + [1, 2]], plain)  # fills the prefix cache
    (warm,) = run(engine, [shared + [3, 4]], plain)
    assert warm.num_cached_tokens > 0  # a plain request does take the hit
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    (out,) = run(engine, [shared + [5, 6, 7]], params)
    check(out, hf, 3)


def test_preemption_recomputes_them(models):
    hf, model = models
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 120, (n,), generator=g).tolist() for n in (30, 31, 29)]
    engine = LLMEngine(
        model,
        block_size=4,
        num_blocks=20,
        max_num_batched_tokens=16,
        watermark=0.0,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=3)
    outs = run(engine, prompts, params)
    assert engine.stats["preemptions"] > 0
    for out in outs:
        check(out, hf, 3)


def test_off_by_default_and_checked(models):
    _, model = models
    (out,) = run(LLMEngine(model), [[1, 2, 3]], SamplingParams(max_tokens=1))
    assert out.prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
