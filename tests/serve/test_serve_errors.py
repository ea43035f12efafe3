"""Bad input, auth, load and failures: 4xx with OpenAI's error object (never a 5xx for bad input),
401 without the key, 429 when full (or a wait), a failing request that takes no other down."""

import json
import threading
import time

import pytest
from serve_helpers import (
    MODEL,
    all_blocks_free,
    live_server,
    route_table,
    tiny_engine,
    tiny_model,
    wait_idle,
)

from lmstack.serve import Server

httpx = pytest.importorskip("httpx", reason="raw HTTP requests")
openai = pytest.importorskip("openai", reason="the official client")

USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine(tiny_model(max_seq_len=128))
    with live_server(Server(engine, MODEL, max_n=4)) as url:
        yield url, engine


def check_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_json(served, path):
    r = httpx.post(
        served[0] + path,
        content=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert "JSON" in check_error(r, 400)["message"]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": MODEL, "messages": USER, "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "messages": USER, "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "messages": "hello"}, 400, "messages"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ({"model": MODEL, "messages": USER, "n": 0}, 400, "n"),
        ({"model": MODEL, "messages": USER, "n": 5}, 400, "n"),  # max_n=4
        ({"model": MODEL, "messages": USER, "max_tokens": 500}, 400, "max_tokens"),  # context 128
        ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 200}]}, 400, "messages"),
        ({"model": MODEL, "messages": USER, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": MODEL, "messages": USER, "top_logprobs": 3}, 400, "top_logprobs"),
        (
            {"model": MODEL, "messages": USER, "response_format": {"type": "json_schema"}},
            400,
            "response_format",
        ),
        ({"model": "gpt-9", "messages": USER}, 404, "model"),
    ],
)
def test_chat_bad_requests(served, body, status, param):
    r = httpx.post(served[0] + "/v1/chat/completions", json=body)
    check_error(r, status, param)


@pytest.mark.parametrize(
    "body, status",
    [
        ({"model": MODEL, "prompt": ""}, 400),
        ({"model": MODEL, "prompt": []}, 400),
        ({"model": MODEL, "prompt": [1, 2, 999]}, 400),
        ({"model": MODEL, "prompt": "x", "logprobs": 9}, 400),
        (
            {"model": MODEL, "prompt": "x", "max_tokens": 0},
            400,
        ),  # max_tokens=0 only with echo (score the prompt)
        ({"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400),
        (
            {"model": MODEL, "prompt": "x", "max_tokens": 0, "echo": True, "stream": True},
            400,
        ),  # no token to drop in a stream
        ({"model": MODEL, "prompt": "x", "max_tokens": -1, "echo": True}, 400),
        ({"model": MODEL, "prompt": ["a", "b", "c"], "n": 2}, 400),
        ({"model": MODEL, "prompt": {"a": 1}}, 400),
    ],
)
def test_completion_bad_requests(served, body, status):
    check_error(httpx.post(served[0] + "/v1/completions", json=body), status)


def test_unknown_route_and_method(served):
    check_error(httpx.get(served[0] + "/v1/nothing"), 404)
    check_error(httpx.get(served[0] + "/v1/chat/completions"), 405)


def test_openai_client_sees_the_errors(served):
    client = openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=USER)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1000)
    # and the server still answers
    assert (
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
        .choices[0]
        .message.content
        != ""
    )


def test_api_key():
    with live_server(Server(tiny_engine(), MODEL, api_key="sekrit")) as url:
        check_error(
            httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": USER}), 401
        )
        check_error(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sekrit")
        assert (
            ok.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=2
            ).usage.completion_tokens
            == 2
        )
        assert httpx.get(url + "/health").status_code == 200  # health and metrics stay open


def _hold_a_stream(url, started: threading.Event, stop: threading.Event):
    body = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
        "user": "slow",
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                break


