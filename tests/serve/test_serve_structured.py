"""Structured output: ``response_format`` json_schema / json_object by grammar-constrained decoding
(llguidance's mask as a logits processor). A random model sampling at temperature 1 would almost
never write JSON; with the mask, 50 sampled generations all parse and validate (jsonschema, an
independent validator)."""

import json

import pytest
from serve_helpers import MODEL, all_blocks_free, live_server, tiny_engine, wait_idle

from lmstack.serve import Server

openai = pytest.importorskip("openai", reason="the official client")
jsonschema = pytest.importorskip("jsonschema", reason="validates the structured output")
pytest.importorskip("llguidance", reason="the grammar library behind response_format")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
        "score": {"anyOf": [{"type": "null"}, {"type": "number", "minimum": -10, "maximum": 10}]},
    },
    "required": ["name", "age", "tags", "active", "score"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine()
    with live_server(Server(engine, MODEL)) as url:
        yield url, engine


@pytest.mark.slow
def test_50_sampled_generations_validate(served):
    url, engine = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    outputs = []
    for seed in range(0, 50, 10):  # choice i samples with seed + i: 50 different seeds
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a person as JSON"}],
            n=10,
            seed=seed,
            temperature=1.0,
            max_tokens=200,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA},
            },
        )
        for c in r.choices:
            assert c.finish_reason == "stop", c.message.content
            outputs.append(c.message.content)
    assert len(outputs) == 50
    for text in outputs:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(outputs)) > 45  # sampled, not one answer repeated
    wait_idle(engine)
    assert all_blocks_free(engine)


def test_json_object_and_streaming(served):
    url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        temperature=1.0,
        max_tokens=150,
        seed=0,  # a seed whose object closes within max_tokens (a cut one is a JSON prefix, finish "length")
        response_format={"type": "json_object"},
    )
    full = client.chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(full.choices[0].message.content), dict)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices
    )
    assert streamed == full.choices[0].message.content
    free = client.chat.completions.create(**{**kw, "response_format": {"type": "text"}})
    with pytest.raises(json.JSONDecodeError):  # the same sampler without the mask writes no JSON
        json.loads(free.choices[0].message.content)


def test_bad_schema_is_a_400(served):
    import httpx

    r = httpx.post(
        served[0] + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize(
    "schema",
    [
        {
            "type": "string",
            "pattern": "^a{1000000}$",
        },  # compiles, fails at the first step (was a 500)
        {
            "$ref": "#"
        },  # refers only to itself: admits only the empty output (was a 200 with content "")
        {
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            "$ref": "#/$defs/a",
        },  # a -> b -> a
        {
            "type": "object",
            "properties": {"x": {"$ref": "#"}},
            "required": ["x"],
        },  # every object needs another
    ],
)
def test_schemas_that_compile_but_admit_nothing_are_400s(served, schema):
    import httpx

    r = httpx.post(
        served[0] + "/v1/chat/completions",
        timeout=60,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 8,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
        },
    )
    if r.status_code == 200:  # only acceptable if what came back is JSON that validates
        content = r.json()["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), schema)
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "response_format"
