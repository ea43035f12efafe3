"""Under load: 64 concurrent streams each equal to its solo greedy output, every KV block free and RSS
back within a bound afterwards; 20 mid-stream disconnects abort their requests and free their
blocks; hypothesis-generated bodies never get a 5xx; ``lmstack serve`` exits cleanly on SIGTERM."""

import asyncio
import json
import signal

import pytest
from serve_helpers import (
    MODEL,
    all_blocks_free,
    cli_server,
    live_server,
    save_tiny_checkpoint,
    tiny_engine,
    tiny_model,
    tiny_tokenizer,
    wait_idle,
)

from lmstack.inference import LLM
from lmstack.inference.sampling import SamplingParams
from lmstack.serve import Server

httpx = pytest.importorskip("httpx", reason="raw HTTP requests")
openai = pytest.importorskip("openai", reason="the official client")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def served(model):
    engine = tiny_engine(model)
    with live_server(Server(engine, MODEL)) as url:
        yield url, engine


def prompts(n):
    import random

    rng = random.Random(0)
    return [
        "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(1, 40)))
        for _ in range(n)
    ]


@pytest.mark.slow
def test_64_concurrent_streams_equal_their_solo_outputs(served, model):
    psutil = pytest.importorskip("psutil", reason="RSS measurement")
    url, engine = served
    ps = prompts(64)
    lengths = [4 + (i * 7) % 29 for i in range(64)]

    async def one(client, p, n):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": p}],
            max_tokens=n,
            temperature=0,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300
        )
        out = await asyncio.gather(*[one(client, p, n) for p, n in zip(ps, lengths)])
        await client.close()
        return out

    asyncio.run(main())  # warm-up: allocator pools, RoPE tables, connection machinery
    wait_idle(engine)
    rss0 = psutil.Process().memory_info().rss
    texts = asyncio.run(main())
    wait_idle(engine)
    rss1 = psutil.Process().memory_info().rss
    tok = tiny_tokenizer()
    solo = LLM(model, tok, eos_token_id=tok.eos_token_id, block_size=4, num_blocks=512)
    for p, n, text in zip(ps, lengths, texts):
        ref = solo.chat(
            [{"role": "user", "content": p}], SamplingParams(temperature=0, max_tokens=n)
        )
        assert text == ref.text
    assert all_blocks_free(engine)
    assert rss1 - rss0 < 64 * 2**20, f"RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB over 64 requests"
    assert engine.stats["steps"] > 0


def test_20_disconnects_mid_stream_free_their_blocks(served):
    url, engine = served
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    seen = []

    async def leave_early(client):
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            lines = 0
            async for line in r.aiter_lines():
                lines += line.startswith("data: ")
                if lines == 3:
                    break
        seen.append(lines)

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*[leave_early(client) for _ in range(20)])

    asyncio.run(main())
    assert seen == [3] * 20
    wait_idle(engine, timeout=20)
    assert all_blocks_free(engine)
    assert engine.stats["generated_tokens"] < 20 * 200  # aborted, not run to their end
    assert 'lmstack_requests_total{finish_reason="abort"}' in httpx.get(url + "/metrics").text


@pytest.mark.slow
def test_fuzzed_bodies_never_get_a_5xx():
    """hypothesis builds bodies around valid ones (fields dropped, replaced by any JSON value, junk
    fields added) and raw bytes; every answer is < 500 and the server stays healthy."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    json_values = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=20),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=8,
    )
    chat_fields = {
        "model": st.just(MODEL),
        "messages": st.just([{"role": "user", "content": "hi"}]),
        "max_tokens": st.integers(1, 8),
        "temperature": st.floats(0, 2),
        "n": st.integers(1, 3),
        "stream": st.booleans(),
        "top_p": st.floats(0.01, 1),
        "seed": st.integers(0, 99),
        "logprobs": st.booleans(),
        "stop": st.just(["x"]),
        "presence_penalty": st.floats(-2, 2),
        "response_format": st.just({"type": "json_object"}),
        "top_k": st.integers(0, 5),
    }
    completion_fields = {
        "model": st.just(MODEL),
        "prompt": st.just("hi"),
        "max_tokens": st.integers(1, 8),
        "echo": st.booleans(),
        "logprobs": st.integers(0, 5),
        "n": st.integers(1, 3),
        "stream": st.booleans(),
        "stop": st.text(min_size=1, max_size=3),
    }

    def bodies(fields):
        @st.composite
        def build(draw):
            body = {k: draw(v) for k, v in fields.items() if draw(st.booleans()) or k in ("model",)}
            for k in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3)):
                body[k] = draw(json_values)
            for k in draw(st.lists(st.text(max_size=6), max_size=2)):
                body[k] = draw(json_values)
            return body

        return build()

    engine = tiny_engine(tiny_model(max_seq_len=64))
    with live_server(Server(engine, MODEL, max_n=4)) as url, httpx.Client(timeout=60) as client:

        @settings(
            max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        @given(
            path=st.sampled_from(
                ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
            ),
            chat=bodies(chat_fields),
            completion=bodies(completion_fields),
            raw=st.binary(max_size=40),
            use_raw=st.integers(0, 9),
        )
        def check(path, chat, completion, raw, use_raw):
            if use_raw == 0:
                r = client.post(
                    url + path, content=raw, headers={"content-type": "application/json"}
                )
            else:
                body = chat if path == "/v1/chat/completions" else completion
                r = client.post(
                    url + path,
                    content=json.dumps(body),
                    headers={"content-type": "application/json"},
                )
            assert r.status_code < 500, (path, r.status_code, r.text)
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}

        check()
        assert client.get(url + "/health").status_code == 200
        wait_idle(engine)
        assert all_blocks_free(engine)
    del hypothesis


@pytest.mark.slow
def test_cli_serves_and_shuts_down_on_sigterm(tmp_path):
    """`lmstack serve` on a saved checkpoint: the official client gets its answer, then SIGTERM during a stream
    ends the stream (finished in the grace period, or an error event) with [DONE], and the process exits 0."""
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt")
    flags = ("--served-model-name", "ckpt", "--shutdown-timeout", "1")
    with cli_server(ckpt, *flags) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        got = client.completions.create(model="ckpt", prompt="hi", max_tokens=3)
        assert got.usage.completion_tokens == 3
        body = {"model": "ckpt", "prompt": "hi", "max_tokens": 250, "ignore_eos": True}
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 4:  # once (every line counts, the empty ones too)
                    proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        log = proc.log()
    assert [x for x in lines if x][-1] == "data: [DONE]"
    assert "Finished server process" in log, log
    assert "KV cache: float16 (auto: the model computes in fp32 on the CPU" in log, log
