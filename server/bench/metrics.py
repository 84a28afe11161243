"""Per-request records and the serving metrics computed from them.

Definitions follow `vllm bench serve`, so numbers read the same way:

    TTFT  send -> first chunk with text
    TPOT  (e2e - TTFT) / (output_tokens - 1), per request, for requests with > 1 token
    ITL   gaps between consecutive chunks with text, pooled over all requests
    E2EL  send -> end of stream
    goodput  requests meeting every SLO, per second of the run
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")
MAX_ERRORS_SHOWN = 5


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it. Times in seconds; `start` from the run's start,
    `chunk_times` and `latency` from the request's own start."""

    start: float
    latency: float
    chunk_times: tuple[float, ...]
    input_tokens: int
    output_tokens: int  # counted by the client's tokenizer on the streamed text
    server_output_tokens: int | None = None  # the server's own `usage`, when it sends one
    output_text: str = ""
    error: str | None = None
    session: int | None = None
    turn: int | None = None
    server_input_tokens: int | None = None  # its prompt tokens (an image's tokens counted)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times[:-1], self.chunk_times[1:], strict=True)]

    def to_json(self) -> dict:
        return asdict(self) | {"ttft": self.ttft, "tpot": self.tpot, "itl": self.itl}


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles in milliseconds; all None when there were no samples."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(None, None, None, None)
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(float(ms.mean()), p50, p90, p99)


@dataclass(frozen=True)
class Metrics:
    completed: int
    failed: int
    errors: tuple[str, ...]  # the first few distinct error messages
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    goodput: float | None  # None when no SLO was given
    slos_ms: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(
                f"unknown goodput metric {name!r} in {item!r}; use {', '.join(SLO_METRICS)}, "
                "e.g. --goodput ttft:500 tpot:50"
            )
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(
                f"goodput SLO {item!r} needs a number of milliseconds, e.g. {name}:500"
            ) from None
    return slos


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    # A single-token answer has no time per output token: it cannot miss a TPOT target.
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.latency}
    return record.ok and all(
        values[name] is not None and values[name] * 1000.0 <= limit
        for name, limit in slos_ms.items()
    )


def compute_metrics(
    records: Sequence[RequestRecord], duration_s: float, slos_ms: dict[str, float] | None = None
) -> Metrics:
    """Summarize one run; failed requests count only in `failed` and `errors`."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    slos_ms = dict(slos_ms or {})
    input_tokens = sum(r.input_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = sum(meets_slos(r, slos_ms) for r in done)
    return Metrics(
        completed=len(done),
        failed=len(failed),
        errors=tuple(dict.fromkeys(r.error for r in failed))[:MAX_ERRORS_SHOWN],
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        ttft=Distribution.of_seconds([r.ttft for r in done if r.ttft is not None]),
        tpot=Distribution.of_seconds([r.tpot for r in done if r.tpot is not None]),
        itl=Distribution.of_seconds([gap for r in done for gap in r.itl]),
        e2el=Distribution.of_seconds([r.latency for r in done]),
        goodput=good / duration_s if slos_ms else None,
        slos_ms=slos_ms,
    )
