"""The continuous-batching engine over the paged cache: greedy output equals full-recompute greedy
token for token under chunked prefill, shared prefixes and forced preemption; every block is
free afterwards; abort frees blocks; the offline and async APIs (Book of LLMs §2.2 “batching and packing”, CS336 notes "动态负载")."""

import asyncio

import pytest
import torch
from inference_helpers import full_recompute_greedy

from lmstack.inference import LLM, AsyncLLM, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=14)


def all_free(engine):
    a = engine.cache.blocks
    return (
        all(r == 0 for r in a.ref_count)
        and a.num_free == a.num_blocks - 1
        and not engine.cache.blocks.tables
    )


@pytest.fixture(scope="module")
def reference(model, prompts):
    return [full_recompute_greedy(model, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize(
    "opts",
    [
        dict(
            block_size=4, num_blocks=200, max_num_batched_tokens=512, max_num_seqs=64
        ),  # everything at once
        dict(
            block_size=4, num_blocks=200, max_num_batched_tokens=7, max_num_seqs=5
        ),  # chunked prefill, few seats
        dict(block_size=16, num_blocks=40, max_num_batched_tokens=64, max_num_seqs=8),
        dict(block_size=4, num_blocks=200, max_num_batched_tokens=64, enable_prefix_caching=False),
        dict(
            block_size=4,
            num_blocks=200,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            admission_batch=3,
        ),  # prompts admitted in threes behind a full batch
    ],
    ids=["one-batch", "chunked", "block16", "no-prefix-cache", "admission-batch"],
)
def test_batched_greedy_equals_full_recompute(model, prompts, reference, opts):
    llm = LLM(model, **opts)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" and o.finished for o in outs)
    assert all_free(llm.engine)


@pytest.mark.parametrize(
    "selective", [True, False], ids=["grouped-attention", "one-masked-attention"]
)
def test_mixed_prefill_and_decode_in_one_forward(model, prompts, reference, selective):
    """Every iteration is ONE forward of a flattened (1, T) row; with selective=False the model's
    mask over all gathered keys is built from (sequence id, position) — both equal full recompute."""
    llm = LLM(
        model,
        block_size=4,
        num_blocks=200,
        max_num_batched_tokens=9,
        max_num_seqs=6,
        selective=selective,
    )
    outs = llm.generate(prompts, GREEDY)
    eng = llm.engine
    assert eng.stats["forwards"] == eng.stats["steps"]
    assert [o.token_ids for o in outs] == reference
    assert all_free(eng)


def test_packed_mask_hides_other_sequences_keys(model):
    """The (sequence id, position) mask against an independent reference: two sequences packed in
    one row give the same logits as each run alone without a cache."""
    from lmstack.inference.paged import PagedKVCache

    a, b = [5, 6, 7, 8, 9], [11, 12, 13]
    for selective in (True, False):
        cache = PagedKVCache(model.config, 20, 4, torch.float64)
        for sid, ids in (("a", a), ("b", b)):
            cache.blocks.allocate(sid, ids)
            cache.blocks.reserve(sid, len(ids))
        batch, pos, sid = cache.packed_batch([("a", 0, 5), ("b", 0, 3)], selective=selective)
        with torch.no_grad():
            got = model(torch.tensor([a + b]), pos, kv_cache=batch, document_ids=sid)[0]  # (8, V)
            want = torch.cat([model(torch.tensor([a]))[0], model(torch.tensor([b]))[0]])
        torch.testing.assert_close(got, want)


def test_preemption_by_recompute_with_a_tiny_pool(model, prompts, reference):
    llm = LLM(
        model, block_size=4, num_blocks=14, max_num_batched_tokens=32, max_num_seqs=16
    )  # 52 token slots
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats["preemptions"] > 0
    assert [o.token_ids for o in outs] == reference
    assert all_free(llm.engine)


def test_prefix_cache_serves_shared_prompt_blocks(model, prompts, reference):
    engine = LLMEngine(model, block_size=4, num_blocks=100)
    shared = prompts[-4]  # 21 tokens: 18 shared + 3
    engine.add_request("first", shared, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    # 18 shared + 1: four full blocks are cached (16 tokens), and the fifth of "first" (its tokens 16..19, full
    # and named) starts with the 2 more shared ones: a partial hit, 18 = all but the last prompt token
    engine.add_request("second", prompts[-3], GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].num_cached_tokens == 18 and outs[-1].token_ids == reference[-3]
    assert engine.prefix_cache_hit_rate == pytest.approx(18 / (21 + 19))
    assert all_free(engine)


@pytest.mark.parametrize(
    "first,second,common",
    [([5, 6, 7, 8], [5, 6, 7, 9], 3), ([1, 23, 4, 5], [12, 3, 4, 5], 0)],
    ids=["last-token-of-block", "digit-collision"],
)
def test_prefix_cache_never_serves_a_block_of_other_tokens(model, first, second, common):
    """The second request differs from the cached first only in the last token of a full block,
    or in tokens whose decimal digits concatenate alike: no cached block (only the ``common`` tokens it
    starts with, copied: a partial hit), output = recompute."""
    engine = LLMEngine(model, block_size=4, num_blocks=100)
    outs = []
    for i, p in enumerate((first + [40, 41, 42], second + [40, 41, 42])):
        engine.add_request(f"r{i}", p, GREEDY)
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert outs[-1].token_ids == full_recompute_greedy(model, p, GREEDY.max_tokens)
    assert [o.num_cached_tokens for o in outs if o.finished] == [0, common]
    assert all_free(engine)


def test_abort_mid_generation_frees_blocks(model, prompts):
    engine = LLMEngine(model, block_size=4, num_blocks=100)
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=30))
    for _ in range(3):
        engine.step()
    assert engine.cache.blocks.tables  # blocks in use
    assert engine.abort_request("r1") and "r1" not in engine.cache.blocks.tables
    assert not engine.abort_request("r1")  # already gone
    engine.add_request("w", prompts[5], SamplingParams(max_tokens=3))
    assert engine.abort_request("w")  # aborted while waiting
    while engine.has_unfinished_requests():
        engine.step()
    assert all_free(engine)


def test_stop_token_ids_eos_and_max_tokens(model, prompts, reference):
    p, ref = prompts[8], reference[8]
    llm = LLM(model, block_size=4, eos_token_id=ref[3])
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=14))[0]
    assert out.token_ids == ref[:4] and out.finish_reason == "stop"
    out = llm.generate(
        [p], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop_token_ids=[ref[5]])
    )[0]
    assert out.token_ids == ref[:6] and out.finish_reason == "stop"
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert out.token_ids == ref[:2] and out.finish_reason == "length"


