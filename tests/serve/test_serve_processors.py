"""The engine hook the server uses (``SamplingParams.logits_processors``) and OpenAI's penalties,
against hand computations."""

import pytest
import torch
from serve_helpers import tiny_model

from lmstack.inference import LLM
from lmstack.inference.sampling import SamplingParams
from lmstack.serve.penalties import Penalties


def test_penalties_hand_computed():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = Penalties(presence=0.5, frequency=0.25)([3, 3, 1], logits)
    # token 3 seen twice: 4 - 2·0.25 - 0.5 = 3.0; token 1 once: 2 - 0.25 - 0.5 = 1.25
    assert out.tolist() == [1.0, 1.25, 3.0, 3.0]
    assert Penalties(1.0, 1.0)([], logits) is logits


def test_processors_run_before_sampling_and_leave_logprobs_raw():
    model = tiny_model()
    llm = LLM(model, None, block_size=4, num_blocks=64, eos_token_id=None)
    seen = []

    def only_7_or_9(output_ids, logits):
        seen.append(list(output_ids))
        mask = torch.full_like(logits, -torch.inf)
        mask[[7, 9]] = 0
        return logits + mask

    prompt = [5, 6, 7, 8]
    outs = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(
                temperature=0, max_tokens=5, logprobs=1, logits_processors=[only_7_or_9]
            ),
            SamplingParams(temperature=0, max_tokens=5, logprobs=1),
        ],
    )
    masked, free = outs
    assert set(masked.token_ids) <= {7, 9}
    with (
        torch.no_grad()
    ):  # the processor saw each step's output so far; the logprob is the model's own
        ids = prompt + masked.token_ids
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].double(), -1)
    for i, t in enumerate(masked.token_ids):
        assert masked.logprobs[i][0] == pytest.approx(float(logp[len(prompt) - 1 + i, t]), abs=1e-6)
        assert t == (7 if logp[len(prompt) - 1 + i, 7] > logp[len(prompt) - 1 + i, 9] else 9)
    assert seen == [masked.token_ids[:i] for i in range(5)]
    assert free.token_ids != masked.token_ids or set(free.token_ids) <= {7, 9}
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=[3])


def test_async_llm_shutdown_aborts_and_frees():
    """``AsyncLLM.shutdown``: running requests are aborted between steps, every block is free, the loop ends."""
    import asyncio

    from lmstack.inference import AsyncLLM, LLMEngine

    engine = LLMEngine(tiny_model(), None, block_size=4, num_blocks=64, eos_token_id=None)
    llm = AsyncLLM(engine)

    async def main():
        async def consume():
            n = 0
            async for _ in llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=200)):
                n += 1
            return n

        task = asyncio.create_task(consume())
        while engine.stats["generated_tokens"] < 3:
            await asyncio.sleep(0.001)
        await llm.shutdown()
        assert llm.alive and llm._task is None
        return await asyncio.gather(task, return_exceptions=True)

    (result,) = asyncio.run(main())
    assert isinstance(result, RuntimeError) and "shutting down" in str(result)
    assert not engine.requests and not engine.has_unfinished_requests()
    b = engine.cache.blocks
    assert b.num_free == b.num_blocks - 1
    assert engine.stats["generated_tokens"] < 200


def test_async_llm_steps_without_a_hand_off_per_step():
    """The worker runs step after step while the loop has nothing to apply (one hand-off per run of steps):
    one stream of 20 tokens takes 20 steps in a few runs; a request added meanwhile ends the run and is
    served; each stream gets its tokens in order, equal to the offline engine's greedy output."""
    import asyncio

    from lmstack.inference import AsyncLLM, LLMEngine

    engine = LLMEngine(tiny_model(), None, block_size=4, num_blocks=64, eos_token_id=None)
    llm = AsyncLLM(engine)
    runs, steps = [], []
    step, run = engine.step, llm._steps
    engine.step = lambda: steps.append(1) or step()
    llm._steps = lambda *a: runs.append(1) or run(*a)
    params = SamplingParams(temperature=0, max_tokens=20)

    async def consume(prompt):
        ids = []
        async for out in llm.generate(prompt, params):
            ids.extend(out.new_token_ids)
        return ids

    async def main():
        first = await consume([1, 2, 3])
        n_runs, n_steps = len(runs), len(steps)
        task = asyncio.create_task(consume([4, 5]))
        while not steps[n_steps:]:
            await asyncio.sleep(0.001)
        second = await asyncio.gather(task, consume([6]))
        return first, n_runs, n_steps, second

    first, n_runs, n_steps, (second, third) = asyncio.run(main())
    assert n_steps >= 20 and n_runs <= 3
    offline = LLMEngine(tiny_model(), None, block_size=4, num_blocks=64, eos_token_id=None)
    for i, p in enumerate([[1, 2, 3], [4, 5], [6]]):  # the same requests, stepped by hand
        offline.add_request(f"o{i}", p, params)
    done = {}
    while offline.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in offline.step() if o.finished})
    assert [first, second, third] == [done[f"o{i}"] for i in range(3)]
