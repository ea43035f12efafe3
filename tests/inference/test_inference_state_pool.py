"""The engine serves hybrid models: recurrent states in a ``StatePool`` next to the paged KV blocks.

Greedy output of ``LLM`` on a 3:1 hybrid (linear attention, Mamba-2, Gated DeltaNet + one full layer), a pure
linear-attention model and a 5:1 local:global model equals full-recompute greedy token for token — batched
prompts of 1–33 tokens, chunked prefill, forced preemption (tiny KV pool), a tiny state pool, the reference
attention; every state slot is free afterwards (finish, abort, preemption); the pool's bytes equal the
accounting formula; pool exhaustion queues requests (CS336 notes "注意力机制", "动态负载")."""

import pytest
import torch
from inference_helpers import full_recompute_greedy, greedy

from lmstack.accounting.mixers import mixer_cache_bytes
from lmstack.inference import LLM, LLMEngine
from lmstack.model.config import ModelConfig, repeat_pattern
from lmstack.model.mixers import init_recurrent_parameters
from lmstack.model.transformer import Transformer

N_NEW = 12
PATTERNS = {
    "3:1 hybrid": (["linear_attention", "mamba2", "gated_deltanet", "attention"], 4),
    "pure linear": (["linear_attention"], 2),
    "5:1 local:global": (["local_attention"] * 5 + ["attention"], 6),
}


def _model(unit, n_layers, dtype=torch.float64):
    cfg = ModelConfig(
        vocab_size=97,
        d_model=32,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=128,
        init_std=0.05,
        layer_types=repeat_pattern(unit, n_layers),
        ssm_head_dim=16,
        ssm_state_size=8,
        ssm_expand=2,
        mixer_chunk_size=4,
        local_window=5,
    )
    model = Transformer(cfg, dtype=dtype, seed=3).eval()
    init_recurrent_parameters(model)
    return model


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def case(request, prompts):
    model = _model(*PATTERNS[request.param])
    ps = prompts[::2] + prompts[-3:]  # 1..33 tokens, two with a shared prefix
    return model, ps, [full_recompute_greedy(model, p, N_NEW) for p in ps]


def all_free(engine):
    blocks, states = engine.cache.blocks, engine.states
    blocks_free = all(r == 0 for r in blocks.ref_count) and not blocks.tables
    states_free = states is None or (
        states.num_free == states.num_slots and not states.slot_of and not states.pending
    )
    return blocks_free and states_free


@pytest.mark.parametrize(
    "opts",
    [
        dict(block_size=4, num_blocks=200, max_num_batched_tokens=512),  # everything in one forward
        dict(
            block_size=4, num_blocks=200, max_num_batched_tokens=7, max_num_seqs=5
        ),  # chunked prefill, few seats
        dict(
            block_size=4, num_blocks=14, max_num_batched_tokens=32, max_num_seqs=16
        ),  # preemption: 52 token slots
        dict(
            block_size=4, num_blocks=200, max_num_batched_tokens=64, num_state_slots=2
        ),  # 2 states for 9 requests
        dict(
            block_size=4, num_blocks=200, max_num_batched_tokens=9, selective=False
        ),  # the reference attention
    ],
    ids=["one-batch", "chunked", "preempt", "two-slots", "reference-attention"],
)
def test_greedy_equals_full_recompute(case, opts):
    model, ps, reference = case
    llm = LLM(model, **opts)
    outs = llm.generate(ps, greedy(N_NEW))
    assert [o.token_ids for o in outs] == reference
    eng = llm.engine
    if "num_blocks" in opts and opts["num_blocks"] == 14:
        assert eng.stats["preemptions"] > 0
    assert all_free(eng)
    if (
        eng.states is not None
    ):  # prefix caching is off for recurrent layers (no state for a cached prefix)
        assert not eng.cache.blocks.enable_prefix_caching and eng.stats["cached_prompt_tokens"] == 0


def test_pool_exhaustion_queues_requests(prompts):
    model = _model(*PATTERNS["3:1 hybrid"])
    engine = LLMEngine(model, block_size=4, num_blocks=200, num_state_slots=1)
    ps = prompts[:4]
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, greedy(5))
    done, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        most = max(most, len(engine.scheduler.running), len(engine.states.slot_of))
    assert most == 1 and len(done) == 4  # one at a time, none refused
    assert [done[f"r{i}"] for i in range(4)] == [full_recompute_greedy(model, p, 5) for p in ps]
    assert all_free(engine)


def test_abort_and_preemption_free_state_slots(prompts):
    model = _model(*PATTERNS["3:1 hybrid"])
    engine = LLMEngine(
        model, block_size=4, num_blocks=200, num_state_slots=3, max_num_batched_tokens=64
    )
    for i, p in enumerate(prompts[8:12]):
        engine.add_request(f"r{i}", p, greedy(20))
    engine.step()
    engine.step()
    held = dict(engine.states.slot_of)
    assert sorted(held) == ["r0", "r1", "r2"]  # 3 slots for 4 requests
    assert engine.abort_request("r1")
    assert "r1" not in engine.states.slot_of and engine.states.num_free == 1
    engine.step()  # the waiting request takes the freed slot
    assert "r3" in engine.states.slot_of
    victim = (
        engine.scheduler.running.pop()
    )  # preempt by hand, as the scheduler does when blocks run out
    engine.scheduler._preempt(victim)
    assert victim.request_id not in engine.states.slot_of and engine.states.num_free == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert all_free(engine)


