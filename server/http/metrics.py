"""`/metrics` in the Prometheus text format, under vLLM v1's names, types and labels.

So existing vLLM dashboards and alerts work unchanged: every series is `vllm:*` with the
labels `model_name` (the served model name) and `engine` ("0": one engine per server), and
histograms use vLLM's bucket boundaries. What vLLM has no name for stays `metal_serve_*`.

Three sources: per-request timings and token counts, observed on the handlers' event loop as
outputs arrive (`RequestTimer`); the engine's gauges and counters, read from the snapshot
the engine thread publishes after each step (`AsyncEngine.stats()`), never from the engine
itself; and the kernel variants that fell back to the reference (kernels_metal/dispatch.py),
a copy of the dispatchers' verdicts. The request timings also feed the dashboard's charts
(`recent`), and the dashboard reads its totals from this registry (`totals()`) and its
fallbacks through it (`kernel_fallbacks`), so the two never disagree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kernels_metal.dispatch import Fallback
from kernels_metal.fallbacks import all_fallbacks
from metal_engine.outputs import EncoderStats, EngineStats, RequestOutput
from scheduler.spec_decode.stats import SpecDecodeStats
from server.dashboard.history import RecentActivity

LABEL_NAMES = ("model_name", "engine")
ENGINE_INDEX = "0"
FINISHED_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class ServerMetrics:
    """The registry behind `/metrics` (one per app, so several apps can share a process)."""

    def __init__(
        self, engine_stats: Callable[[], EngineStats], model_name: str,
        prompts_waiting: Callable[[], int] | None = None,
        kernel_fallbacks: Callable[[], list[Fallback]] = all_fallbacks,
    ) -> None:  # fmt: skip
        self.kernel_fallbacks = kernel_fallbacks
        self.registry = reg = CollectorRegistry()
        self._labels = labels = (model_name, ENGINE_INDEX)
        self.ttft = _histogram(reg, labels, "vllm:time_to_first_token_seconds",
                               "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token = _histogram(reg, labels, "vllm:inter_token_latency_seconds",
                                      "Histogram of inter-token latency in seconds.",
                                      ITL_BUCKETS)  # fmt: skip
        self.e2e = _histogram(reg, labels, "vllm:e2e_request_latency_seconds",
                              "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", LABEL_NAMES,
            registry=reg,
        ).labels(*labels)  # fmt: skip
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", LABEL_NAMES,
            registry=reg,
        ).labels(*labels)  # fmt: skip
        self._success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*LABEL_NAMES, "finished_reason"], registry=reg,
        )  # fmt: skip
        for reason in FINISHED_REASONS:  # each series shows, at 0, before a request ends so
            self._success.labels(*labels, reason)
        self.rejected = Counter(
            "metal_serve_requests_rejected", "Requests refused before they ran (invalid for "
            "the engine, or the waiting queue was full).", LABEL_NAMES, registry=reg,
        ).labels(*labels)  # fmt: skip
        if prompts_waiting is not None:
            Gauge(
                "metal_serve_prompts_waiting", "Prompts waiting to be rendered and tokenized "
                "(their clients still connected).", LABEL_NAMES, registry=reg,
            ).labels(*labels).set_function(prompts_waiting)  # fmt: skip
        reg.register(_EngineCollector(engine_stats, labels, kernel_fallbacks))
        self.recent = RecentActivity()

    def request(self) -> RequestTimer:
        return RequestTimer(self)

    def finished(self, outcome: str) -> None:
        """Count a request that ended: a `finished_reason`, or "rejected" if it never ran."""
        if outcome == "rejected":
            self.rejected.inc()
        else:
            self._success.labels(*self._labels, outcome).inc()

    def totals(self) -> dict:
        """The request and token counters as /metrics shows them now: `prompt_tokens`,
        `generation_tokens`, `requests_finished` by finished_reason, `requests_rejected`."""
        names = {"vllm:prompt_tokens_total": "prompt_tokens",
                 "vllm:generation_tokens_total": "generation_tokens",
                 "metal_serve_requests_rejected_total": "requests_rejected"}
        totals: dict = {"requests_finished": {}}
        wanted = [*names, "vllm:request_success_total"]
        for family in self.registry.restricted_registry(wanted).collect():
            for sample in family.samples:
                if sample.name in names:
                    totals[names[sample.name]] = int(sample.value)
                elif sample.name == "vllm:request_success_total":
                    reason = sample.labels["finished_reason"]
                    totals["requests_finished"][reason] = int(sample.value)
        return totals

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
            m.recent.add(now, new_tokens, ttft=now - self._start)
        elif new_tokens > 0:
            gap = (now - self._last) / new_tokens  # several tokens in one delta share the wait
            for _ in range(new_tokens):
                m.inter_token.observe(gap)
            m.recent.add(now, new_tokens, itl=gap)
        if new_tokens > 0:
            m.generation_tokens.inc(new_tokens)
            self._num_output_tokens, self._last = output.num_output_tokens, now

    def on_finish(self, outcome: str) -> None:
        self._metrics.finished(outcome)
        if self._num_output_tokens:
            self._metrics.e2e.observe(time.monotonic() - self._start)


class _EngineCollector(Collector):
    """Gauges and counters from the engine thread's latest snapshot, read at scrape time."""

    def __init__(self, engine_stats: Callable[[], EngineStats], labels: Sequence[str],
                 kernel_fallbacks: Callable[[], list[Fallback]]) -> None:
        self._engine_stats = engine_stats
        self._labels = labels
        self._kernel_fallbacks = kernel_fallbacks

    def collect(self) -> Iterator[Metric]:
        s, gauge, counter = self._engine_stats(), self._gauge, self._counter
        yield gauge("vllm:num_requests_running", "Number of requests in model execution "
                    "batches.", s.num_running)  # fmt: skip
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    s.num_waiting)  # fmt: skip
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    s.kv_cache_usage)  # fmt: skip
        if s.num_kv_blocks:
            yield self._cache_config(s)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number "
                      "of queried tokens.", s.prefix_cache_queried_tokens)  # fmt: skip
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of "
                      "cached tokens.", s.prefix_cache_hit_tokens)  # fmt: skip
        if s.has_kv_disk:  # vLLM reports a KV connector's tier (disk offload too) as external
            yield counter("vllm:external_prefix_cache_queries", "KV disk tier queries, in "
                          "terms of number of queried tokens.", s.kv_disk_queried_tokens)
            yield counter("vllm:external_prefix_cache_hits", "KV disk tier hits, in terms of "
                          "number of cached tokens.", s.kv_disk_hit_tokens)  # fmt: skip
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the "
                      "engine.", s.num_preemptions)  # fmt: skip
        if s.spec_decode is not None:
            yield from self._spec_decode(s.spec_decode)
        if s.encoder is not None:
            yield from self._encoder(s.encoder)
        yield self._fallbacks(self._kernel_fallbacks())

    def _fallbacks(self, fallbacks: list[Fallback]) -> CounterMetricFamily:
        """Each kernel variant that fell back: failed its first-use check, or a launch of it
        failed when first evaluated; from then on the reference serves it."""
        family = CounterMetricFamily(
            "metal_serve_kernel_fallbacks", "Kernel variants served by the reference because "
            "their Metal kernels failed, by kernel and variant.",
            labels=(*LABEL_NAMES, "kernel", "variant"))  # fmt: skip
        for fallback in fallbacks:
            family.add_metric((*self._labels, fallback.kernel, fallback.variant), 1)
        return family

    def _spec_decode(self, spec: SpecDecodeStats) -> Iterator[Metric]:
        """vLLM's counters; the acceptance rate and mean acceptance length that vLLM's log
        derives from them, as gauges of their own."""
        counter, gauge = self._counter, self._gauge
        yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                      spec.num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                      spec.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      spec.num_accepted_tokens)
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            labels=(*LABEL_NAMES, "position"))
        for position, count in enumerate(spec.accepted_per_position):
            per_position.add_metric((*self._labels, str(position)), count)
        yield per_position
        rate = spec.num_accepted_tokens / spec.num_draft_tokens if spec.num_draft_tokens else 0.0
        yield gauge("metal_serve:spec_decode_draft_acceptance_rate", "Accepted draft tokens "
                    "per draft token, since start.", rate)  # fmt: skip
        yield gauge("metal_serve:spec_decode_mean_acceptance_length", "Tokens a drafting "
                    "request gets per step: 1 + accepted tokens per draft, since start.",
                    spec.mean_accepted_length)  # fmt: skip
        yield from self._spec_decode_by_method(spec)
        yield gauge("metal_serve:spec_decode_speedup_estimate", "Seconds the timed decode "
                    "steps' tokens would have taken without drafts (by the step cost model) "
                    "over the seconds they took, since start; 1 before any.",
                    spec.speedup_estimate)  # fmt: skip

    def _spec_decode_by_method(self, spec: SpecDecodeStats) -> Iterator[Metric]:
        """Drafted and accepted tokens by what drafted them: ngram (the request's own
        tokens), suffix (other requests' outputs), draft_model, mtp."""
        for name, field, documentation in (
                ("metal_serve:spec_decode_num_draft_tokens_by_method", "num_draft_tokens",
                 "Draft tokens, by drafting method."),
                ("metal_serve:spec_decode_num_accepted_tokens_by_method", "num_accepted_tokens",
                 "Accepted draft tokens, by drafting method.")):
            family = CounterMetricFamily(name, documentation, labels=(*LABEL_NAMES, "method"))
            for method, counts in sorted(spec.by_method.items()):
                family.add_metric((*self._labels, method), getattr(counts, field))
            yield family

    def _encoder(self, encoder: EncoderStats) -> Iterator[Metric]:
        """The vision tower's work: their ratio is its time per image (an image found in
        the encoder cache costs none and is not counted)."""
        yield self._counter("metal_serve_images_encoded", "Images the vision encoder ran "
                            "for.", encoder.num_images)  # fmt: skip
        yield self._counter("metal_serve_encoder_seconds", "Wall time the vision encoder took "
                            "for them, in seconds.", encoder.seconds)  # fmt: skip

    def _cache_config(self, s: EngineStats) -> GaugeMetricFamily:
        """vLLM's info gauge of the cache config: the pool's size, its block and KV dtype."""
        info = {"num_gpu_blocks": str(s.num_kv_blocks), "block_size": str(s.block_size),
                "cache_dtype": s.kv_cache_dtype}
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                   "CacheConfig", labels=(*LABEL_NAMES, *info))
        family.add_metric((*self._labels, *info.values()), 1)
        return family

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=LABEL_NAMES)
        family.add_metric(self._labels, value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=LABEL_NAMES)
        family.add_metric(self._labels, value)
        return family


def _histogram(registry: CollectorRegistry, labels: Sequence[str], name: str,
               documentation: str, buckets: Sequence[float]) -> Histogram:
    """One series of a labelled histogram, the only one this server has."""
    family = Histogram(name, documentation, LABEL_NAMES, buckets=buckets, registry=registry)
    return family.labels(*labels)