def _slow_sampling(monkeypatch):
    """Requests with user="slow" take ~20 ms a token: a stream that surely holds its slot."""
    from lmstack.serve import server as server_module

    real = server_module.Server.sampling

    def slow(output_ids, logits):
        time.sleep(0.02)
        return logits

    def sampling(self, body, max_tokens, logprobs, index, processors=()):
        extra = [slow] if body.user == "slow" else []
        return real(self, body, max_tokens, logprobs, index, list(processors) + extra)

    monkeypatch.setattr(server_module.Server, "sampling", sampling)


def test_full_queue_answers_429_or_waits(monkeypatch):
    _slow_sampling(monkeypatch)
    engine = tiny_engine(max_num_seqs=1)
    for timeout, expect in [(0.0, 429), (30.0, 200)]:
        with live_server(Server(engine, MODEL, max_queue=0, queue_timeout=timeout)) as url:
            started, stop = threading.Event(), threading.Event()
            t = threading.Thread(target=_hold_a_stream, args=(url, started, stop))
            t.start()
            assert started.wait(30)
            if expect == 200:
                threading.Timer(0.5, stop.set).start()  # room comes back while the second one waits
            r = httpx.post(
                url + "/v1/chat/completions",
                json={"model": MODEL, "messages": USER, "max_tokens": 2},
                timeout=60,
            )
            stop.set()
            t.join()
            if expect == 429:
                assert check_error(r, 429)["code"] == "queue_full"
                assert "lmstack_requests_rejected_total 1.0" in httpx.get(url + "/metrics").text
            else:
                assert r.status_code == 200, r.text
            wait_idle(engine)
            assert all_blocks_free(engine)


def test_a_failing_request_takes_no_other_down(served, monkeypatch):
    """A request whose sampling raises inside the engine loop gets a 500 error object; requests
    running beside it finish normally and the loop serves the next ones."""
    url, engine = served
    server = None
    from lmstack.serve import server as server_module

    real = server_module.Server.sampling

    def boom(output_ids, logits):
        if len(output_ids) >= 2:
            raise RuntimeError("boom")
        return logits

    def sampling(self, body, max_tokens, logprobs, index, processors=()):
        extra = [boom] if body.user == "boom" else []
        return real(self, body, max_tokens, logprobs, index, list(processors) + extra)

    monkeypatch.setattr(server_module.Server, "sampling", sampling)
    results = {}

    def call(name, user):
        results[name] = httpx.post(
            url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": USER,
                "max_tokens": 30,
                "user": user,
                "ignore_eos": True,
            },
            timeout=60,
        )

    threads = [threading.Thread(target=call, args=(f"good{i}", "ok")) for i in range(3)]
    threads.append(threading.Thread(target=call, args=("bad", "boom")))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert check_error(results["bad"], 500)["type"] == "server_error"
    assert "boom" in results["bad"].json()["error"]["message"]
    for i in range(3):
        assert results[f"good{i}"].json()["usage"]["completion_tokens"] == 30
    stream = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "max_tokens": 30, "user": "boom", "stream": True},
        timeout=60,
    )
    assert (
        stream.status_code == 200
        and '"server_error"' in stream.text
        and stream.text.endswith("data: [DONE]\n\n")
    )
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    wait_idle(engine)
    assert all_blocks_free(engine)
    del server


