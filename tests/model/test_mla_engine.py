"""The paged engine serves MLA and MoE models unchanged: greedy output equals full recomputation for a
batch of prompts (continuous batching, prefix caching, preemption by recompute), and the paged blocks
hold only the latent: d_c + d_R numbers per token and layer, the accounting formula."""

import pytest
import torch

from lmstack.accounting.memory import kv_cache_bytes
from lmstack.inference import LLM, SamplingParams
from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _model(**kw):
    # float64 so that no argmax near-tie flips between the cached and the recomputed summation orders
    c = ModelConfig(
        vocab_size=97, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=256, **kw
    )
    return Transformer(c, dtype=torch.float64, seed=1).eval()


MLA = dict(
    kv_lora_rank=16,
    q_lora_rank=12,
    qk_nope_head_dim=12,
    qk_rope_head_dim=4,
    v_head_dim=10,
    head_dim=16,
    rope_layout="interleaved",
)
MOE = dict(n_experts=4, n_experts_per_token=2, d_ff_expert=32, n_shared_experts=1)


@torch.no_grad()
def _recompute(model, prompt, n):
    ids, out = list(prompt), []
    for _ in range(n):
        t = int(model(torch.tensor([ids]))[0, -1].argmax())
        out.append(t)
        ids.append(t)
    return out


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(1, 97, (10,), generator=g).tolist()
    return [torch.randint(1, 97, (n,), generator=g).tolist() for n in (3, 9, 17, 5)] + [
        shared + [7],
        shared + [8, 9],
    ]


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("mla", MLA),
        ("moe", MOE),
        ("mla+moe", {**MLA, **MOE}),
        ("moe-hash", {**MOE, "router": "hash"}),
    ],
)
@pytest.mark.parametrize(
    "num_blocks,selective",
    [(200, True), (200, False), (12, True)],
    ids=["selective", "packed", "preempting"],
)
def test_engine_greedy_equals_full_recompute(kind, kw, num_blocks, selective, prompts):
    model = _model(**kw)
    llm = LLM(
        model,
        block_size=4,
        num_blocks=num_blocks,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        selective=selective,
    )
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [_recompute(model, p, 8) for p in prompts]
    if num_blocks == 12:
        assert llm.engine.stats["preemptions"] > 0


@pytest.mark.parametrize("kw", [MLA, {**MLA, **MOE}], ids=["mla", "mla+moe"])
def test_prefix_cache_serves_latent_blocks(kw, prompts):
    from lmstack.inference import LLMEngine

    model = _model(**kw)
    engine = LLMEngine(model, block_size=4, num_blocks=100)
    outs = []
    for i, p in enumerate(
        prompts[-2:]
    ):  # 10 shared tokens: two full blocks cached after the first request, and its third (full, named)
        # starts with the other 2: a partial hit copies it, 8 + 2 tokens from the cache
        engine.add_request(f"r{i}", p, GREEDY)
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert outs[-1].token_ids == _recompute(model, p, 8)
    assert outs[-1].num_cached_tokens == 10


def test_paged_latent_blocks_bytes_equal_accounting():
    model = _model(**MLA)
    llm = LLM(model, block_size=4, num_blocks=10)
    cache = llm.engine.cache
    per_token = cache.nbytes / (10 * 4)
    assert (
        per_token == 2 * kv_cache_bytes(model.config, 1, 1, "fp32") == (16 + 4) * 2 * 8
    )  # fp64: 2 x fp32
    gqa = _model()
    assert per_token < LLM(gqa, block_size=4, num_blocks=10).engine.cache.nbytes / 40
