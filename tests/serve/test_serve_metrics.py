"""``GET /metrics`` parsed with prometheus-client's own parser: the counts equal what the requests
did (tokens from the responses' usage, one TTFT / e2e sample per request, tokens − 1 inter-token
gaps each), the KV gauges equal the pool when idle, the prefix-cache rate a hand count."""

import pytest
from serve_helpers import MODEL, live_server, tiny_engine, tiny_tokenizer, wait_idle

from lmstack.serve import Server

httpx = pytest.importorskip("httpx", reason="raw HTTP requests")


def scrape(url) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_metrics_count_what_happened():
    engine = tiny_engine()  # block size 4, 511 usable blocks
    with live_server(Server(engine, MODEL)) as url:
        m0 = scrape(url)
        assert m0[("lmstack_kv_blocks_free", ())] == 511 and m0[("lmstack_kv_blocks_used", ())] == 0
        assert m0[("lmstack_requests_running", ())] == 0
        messages = [{"role": "user", "content": "the same prompt twice"}]
        usages = []
        for n_tokens in (5, 9):
            r = httpx.post(
                url + "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": messages,
                    "max_tokens": n_tokens,
                    "ignore_eos": True,
                },
            )
            usages.append(r.json()["usage"])
        wait_idle(engine)
        m = scrape(url)
        completion = sum(u["completion_tokens"] for u in usages)
        assert completion == 14
        assert m[("lmstack_generation_tokens_total", ())] == completion
        assert m[("lmstack_prompt_tokens_total", ())] == sum(u["prompt_tokens"] for u in usages)
        assert m[("lmstack_time_to_first_token_seconds_count", ())] == 2
        assert m[("lmstack_e2e_request_latency_seconds_count", ())] == 2
        assert m[("lmstack_inter_token_latency_seconds_count", ())] == (5 - 1) + (9 - 1)
        assert m[("lmstack_requests_total", (("finish_reason", "length"),))] == 2
        assert m[("lmstack_tokens_per_second", ())] > 0
        assert m[("lmstack_kv_blocks_used", ())] == 0 and m[("lmstack_kv_blocks_free", ())] == 511
        # prefix cache: the second request finds the first one's full 4-token blocks of the prompt, then
        # the block that holds the prompt's tail (filled by the first request's tokens: full and named) as a
        # partial hit: every prompt token but the last
        P = len(
            tiny_tokenizer().encode(
                tiny_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
            )
        )
        assert usages[0]["prompt_tokens"] == P
        cached = P - 1  # all but the last prompt token, which is always computed
        assert m[("lmstack_prefix_cache_hit_rate", ())] == pytest.approx(cached / (2 * P))
