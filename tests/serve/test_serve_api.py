"""The OpenAI API through the official ``openai`` client (sync and async, streaming and not) against a
live uvicorn server on 127.0.0.1 serving a tiny random model: the answers equal the offline engine's
(``LLM``) and a plain full-recompute reference written here (the model's forward, no cache)."""

import asyncio

import pytest
import torch
from serve_helpers import (
    MODEL,
    all_blocks_free,
    live_server,
    tiny_engine,
    tiny_model,
    tiny_tokenizer,
    wait_idle,
)

from lmstack.inference import LLM
from lmstack.inference.sampling import SamplingParams
from lmstack.serve import Server

openai = pytest.importorskip(
    "openai", reason="the tests drive the server with the official `openai` client"
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello to the server."},
]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def served(model):
    engine = tiny_engine(model)
    with live_server(Server(engine, MODEL)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def llm(model):
    tok = tiny_tokenizer()
    return LLM(model, tok, eos_token_id=tok.eos_token_id, block_size=4, num_blocks=512)


def chat_ids(messages):
    tok = tiny_tokenizer()
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


@torch.no_grad()
def reference_greedy(model, ids, n, eos, presence=0.0, frequency=0.0):
    """No cache: the whole sequence runs again for each token; OpenAI's penalties written out
    (logit[j] -= count[j]·frequency + [count[j] > 0]·presence over the output so far)."""
    ids, out, logps = list(ids), [], []
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1].double()
        logps.append(torch.log_softmax(logits, -1))
        for j in set(out):
            logits[j] -= out.count(j) * frequency + presence
        t = int(logits.argmax())
        out.append(t)
        ids.append(t)
        if t == eos:
            break
    return out, logps


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    import httpx

    assert httpx.get(served[0] + "/health").json() == {"status": "ok"}


def test_greedy_chat_equals_llm_generate_and_the_reference(client, llm, model):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    ref = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12))
    tok = tiny_tokenizer()
    plain, _ = reference_greedy(model, chat_ids(MESSAGES), 12, tok.eos_token_id)
    assert ref.token_ids == plain
    assert (
        r.choices[0].message.content
        == ref.text
        == tok.decode([t for t in plain if t != tok.eos_token_id])
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if plain[-1] == tok.eos_token_id else "length")
    assert r.usage.prompt_tokens == len(chat_ids(MESSAGES))
    assert r.usage.completion_tokens == len(plain)
    assert r.usage.total_tokens == len(chat_ids(MESSAGES)) + len(plain)


def test_stream_concatenates_to_the_non_streamed_text(client):
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format(served):
    """The bytes on the wire: `data: {...}` events separated by blank lines, ending in `data: [DONE]`."""
    import json

    import httpx

    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", served[0] + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ")
        assert json.loads(e[6:])["object"] == "chat.completion.chunk"


def test_async_client_stream_and_not(served, client):
    async def main():
        ac = openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key="unused")
        full = await ac.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0
        )
        stream = await ac.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await ac.close()
        return full.choices[0].message.content, "".join(parts)

    full, streamed = asyncio.run(main())
    assert (
        full
        == streamed
        == client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0
        )
        .choices[0]
        .message.content
    )


def test_n2_with_a_seed_is_reproducible_and_equals_the_engine(client, llm):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, n=2, seed=1234)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1]
    # choice i samples with seed + i
    ids = chat_ids(MESSAGES)
    refs = llm.generate(
        [ids, ids],
        [SamplingParams(temperature=1.0, max_tokens=10, seed=1234 + i) for i in range(2)],
    )
    assert [c.message.content for c in a.choices] == [r.text for r in refs]
    assert a.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    streamed = ["", ""]
    for c in client.chat.completions.create(**kw, stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == [c.message.content for c in a.choices]


def test_logprobs_equal_the_engine_and_the_model(client, llm, model):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    ref = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=6, logprobs=3))
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.logprobs) == len(ref.token_ids)
    _, logps = reference_greedy(model, chat_ids(MESSAGES), 6, tiny_tokenizer().eos_token_id)
    tok = tiny_tokenizer()
    for entry, (lp, top), t, plain in zip(content, ref.logprobs, ref.token_ids, logps):
        assert entry.logprob == pytest.approx(lp, abs=1e-9)
        assert entry.logprob == pytest.approx(float(plain[t]), abs=1e-6)
        assert bytes(entry.bytes) == tok.decode_bytes([t])
        assert [x.logprob for x in entry.top_logprobs] == pytest.approx(
            sorted(top.values(), reverse=True), abs=1e-9
        )
        assert [x.logprob for x in entry.top_logprobs] == pytest.approx(
            plain.topk(3).values.tolist(), abs=1e-6
        )
    streamed = []
    for c in client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    ):
        if c.choices and c.choices[0].logprobs:
            streamed += [x.logprob for x in c.choices[0].logprobs.content]
    assert streamed == [x.logprob for x in content]


