"""Streams on the wire, choice by choice, against the same request not streamed: each choice's chunks join to
its text, its one finish chunk comes last with the non-streamed finish reason, streamed logprobs (tokens,
log-probabilities, text offsets) equal the non-streamed ones; and with ``api_key`` every route of the app's
route table outside the open list refuses a missing or wrong key (a new route cannot slip through)."""

import json

import pytest
from serve_helpers import MODEL, live_server, route_table, tiny_engine

from lmstack.serve import Server, build_app

httpx = pytest.importorskip("httpx")

MESSAGES = [{"role": "user", "content": "Say hello to the server."}]
KEY = "sekret"
OPEN = {"/health", "/metrics", "/", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}


@pytest.fixture(scope="module")
def served():
    with live_server(Server(tiny_engine(), MODEL)) as url:
        yield url


def post(url, path, body):
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url, path, body):
    """The events of one SSE response, parsed; the last event must be [DONE]."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


def per_choice(chunks):
    """index -> that choice's entries, in the order they arrived."""
    out = {}
    for c in chunks:
        for ch in c["choices"]:
            out.setdefault(ch["index"], []).append(ch)
    return out


def check_finish_last(entries, want_reason):
    """Exactly one entry carries a finish_reason, it is the choice's last, and it is the non-streamed one."""
    reasons = [e["finish_reason"] for e in entries]
    assert reasons[-1] == want_reason and all(r is None for r in reasons[:-1]), reasons


def test_chat_stream_choice_by_choice(served):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 1.0,
        "n": 3,
        "seed": 7,
        "stream_options": {"include_usage": True},
    }
    full = post(
        served, "/v1/chat/completions", {k: v for k, v in body.items() if k != "stream_options"}
    )
    chunks = stream(served, "/v1/chat/completions", body)
    assert (
        chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    )  # usage after every choice
    by = per_choice(chunks[:-1])
    assert sorted(by) == [0, 1, 2]
    for i, entries in by.items():
        want = full["choices"][i]
        assert entries[0]["delta"] == {"role": "assistant", "content": ""}
        assert (
            "".join(e["delta"].get("content") or "" for e in entries) == want["message"]["content"]
        )
        check_finish_last(entries, want["finish_reason"])
        assert entries[-1]["delta"] == {}  # the finish chunk carries no content


def test_chat_stream_finish_reasons_stop_and_length(served):
    """Two requests whose one choice ends on a stop string and one on max_tokens: each streamed finish
    reason is the non-streamed one, and no content follows it."""
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    text = post(served, "/v1/chat/completions", base)["choices"][0]["message"]["content"]
    assert len(text) >= 6
    for body in (base, {**base, "stop": [text[3:5]]}):
        full = post(served, "/v1/chat/completions", body)["choices"][0]
        entries = per_choice(stream(served, "/v1/chat/completions", body))[0]
        assert (
            "".join(e["delta"].get("content") or "" for e in entries) == full["message"]["content"]
        )
        check_finish_last(entries, full["finish_reason"])
    assert full["finish_reason"] == "stop" and full["message"]["content"] == text[:3]


def test_completion_stream_text_finish_and_logprobs_per_choice(served):
    prompts = ["hello there", "a different prompt"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 8, "temperature": 0, "logprobs": 2}
    first = post(served, "/v1/completions", body)
    stop = first["choices"][0]["text"][
        4:6
    ]  # choice 0 ends on a stop string, choice 1 on max_tokens
    assert stop and stop not in first["choices"][1]["text"]
    body["stop"] = [stop]
    full = post(served, "/v1/completions", body)
    assert [c["finish_reason"] for c in full["choices"]] == ["stop", "length"]
    by = per_choice(stream(served, "/v1/completions", body))
    assert sorted(by) == [0, 1]
    for k, entries in by.items():
        want = full["choices"][k]
        assert "".join(e["text"] for e in entries) == want["text"]
        check_finish_last(entries, want["finish_reason"])
        lps = [e["logprobs"] for e in entries if e["logprobs"]]
        for field in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
            streamed = [x for lp in lps for x in lp[field]]
            assert streamed == want["logprobs"][field], field
    # the offsets are cumulative character offsets into the choice's text (OpenAI's legacy format), by hand
    lp = full["choices"][1]["logprobs"]
    assert lp["text_offset"] == [
        sum(len(t) for t in lp["tokens"][:j]) for j in range(len(lp["tokens"]))
    ]
    assert len(lp["tokens"]) == 8 and lp["text_offset"][-1] > 0


@pytest.fixture(scope="module")
def keyed():
    server = Server(tiny_engine(), MODEL, api_key=KEY)
    routes = route_table(build_app(server))
    with live_server(server) as url:
        yield url, routes


@pytest.mark.parametrize(
    "auth",
    [None, "Bearer wrong", f"bearer {KEY}", KEY, f"Bearer {KEY}x"],
    ids=["missing", "wrong", "lowercase-scheme", "no-scheme", "key-prefix"],
)
def test_every_protected_route_refuses_a_bad_key(keyed, auth):
    url, routes = keyed
    protected = [(m, p) for m, p in routes if p not in OPEN]
    assert {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    } <= set(protected)
    headers = {} if auth is None else {"Authorization": auth}
    for method, path in protected:
        r = httpx.request(method, url + path, headers=headers, json={}, timeout=30)
        assert r.status_code == 401, (method, path, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key"
    # the right key gets past the check on every one of them (the empty body is then a 400, not a 401)
    for method, path in protected:
        r = httpx.request(
            method, url + path, headers={"Authorization": f"Bearer {KEY}"}, json={}, timeout=30
        )
        assert r.status_code != 401, (method, path)