def test_a_client_leaving_a_non_streamed_request_aborts_it(served, monkeypatch):
    _slow_sampling(monkeypatch)  # 200 tokens at ~20 ms each: still running when the client leaves
    url, engine = served
    before = engine.stats["generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": USER,
                "max_tokens": 100,
                "ignore_eos": True,
                "user": "slow",
            },
            timeout=0.5,
        )
    wait_idle(engine, timeout=10)
    assert all_blocks_free(engine)
    assert engine.stats["generated_tokens"] - before < 100


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
            "messages",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", '
            b'"text": "\\udfff"}]}]}',
            "messages",
        ),
        ("/v1/completions", b'{"model": "%s", "prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", b'{"model": "%s", "prompt": ["ok", "\\ud800"]}', "prompt"),
        ("/v1/completions", b'{"model": "%s", "prompt": "ok", "stop": "\\ud800"}', "stop"),
        ("/tokenize", b'{"model": "%s", "prompt": "x\\ud800"}', "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(served, path, body, param):
    """JSON can carry "\\ud800", which no UTF-8 text holds: the tokenizer would raise (a 500 before issue #31)."""
    r = httpx.post(
        served[0] + path,
        content=body.replace(b"%s", MODEL.encode()),
        headers={"content-type": "application/json"},
    )
    err = check_error(r, 400, param)
    assert "surrogate" in err["message"]


def test_an_empty_api_key_is_refused_not_an_open_server():
    engine = tiny_engine(tiny_model(max_seq_len=64))
    with pytest.raises(ValueError, match="api_key is empty"):
        Server(engine, MODEL, api_key="")
    with pytest.raises(ValueError, match="api_key is empty"):
        Server(engine, MODEL, api_key="  ")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--api-key", ""], "--api-key is empty"),
        (["--port", "99999"], "--port 99999: expected 1..65535"),
        (["--queue-timeout", "nan"], "--queue-timeout nan"),
        (["--shutdown-timeout", "-5"], "--shutdown-timeout -5.0"),
        (["--kv-cache-mb", "1000000000"], "more than this machine's available memory"),
        (["--max-seqs", "0"], "--max-seqs 0"),
    ],
)
def test_serve_flags_are_checked_before_anything_loads(flags, message, capsys):
    from lmstack.cli import main

    assert main(["serve", "--model", "no-such-model-is-loaded", *flags]) == 2
    assert message in capsys.readouterr().err


def test_with_a_key_every_route_but_health_and_the_chat_page_needs_it():
    """One test over the whole route table (a new route cannot slip through): /v1/*, /tokenize, /detokenize,
    /docs, /openapi.json, /metrics... refuse a missing or wrong key; /health and / answer; --public-metrics opens
    /metrics only."""
    from lmstack.serve import build_app
    from lmstack.serve.guards import PUBLIC_ROUTES

    server = Server(tiny_engine(), MODEL, api_key="sekret")
    routes = [(p, m) for m, p in route_table(build_app(server))]
    assert (
        ("/tokenize", "POST") in routes
        and ("/openapi.json", "GET") in routes
        and ("/metrics", "GET") in routes
    )
    with live_server(server) as url:
        for path, method in routes:
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "bearer sekret"},
            ):
                r = httpx.request(
                    method, url + path, headers=headers, json={} if method == "POST" else None
                )
                if path in PUBLIC_ROUTES:
                    assert r.status_code == 200, (path, r.status_code)
                else:
                    assert r.status_code == 401, (path, method, headers, r.status_code)
        ok = httpx.get(url + "/openapi.json", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and "/v1/chat/completions" in ok.json()["paths"]
    with live_server(Server(tiny_engine(), MODEL, api_key="sekret", public_metrics=True)) as url:
        assert httpx.get(url + "/metrics").status_code == 200
        assert httpx.get(url + "/docs").status_code == 401


def test_bodies_over_the_limit_get_413():
    server = Server(tiny_engine(), MODEL, max_body_bytes=2000)
    with live_server(server) as url:
        big = {"model": MODEL, "prompt": "x" * 5000}
        err = check_error(httpx.post(url + "/tokenize", json=big), 413)
        assert "2000 bytes" in err["message"]

        def chunks():  # no Content-Length: the limit stops the streamed body
            for _ in range(10):
                yield b" " * 500

        check_error(
            httpx.post(
                url + "/tokenize", content=chunks(), headers={"content-type": "application/json"}
            ),
            413,
        )
        assert (
            httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "hello"}).status_code
            == 200
        )


