"""``GET /metrics``: the server's state and latencies in Prometheus' text format (prometheus-client).

CS336 notes "性能指标分析" (TTFT, per-token latency, throughput are what users feel) and "动态负载"
(requests waiting vs running, paged KV blocks). Gauges are read from the engine when scraped;
the histograms are fed by each finished request (TTFT = first token − arrival, inter-token
latency = gaps between token times, end-to-end = finish − arrival). Each server has its own
registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW = 10.0  # seconds over which lmstack_tokens_per_second averages


class EngineCollector:
    """Scrape-time gauges from the engine (read without locking: ints and list lengths only)."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        s = self.server
        engine = s.engine
        blocks = engine.cache.blocks
        usable = blocks.num_blocks - 1  # block 0 is the null block
        values = {
            "lmstack_requests_running": (
                "requests in the running batch",
                len(engine.scheduler.running),
            ),
            "lmstack_requests_waiting": (
                "requests queued in the engine or about to be",
                len(engine.scheduler.waiting) + s.pending_adds(),
            ),
            "lmstack_requests_in_flight": (
                "requests admitted by the server and not finished",
                s.in_flight,
            ),
            "lmstack_kv_blocks_free": (
                "KV blocks free (never used or evictable prefix-cache blocks)",
                blocks.num_free,
            ),
            "lmstack_kv_blocks_used": (
                "KV blocks held by running sequences",
                usable - blocks.num_free,
            ),
            "lmstack_prefix_cache_hit_rate": (
                "prompt tokens served from the prefix cache / prompt tokens",
                engine.prefix_cache_hit_rate,
            ),
            "lmstack_tokens_per_second": (
                f"generated tokens per second over the last {RATE_WINDOW:g} s",
                s.metrics.tokens_per_second(),
            ),
        }
        for name, (doc, value) in values.items():
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g


class ServerMetrics:
    def __init__(self, server):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "lmstack_time_to_first_token_seconds",
            "time to first token",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "lmstack_inter_token_latency_seconds",
            "time between consecutive output tokens",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "lmstack_e2e_request_latency_seconds",
            "arrival to last token",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.requests = Counter(
            "lmstack_requests",
            "finished engine requests by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "lmstack_requests_rejected", "requests answered 429 (queue full)", registry=r
        )
        self.prompt_tokens = Counter(
            "lmstack_prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "lmstack_generation_tokens", "generated tokens", registry=r
        )
        r.register(EngineCollector(server))
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent deltas

    def tokens(self, n: int) -> None:
        """``n`` tokens were generated now."""
        if n:
            now = time.monotonic()
            self._recent.append((now, n))
            self.generation_tokens.inc(n)
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        self._trim(time.monotonic())
        return sum(n for _, n in self._recent) / RATE_WINDOW

    def finished(self, out) -> None:
        """A finished ``RequestOutput``: its latencies and counts."""
        self.requests.labels(out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        if out.first_token_time is not None:
            self.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
        times = out.token_times
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        if out.finished_time is not None:
            self.e2e.observe(max(0.0, out.finished_time - out.arrival_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)