def test_completions_prompts_echo_stop_and_logprobs(client, llm, model):
    tok = tiny_tokenizer()
    prompts = ["hello there", "a different prompt"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [c.text for c in r.choices] == [x.text for x in refs]
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    ids = tok.encode("hello there")
    r_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r_ids.choices[0].text == refs[0].text
    echo = client.completions.create(
        model=MODEL, prompt="hello there", max_tokens=8, temperature=0, echo=True
    )
    assert echo.choices[0].text == "hello there" + refs[0].text
    lp = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=2)
    plain, logps = reference_greedy(model, ids, 5, tok.eos_token_id)
    assert lp.choices[0].logprobs.token_logprobs == pytest.approx(
        [float(l[t]) for l, t in zip(logps, plain)], abs=1e-6
    )
    assert lp.choices[0].logprobs.text_offset[0] == 0
    # a stop string cuts the text before it
    text = refs[0].text
    if len(text) >= 4:
        stop = text[2:4]
        cut = client.completions.create(
            model=MODEL, prompt="hello there", max_tokens=8, temperature=0, stop=[stop]
        )
        assert (
            cut.choices[0].text == text[: text.find(stop)]
            and cut.choices[0].finish_reason == "stop"
        )
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="hello there", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == refs[0].text


def test_extras_and_penalties(client, llm, model):
    """lmstack extras as extra body fields; OpenAI's presence/frequency penalties against the formula."""
    greedy = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0
    )
    top1 = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=1.5,
        extra_body={"top_k": 1, "min_p": 0.0},
    )
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    rep = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        extra_body={"repetition_penalty": 1.3},
    )
    ref = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3))
    assert rep.choices[0].message.content == ref.text
    tok = tiny_tokenizer()
    for presence, frequency in [(1.5, 0.0), (0.0, 1.0), (0.5, 0.7)]:
        r = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            presence_penalty=presence,
            frequency_penalty=frequency,
        )
        plain, _ = reference_greedy(
            model, chat_ids(MESSAGES), 12, tok.eos_token_id, presence, frequency
        )
        assert r.choices[0].message.content == tok.decode(
            [t for t in plain if t != tok.eos_token_id]
        )


def test_tokenize_detokenize(served):
    import httpx

    tok = tiny_tokenizer()
    r = httpx.post(served[0] + "/tokenize", json={"prompt": "hi there"}).json()
    assert r["tokens"] == tok.encode("hi there") and r["count"] == 8
    r = httpx.post(served[0] + "/tokenize", json={"messages": MESSAGES}).json()
    assert r["tokens"] == chat_ids(MESSAGES)
    assert httpx.post(served[0] + "/detokenize", json={"tokens": tok.encode("héllo")}).json() == {
        "prompt": "héllo"
    }


def test_engine_is_idle_and_every_block_free_afterwards(served, client):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    wait_idle(served[1])
    assert all_blocks_free(served[1])


def test_prompt_lookup_speculation_keeps_the_greedy_text(client, model):
    """`lmstack serve --speculative-tokens K`: drafts change the speed, not the greedy text."""
    engine = tiny_engine(model, num_speculative_tokens=3)
    messages = [{"role": "user", "content": "abc abc abc abc abc abc"}]
    with live_server(Server(engine, MODEL)) as url:
        spec = openai.OpenAI(base_url=url + "/v1", api_key="unused").chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0
        )
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.model_dump() == plain.usage.model_dump()
