"""`/metrics` in the Prometheus text format.

Two sources: per-request timings and token counts, observed on the handlers' event loop as
outputs arrive (`RequestTimer`); and the engine's gauges and counters, read from the snapshot
the engine thread publishes after each step (`AsyncEngine.stats()`), never from the engine
itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from metal_engine.outputs import RequestOutput
from server.engine_stats import EngineStats

_PREFIX = "metal_serve"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    """The registry behind `/metrics` (one per app, so several apps can share a process)."""

    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.ttft = Histogram(
            f"{_PREFIX}_time_to_first_token_seconds", "From submission to the first output.",
            buckets=_LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.inter_token = Histogram(
            f"{_PREFIX}_inter_token_latency_seconds", "Time between output tokens.",
            buckets=_TOKEN_GAP_BUCKETS, registry=reg,
        )  # fmt: skip
        self.e2e = Histogram(
            f"{_PREFIX}_e2e_request_latency_seconds", "From submission to the last output.",
            buckets=_LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            f"{_PREFIX}_prompt_tokens", "Prompt tokens of requests that ran.", registry=reg
        )
        self.generation_tokens = Counter(
            f"{_PREFIX}_generation_tokens", "Tokens generated.", registry=reg
        )
        self.requests = Counter(
            f"{_PREFIX}_requests", "Requests by how they ended: stop, length, abort, error "
            "(the engine failed) or rejected (refused or queue full).",
            ["finish_reason"], registry=reg,
        )  # fmt: skip
        reg.register(_EngineCollector(engine_stats))

    def request(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Times one request's outputs; a `RequestObserver` for the AsyncEngine."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._start = self._last = time.monotonic()
        self._num_output_tokens = 0

    def on_output(self, output: RequestOutput) -> None:
        now, m = time.monotonic(), self._metrics
        new_tokens = output.num_output_tokens - self._num_output_tokens
        if self._num_output_tokens == 0 and new_tokens > 0:
            m.ttft.observe(now - self._start)
            m.prompt_tokens.inc(output.num_prompt_tokens)
        elif new_tokens > 0:
            gap = (now - self._last) / new_tokens  # several tokens in one delta share the wait
            for _ in range(new_tokens):
                m.inter_token.observe(gap)
        if new_tokens > 0:
            m.generation_tokens.inc(new_tokens)
            self._num_output_tokens, self._last = output.num_output_tokens, now

    def on_finish(self, outcome: str) -> None:
        self._metrics.requests.labels(finish_reason=outcome).inc()
        if self._num_output_tokens:
            self._metrics.e2e.observe(time.monotonic() - self._start)


class _EngineCollector(Collector):
    """Gauges and counters from the engine thread's latest snapshot, read at scrape time."""

    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        s = self._engine_stats()
        yield _gauge("requests_running", "Requests in the running batch.", s.num_running)
        yield _gauge("requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield _gauge("kv_cache_blocks", "KV cache blocks in the pool.", s.num_kv_blocks)
        yield _gauge("kv_cache_blocks_used", "KV cache blocks in use.", s.num_used_kv_blocks)
        hit_rate = s.prefix_cache_hit_tokens / max(s.prefix_cache_queried_tokens, 1)
        yield _gauge("prefix_cache_hit_rate", "Prompt tokens found cached / looked up.", hit_rate)
        yield _counter("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix "
                       "cache.", s.prefix_cache_queried_tokens)  # fmt: skip
        yield _counter("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.",
                       s.prefix_cache_hit_tokens)  # fmt: skip
        yield _counter("preemptions", "Requests preempted for KV space.", s.num_preemptions)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{_PREFIX}_{name}", documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{_PREFIX}_{name}", documentation, value=value)