def test_health_answers_during_a_large_tokenize():
    """Issue #31: /health took 11 s during a 5 MB /tokenize. The encoding (native, GIL released) and the
    answer's JSON (3M ids: FastAPI's encoder took 8 s of the event loop) both run in a worker thread now."""
    server = Server(tiny_engine(), MODEL)  # default limit (4 MiB): a ~3 MB prompt is accepted
    with live_server(server) as url:
        done, answer = threading.Event(), []

        def tokenize():
            answer.append(
                httpx.post(
                    url + "/tokenize",
                    json={"model": MODEL, "prompt": "ab cd " * 500_000},
                    timeout=120,
                )
            )
            done.set()

        t = threading.Thread(target=tokenize)
        t.start()
        time.sleep(0.2)
        worst = 0.0
        while not done.is_set():
            t0 = time.perf_counter()
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.05)
        t.join()
        assert worst < 1.0, worst
    got = json.loads(
        answer[0].content
    )  # the byte-level tokenizer: one id per byte, the byte's value
    assert got["count"] == 3_000_000 and got["tokens"] == list(b"ab cd ") * 500_000


@pytest.mark.parametrize(
    "extra, param",
    [
        # tool_choice "auto" (the default with tools) on a template that renders no tools (test_serve_tools.py)
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"parallel_tool_calls": True}, "parallel_tool_calls"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"a": 5}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
    ],
)
def test_unimplemented_openai_fields_are_400s_not_ignored(served, extra, param):
    r = httpx.post(
        served[0] + "/v1/chat/completions", json={"model": MODEL, "messages": USER, **extra}
    )
    check_error(r, 400, param)


def test_best_of_other_than_n_is_refused(served):
    r = httpx.post(
        served[0] + "/v1/completions", json={"model": MODEL, "prompt": "hi", "best_of": 3}
    )
    check_error(r, 400, "best_of")


def test_logit_bias_is_applied(served):
    """OpenAI's logit_bias (was silently ignored): +100 on one token makes greedy pick it every step; -100 on the
    unbiased greedy continuation's first token makes the first token change."""
    url = served[0]
    base = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(url + "/v1/completions", json={**base, "logit_bias": {"7": 100}, "logprobs": 1})
    assert r.status_code == 200, r.text
    plain = httpx.post(url + "/v1/completions", json={**base, "logprobs": 1}).json()["choices"][0]
    first = httpx.post(
        url + "/tokenize", json={"model": MODEL, "prompt": plain["logprobs"]["tokens"][0]}
    ).json()
    biased = httpx.post(
        url + "/tokenize", json={"model": MODEL, "prompt": r.json()["choices"][0]["text"]}
    ).json()
    assert biased["tokens"] == [7] * 4
    banned = httpx.post(
        url + "/v1/completions",
        json={**base, "logprobs": 1, "logit_bias": {str(first["tokens"][0]): -100}},
    ).json()
    assert banned["choices"][0]["logprobs"]["tokens"][0] != plain["logprobs"]["tokens"][0]


def test_error_objects_name_the_right_param_and_head_is_allowed(served):
    """Issue #31: malformed JSON reported param "1" (an offset), stop "" param null, HEAD / a 405."""
    url = served[0]
    r = httpx.post(
        url + "/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert check_error(r, 400)["param"] is None
    r = httpx.post(
        url + "/v1/chat/completions", json={"model": MODEL, "messages": USER, "stop": ""}
    )
    check_error(r, 400, "stop")
    assert (
        httpx.head(url + "/").status_code == 200 and httpx.head(url + "/health").status_code == 200
    )


def test_requests_the_http_parser_refuses_get_json_error_objects(served):
    """Issue #31: a 1 MB Authorization header got uvicorn's plain-text 400; now 431 with OpenAI's error object
    (h11 buffers 16 KiB of request head), and a garbage request line a JSON 400."""
    import socket

    url = served[0]
    r = httpx.post(
        url + "/v1/completions", headers={"Authorization": "Bearer " + "x" * 2**20}, json={}
    )
    assert r.headers["content-type"] == "application/json"
    assert check_error(r, 431)["code"] == "request_header_fields_too_large"
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GARBAGE\r\n\r\n")
        raw = b""
        while chunk := s.recv(4096):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower()
    err = httpx.Response(400, content=body).json()["error"]
    assert (
        set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_http_request"
    )