class CharTokenizer:
    """id i <-> the letter chr(97 + i % 26); enough to test text streaming and stop strings."""

    eos_token_id = None

    def encode(self, text):
        return [ord(c) - 97 for c in text]

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def test_stop_strings_and_streamed_text(model, prompts, reference):
    tok = CharTokenizer()
    engine = LLMEngine(model, tok, block_size=4)
    full = tok.decode(reference[9])
    stop = full[5:7]
    engine.add_request("s", prompts[9], SamplingParams(temperature=0, max_tokens=14, stop=[stop]))
    pieces, last = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            pieces.append(o.new_text)
            last = o
    cut = full.find(stop)
    assert (
        last.finish_reason == "stop" and last.text == full[:cut] and "".join(pieces) == full[:cut]
    )


def test_seeded_sampling_is_independent_of_the_batch(model, prompts):
    sp = SamplingParams(temperature=0.9, top_k=20, max_tokens=10, seed=123, logprobs=2)
    alone = LLM(model, block_size=4).generate([prompts[3]], sp)[0]
    mixed = LLM(model, block_size=4).generate(
        prompts[:6],
        [SamplingParams(temperature=1.0, max_tokens=10)] * 3
        + [sp]
        + [SamplingParams(max_tokens=10)] * 2,
    )[3]
    assert alone.token_ids == mixed.token_ids
    assert len(alone.logprobs) == 10 and all(len(top) == 2 for _, top in alone.logprobs)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompts[3]]))[0, -1].float(), -1)[
            alone.token_ids[0]
        ]
    assert alone.logprobs[0][0] == pytest.approx(float(ref), abs=1e-5)


