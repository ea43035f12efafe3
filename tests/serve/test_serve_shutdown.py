"""``lmstack serve`` in a subprocess: SIGTERM past ``--shutdown-timeout`` ends a non-streamed request with a
503 error object and a stream with an error event then ``[DONE]`` (no CancelledError traceback in the log),
and exits 0; the server's start-up memory is bounded by what its KV pool needs, not a fixed 512 MiB."""

import json
import signal
import threading
import time

import pytest
from serve_helpers import cli_server, save_tiny_checkpoint

httpx = pytest.importorskip("httpx", reason="raw HTTP requests")

ERROR_KEYS = {"message", "type", "param", "code"}


def running(url) -> float:
    """``lmstack_requests_running`` read from /metrics."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("lmstack_requests_running "):
            return float(line.split()[1])
    raise AssertionError("no lmstack_requests_running in /metrics")


@pytest.mark.slow
def test_sigterm_past_the_grace_period_answers_503_and_ends_streams_with_an_error(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", max_seq_len=4096)
    long = {"model": str(ckpt), "prompt": "hi", "max_tokens": 4000, "ignore_eos": True}
    with cli_server(ckpt, "--shutdown-timeout", "1", "--kv-cache-mb", "16") as (proc, url):
        plain = {}

        def non_streamed():
            try:
                plain["r"] = httpx.post(url + "/v1/completions", json=long, timeout=60)
            except httpx.TransportError as e:  # the server closed the connection: no answer at all
                plain["r"] = e

        worker = threading.Thread(target=non_streamed)
        worker.start()
        events = []
        with httpx.stream(
            "POST", url + "/v1/completions", json={**long, "stream": True}, timeout=60
        ) as r:
            assert r.status_code == 200
            try:
                for line in r.iter_lines():
                    if not line:
                        continue
                    events.append(line)
                    if len(events) == 3:  # both requests are running: stop the server (once: twice
                        # is uvicorn's force-quit)
                        start = time.monotonic()
                        while running(url) < 2:
                            assert time.monotonic() - start < 30, "the requests did not start"
                            time.sleep(0.05)
                        proc.send_signal(signal.SIGTERM)
            except httpx.TransportError:
                pass  # cut without an error event: the assertions below say so
        worker.join(60)
        assert proc.wait(60) == 0
        log = proc.log()
    # the stream: text chunks, then one error event, then [DONE]
    assert events[-1] == "data: [DONE]", (events[-3:], log)
    error = json.loads(events[-2].removeprefix("data: "))
    assert set(error) == {"error"} and set(error["error"]) == ERROR_KEYS, error
    assert "shutting down" in error["error"]["message"]
    assert all("choices" in json.loads(e.removeprefix("data: ")) for e in events[:-2])
    # the non-streamed request: 503 with OpenAI's error object
    r = plain["r"]
    assert isinstance(r, httpx.Response), r
    assert r.status_code == 503, r.text
    assert set(r.json()["error"]) == ERROR_KEYS and "shutting down" in r.json()["error"]["message"]
    assert "CancelledError" not in log and "Traceback" not in log, log
    assert "Finished server process" in log, log


def test_the_default_kv_pool_is_what_every_seat_needs_at_full_length():
    """Hand count: the tiny model (float64, 2 layers, 2 KV heads of 64/4 = 16) keeps 2·2·2·16 = 128 elements of
    8 bytes per token; 64 seats x ceil(256/16) = 16 blocks of 16 tokens, + the null block."""
    import types

    import torch
    from serve_helpers import tiny_model

    from lmstack.model.config import ModelConfig
    from lmstack.serve.cli import default_kv_cache_bytes

    assert default_kv_cache_bytes(tiny_model(), 64, None) == (64 * 16 + 1) * 16 * 128 * 8
    assert default_kv_cache_bytes(tiny_model(), 2, 100) == (2 * 7 + 1) * 16 * 128 * 8
    big = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3)
    fake = types.SimpleNamespace(config=big, parameters=lambda: iter([torch.empty(0)]))
    assert default_kv_cache_bytes(fake, 64, None) == 512 * 2**20  # SmolLM2-135M: capped


@pytest.mark.slow
def test_start_up_rss_grows_by_the_kv_pool_it_needs_not_512_mib(tmp_path):
    """Issue #31: a 430 KB model's server started at 843 MiB (a 512 MiB pool, zeroed at start). The same server
    with a 1 MiB pool is the baseline; the default one may add only its pool (the hand count above, in fp16)."""
    psutil = pytest.importorskip("psutil", reason="RSS measurement")
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt")
    rss = {}
    for name, flags in (("baseline", ["--kv-cache-mb", "1"]), ("default", [])):
        with cli_server(ckpt, *flags) as (proc, _):
            rss[name] = psutil.Process(proc.pid).memory_info().rss
    pool = (64 * 16 + 1) * 16 * 128 * 2  # 4.1 MiB: the fp32 model's K/V kept in fp16 (auto)
    noise = 16 * 2**20  # two processes' allocators differ by a few MiB
    grew = rss["default"] - rss["baseline"]
    assert grew < pool + noise, f"{grew / 2**20:.1f} MiB more than with a 1 MiB pool"


def test_requests_after_the_drain_began_get_503():
    """While the server drains, a new request on an open connection is refused before it is queued."""
    from serve_helpers import MODEL, tiny_engine
    from starlette.testclient import TestClient

    from lmstack.serve import Server, build_app

    server = Server(tiny_engine(), MODEL)
    with TestClient(build_app(server)) as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
        client.portal.call(server.drain, 0.0)
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text
        assert set(r.json()["error"]) == ERROR_KEYS
        assert r.json()["error"]["code"] == "server_shutting_down"
        assert client.get("/health").status_code == 200  # liveness is not admission