@pytest.mark.parametrize("dtype, acc_dtype", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_state_bytes_equal_accounting(dtype, acc_dtype):
    """One slot = Σ over recurrent layers of accounting's per-mixer state bytes (state fp32, conv inputs in the
    model dtype); attention layers hold nothing in the pool."""
    model = _model(*PATTERNS["3:1 hybrid"], dtype=dtype)
    c = model.config
    engine = LLMEngine(model, block_size=4, num_blocks=50, num_state_slots=5)
    want = sum(
        mixer_cache_bytes(c, kind, 1000, dtype=acc_dtype)
        for kind in c.mixer_types
        if kind != "attention"
    )
    assert engine.states.bytes_per_slot == want
    assert engine.states.nbytes == 5 * want
    assert sorted(engine.states.states) == [0, 1, 2]
    # a worked number for this config (D=32, N=4, H=8; Mamba-2 inner 64, 4 heads of P=16, N_state 8; K_c=4)
    lin = 4 * 8 * 9 * 4  # N·H·(H+1) fp32
    mamba = 4 * 8 * 16 * 4 + (64 + 2 * 8) * 3 * (4 if dtype == torch.float32 else 2)
    delta = 4 * 8 * 8 * 4 + (3 * 32) * 3 * (4 if dtype == torch.float32 else 2)
    assert want == lin + mamba + delta


def test_full_attention_model_has_no_state_pool(model):
    assert LLMEngine(model, num_blocks=20).states is None


def test_what_the_engine_refuses():
    hybrid = _model(*PATTERNS["3:1 hybrid"])
    with pytest.raises(
        ValueError, match=r"num_speculative_tokens=2: the model has recurrent layers"
    ):
        LLMEngine(hybrid, num_blocks=20, num_speculative_tokens=2)
    with pytest.raises(ValueError, match=r"num_state_slots=0"):
        LLMEngine(hybrid, num_blocks=20, num_state_slots=0)
    dsa = _model(["dsa", "attention"], 2)
    with pytest.raises(ValueError, match=r"layer 0 is a DSA layer"):
        LLMEngine(dsa, num_blocks=20)


@pytest.mark.parametrize(
    "name, n_attention", [("3:1 hybrid", 1), ("5:1 local:global", 6), ("pure linear", 0)]
)
def test_kv_pool_holds_only_attention_layers(name, n_attention):
    """The paged pool keeps K/V for the softmax-attention layers only (local ones included): its bytes are
    accounting's per-layer KV bytes at NB·bs tokens, summed over those layers; a pure linear model's pool is empty
    and its block count covers every seat at full length."""
    model = _model(*PATTERNS[name], dtype=torch.float32)
    c = model.config
    engine = LLMEngine(model, block_size=4, num_blocks=50, num_state_slots=2)
    assert engine.cache.k.shape[0] == n_attention
    assert engine.cache.nbytes == n_attention * mixer_cache_bytes(
        c, "attention", 50 * 4, dtype="fp32"
    )
    if n_attention == 0:
        free = LLMEngine(model, block_size=4, max_num_seqs=3, max_model_len=64)
        assert free.cache.nbytes == 0 and free.cache.blocks.num_blocks >= 3 * 16


def test_a_retried_forward_advances_no_state_twice(prompts):
    """Fault injection: the 3:1 hybrid's last layer (full attention, after three recurrent layers that already
    ran) raises once in a 2-row decode step. The engine reruns the step one sequence at a time; states are
    staged, not written, during a forward, so each sequence's recurrent state advances once and both outputs
    equal full-recompute greedy."""
    model = _model(*PATTERNS["3:1 hybrid"])
    ps = [prompts[4], prompts[7]]  # 5 and 9 tokens: one 14-token prefill, then 2-row decode steps
    reference = [full_recompute_greedy(model, p, N_NEW) for p in ps]
    calls = {"armed": True, "raised": 0}

    def fail_once(module, args):
        x = args[0]  # (1, T, D): the packed rows of one forward
        if calls["armed"] and x.shape[1] == 2:
            calls["armed"] = False
            calls["raised"] += 1
            raise RuntimeError("injected fault in the last layer")

    handle = model.blocks[3].register_forward_pre_hook(fail_once)
    try:
        llm = LLM(model, block_size=4, num_blocks=200, max_num_batched_tokens=64)
        outs = llm.generate(ps, greedy(N_NEW))
    finally:
        handle.remove()
    assert calls["raised"] == 1
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs) and all_free(llm.engine)
