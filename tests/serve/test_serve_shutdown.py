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
