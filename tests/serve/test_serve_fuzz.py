"""Schema fuzzing of every POST route, in-process (Starlette's TestClient over the app): hypothesis replaces
fields of a valid body — each field of the route's request schema (read from the app's own OpenAPI document,
so a new route or field is fuzzed too) and the nested fields of the valid body — by arbitrary JSON values, or
drops them. No answer may be a 5xx; a 4xx is OpenAI's error object (checked with jsonschema) whose ``param``,
when set, names a field of the body; a stream ends in ``[DONE]`` with no server error inside it."""

import json

import pytest
from serve_helpers import MODEL, all_blocks_free, tiny_engine, tiny_model, wait_idle

from lmstack.serve import Server, build_app

hypothesis = pytest.importorskip("hypothesis")
jsonschema = pytest.importorskip("jsonschema")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

#: OpenAI's error object, as its API reference describes it
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "additionalProperties": False,
            "properties": {
                "message": {"type": "string", "minLength": 1},
                "type": {"type": "string", "minLength": 1},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
VALID = {
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
    },
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 3},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [104, 105]},
}
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["", "\ud800", "user", "text", MODEL, "json_object", "none"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
#: values of the valid body's own type at their edges (a lone surrogate, the chat template's own markers,
#: 64-bit overflow, ...): they get past type validation and reach the tokenizer, the template, the engine
EDGES = {
    str: st.sampled_from(["", " ", "\ud800", "a\udfffb", "<|im_end|>", "x" * 300, "\x00", "日本"]),
    int: st.sampled_from([0, 1, -1, 255, 257, 258, 2**31, 2**63, 2**64, -(2**63) - 1, 10**6]),
    list: st.sampled_from([[], [0], [257], [258], [-1], [[1]], ["a"], [None]]),
}


@pytest.fixture(scope="module")
def app_and_engine():
    engine = tiny_engine(tiny_model(max_seq_len=64))
    app = build_app(Server(engine, MODEL, max_n=2))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield app, client, engine


def post_routes(app) -> dict[str, set[str]]:
    """path -> the top-level fields of its JSON body, from the app's OpenAPI document."""
    doc = app.openapi()
    out = {}
    for path, ops in doc["paths"].items():
        if "post" in ops:
            ref = ops["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            out[path] = set(doc["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"])
    return out


def paths_of(value, prefix=()):
    """Every nested key path of a JSON value (dict keys, list indices)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for k, v in items:
        yield (*prefix, k)
        yield from paths_of(v, (*prefix, k))


def container(body, keys):
    """The dict or list at ``keys`` inside ``body`` (None: an earlier change removed or replaced it)."""
    for k in keys:
        if isinstance(body, dict) and k in body:
            body = body[k]
        elif isinstance(body, list) and isinstance(k, int) and k < len(body):
            body = body[k]
        else:
            return None
    return body if isinstance(body, dict | list) else None


@st.composite
def bodies(draw, path, fields):
    """A valid body of ``path`` with fields replaced by arbitrary JSON values or dropped."""
    body = json.loads(json.dumps(VALID[path]))
    own = list(paths_of(body))  # the valid body's fields, nested ones included
    targets = st.sampled_from(own) | st.sampled_from(sorted((f,) for f in fields))
    for target in draw(st.lists(targets, min_size=1, max_size=3)):
        parent, key = container(body, target[:-1]), target[-1]
        if isinstance(parent, dict) and draw(st.integers(0, 4)) == 0:
            parent.pop(key, None)
        elif isinstance(parent, dict) or (isinstance(key, int) and key < len(parent or ())):
            old = parent.get(key) if isinstance(parent, dict) else parent[key]
            edge = EDGES.get(type(old))
            parent[key] = draw(edge) if edge is not None and draw(st.booleans()) else draw(JSON)
    return body


def check_answer(r, body, fields):
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()
        jsonschema.validate(err, ERROR_SCHEMA)
        param = err["error"]["param"]
        if param is not None:  # "messages", "prompt[1]", "stream_options.include_usage", ...
            assert param.split(".")[0].split("[")[0] in fields, (param, body)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]", events[-3:]
        for e in events[:-1]:
            chunk = json.loads(e.removeprefix("data: "))
            assert chunk.get("error", {}).get("type") != "server_error", (body, chunk)
    else:
        r.json()


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(VALID))
def test_fuzzed_fields_never_get_a_5xx(app_and_engine, path):
    app, client, engine = app_and_engine
    routes = post_routes(app)
    assert set(routes) == set(VALID), "a POST route without a valid body here is not fuzzed"
    fields = routes[path]

    @settings(
        max_examples=50,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies(path, fields))
    def check(body):
        raw = json.dumps(body)  # ASCII: a lone surrogate travels as its \\u escape, as JSON allows
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        check_answer(r, body, fields)

    check()
    assert client.get("/health").status_code == 200
    wait_idle(engine)
    assert all_blocks_free(engine)