def test_request_errors(model):
    engine = LLMEngine(model, block_size=4, num_blocks=5)  # 16 token slots
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("a", [1, 500], GREEDY)
    with pytest.raises(ValueError, match="cannot fit in the KV pool"):
        engine.add_request("a", [1] * 10, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("a", [1] * 300, GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("a", "text", GREEDY)
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="already"):
        engine.add_request("a", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="sampling_params"):
        LLM(model).generate([[1], [2]], [GREEDY])
    with pytest.raises(ValueError, match="admission_batch=5 exceeds max_num_seqs=4"):
        LLMEngine(model, max_num_seqs=4, admission_batch=5)
    with pytest.raises(ValueError, match="admission_batch"):
        LLMEngine(model, admission_batch=0)


def test_async_streaming_and_disconnect(model, prompts, reference):
    engine = LLMEngine(model, block_size=4, num_blocks=100)
    server = AsyncLLM(engine)

    async def collect(i):
        tokens, n_outputs = [], 0
        async for out in server.generate(prompts[i], GREEDY):
            tokens += out.new_token_ids
            n_outputs += 1
        return tokens, n_outputs

    async def disconnect():
        async for out in server.generate(prompts[2], SamplingParams(temperature=0, max_tokens=50)):
            if len(out.token_ids) >= 3:
                break  # the client goes away: the request is aborted

    async def main():
        results = await asyncio.gather(collect(0), collect(7), collect(10), disconnect())
        for _ in range(50):
            if not engine.has_unfinished_requests() and not server._pending:
                break
            await asyncio.sleep(0.01)
        return results

    results = asyncio.run(main())
    assert [r[0] for r in results[:3]] == [reference[0], reference[7], reference[10]]
    assert all(r[1] > 1 for r in results[:3])  # streamed in pieces, not at the end
    assert all_free(engine)


@pytest.mark.parametrize("gather_s,first_step", [(0.3, 3), (0.0, 1)])
def test_async_burst_on_an_idle_engine_shares_its_first_step(model, prompts, gather_s, first_step):
    """Three requests reach an idle engine 20 ms apart. Gathering (each within ``gather_s`` = 0.3 s of the
    previous one) puts all 3 in the first step; without it (0) the first step starts with the first request
    alone and the other two join later. Outputs equal full recompute either way."""
    engine = LLMEngine(model, block_size=4, num_blocks=100)
    server = AsyncLLM(engine, gather_s=gather_s, max_gather_s=1.0)
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append(sorted(s.request_id for s, _ in out))
        return out

    engine.scheduler.schedule = recording

    async def collect(i, delay):
        await asyncio.sleep(delay)
        return [
            t
            async for out in server.generate(prompts[i], GREEDY, f"r{i}")
            for t in out.new_token_ids
        ]

    async def main():
        return await asyncio.gather(*(collect(i, 0.02 * i) for i in range(3)))

    results = asyncio.run(main())
    assert len(steps[0]) == first_step
    assert results == [
        full_recompute_greedy(model, prompts[i], GREEDY.max_tokens) for i in range(3)
    ]
    with pytest.raises(ValueError, match="gather_s"):
        AsyncLLM(engine, gather_s=0.5, max_gather_s=0.1)


@pytest.mark.parametrize(
    "opts",
    [
        dict(block_size=4, num_blocks=200, max_num_batched_tokens=64),
        dict(
            block_size=4, num_blocks=200, max_num_batched_tokens=7, max_num_seqs=5
        ),  # chunked prefill
        dict(block_size=4, num_blocks=14, max_num_batched_tokens=32, max_num_seqs=16),  # preemption
    ],
    ids=["batched", "chunked", "tiny-pool"],
)
def test_sliding_window_frees_out_of_window_blocks(prompts, opts):
    """Mistral-style window W = 6: blocks entirely behind the window are freed during generation,
    and greedy output still equals full recompute of the same windowed model (no cache)."""
    from inference_helpers import make_model

    model = make_model(sliding_window=6)
    reference = [full_recompute_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(model, **opts)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats["window_released_blocks"] > 0
    assert [o.token_ids for o in outs] == reference
    assert all_free(llm.engine)


def test_release_outside_window_counts(model):
    """Block i (positions 4i..4i+3) is dead once 4(i+1) <= p - W + 1 for the next position p."""
    from lmstack.inference.block_manager import NULL_BLOCK
    from lmstack.inference.paged import PagedKVCache

    cache = PagedKVCache(model.config, 20, 4, torch.float64)
    cache.blocks.allocate("s", list(range(1, 15)))
    cache.blocks.reserve("s", 14)
    cache.blocks.commit(
        "s", list(range(1, 15)), 14
    )  # p = 14, W = 6: keys 9..14 visible; blocks 0, 1 (0..7) dead
    assert cache.blocks.release_outside_window("s", 6) == 2
    assert (
        cache.blocks.tables["s"][:2] == [NULL_BLOCK, NULL_BLOCK]
        and cache.blocks.first_live_block("s") == 2
    )
    assert cache.blocks.num_free == 19 - 2
    cache.blocks.free("s")
    assert cache.blocks.num_free == 19


def test_document_ids_need_a_cache_with_key_sequence_ids(model):
    """A cache that holds one sequence per row (no keys' sequence ids) cannot mask by sequence: a clear
    error, not a wrong mask."""
    from lmstack.inference.kv_cache import KVCache

    cache = KVCache(model.config, 1, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="sequence ids"), torch.no_grad():
        model(
            torch.tensor([[1, 2, 3]]),
            torch.arange(3)[None],
            kv_cache=cache,
            document_ids=torch.zeros(1, 3, dtype=torch.long),
        )


def test_one_driver_per_engine_and_llm_generate_from_threads(model, prompts, reference):
    """Issue #31: LLM.generate from 3 threads failed every call (KeyError 'req-21', 'call reserve() first') and
    AsyncLLM(llm.engine) beside llm.generate hung. Calls from threads now run one after another, each equal to
    the single-threaded reference; a second driver on one engine is refused by name."""
    import threading

    llm = LLM(model, block_size=4, num_blocks=100)
    results, errors = {}, []

    def worker(i):
        try:
            results[i] = llm.generate([prompts[i]], GREEDY)[0].token_ids
        except Exception as e:  # noqa: BLE001 — collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and all(results[i] == reference[i] for i in range(3))
    stream = AsyncLLM(llm.engine)  # an idle engine may change driver

    async def stream_then_generate():
        gen = stream.generate(prompts[0], GREEDY)
        first = (
            await gen.__anext__()
        )  # a stream in flight: the LLM may not step the engine under it
        with pytest.raises(
            RuntimeError, match="already driven by a AsyncLLM with requests in flight"
        ):
            llm.generate([prompts[1]], GREEDY)
        tokens = list(first.new_token_ids)
        async for out in gen:
            tokens += out.new_token_ids
        return tokens

    assert asyncio.run(stream_then_generate()) == reference[0]
    assert (
        llm.generate([prompts[1]], GREEDY)[0].token_ids == reference[1]
    )  # the stream is done: the LLM again
