"""Readable tables of benchmark results, and the result JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from server.bench.metrics import Distribution, Metrics, RequestRecord
from server.bench.runner import RunResult

WIDTH = 64


def concurrency_label(value: int | None) -> str:
    return "unlimited" if value is None else str(value)


def format_run(title: str, run: RunResult) -> str:
    """One run as the block `vllm bench serve` users know: counts, throughputs, latencies."""
    m = run.metrics
    rate = "inf" if run.request_rate == float("inf") else f"{run.request_rate:g}"
    lines = [
        f" {title} ".center(WIDTH, "="),
        _row("Max concurrency", concurrency_label(run.max_concurrency)),
        _row("Request rate (req/s)", rate),
        _row("Successful requests", m.completed),
        _row("Failed requests", m.failed),
        _row("Benchmark duration (s)", f"{m.duration_s:.2f}"),
        _row("Total input tokens", m.total_input_tokens),
        _row("Total output tokens (client-counted)", m.total_output_tokens),
        _row("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
        _row("Output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
        _row("Total token throughput (tok/s)", f"{m.total_token_throughput:.2f}"),
    ]
    if m.goodput is not None:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in m.slos_ms.items())
        lines.append(_row(f"Goodput (req/s) [{slos}]", f"{m.goodput:.2f}"))
    lines += [
        "-" * WIDTH,
        f"{'(ms)':<12}{'mean':>13}{'p50':>13}{'p90':>13}{'p99':>13}",
    ]
    for name, dist in _latencies(m):
        lines.append(f"{name:<12}" + "".join(f"{_ms(v):>13}" for v in _values(dist)))
    if run.encoder is not None:
        lines += ["-" * WIDTH, *_encoder_rows(run)]
    by_turn = ttft_by_turn(run.records)
    if len(by_turn) > 1:
        turns = "  ".join(f"{turn}: {ms:.1f}" for turn, ms in by_turn.items())
        lines += ["-" * WIDTH, f"Mean TTFT by turn (ms)  {turns}"]
    if m.errors:
        lines += ["-" * WIDTH, "First errors:"] + [f"  {e}" for e in m.errors]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_sweep(runs: Sequence[RunResult]) -> str:
    """One line per concurrency, for runs of the same workload (with the vision encoder's
    time per image where it was measured)."""
    encoder = any(r.encoder is not None for r in runs)
    header = (
        f"{'concurrency':>11} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'failed':>6}" + (f" {'enc ms/img':>10}" if encoder else "")
    )
    rows = [
        f"{concurrency_label(r.max_concurrency):>11} {r.metrics.request_throughput:>7.2f} "
        f"{r.metrics.output_throughput:>10.1f} {_ms(r.metrics.ttft.p50):>9} "
        f"{_ms(r.metrics.ttft.p99):>9} {_ms(r.metrics.tpot.p50):>9} {r.metrics.failed:>6}"
        + (f" {_ms(r.encoder.ms_per_image if r.encoder else None):>10}" if encoder else "")
        for r in runs
    ]
    return "\n".join([header, *rows])


def _encoder_rows(run: RunResult) -> list[str]:
    """The vision encoder's work in the run (from the server's /metrics), and the prompt
    tokens the server counted, images' included."""
    encoder = run.encoder
    served = [r.server_input_tokens for r in run.records if r.ok and r.server_input_tokens]
    mean = f"{sum(served) / len(served):.1f}" if served else "-"
    return [
        _row("Images encoded", f"{encoder.images:.0f}"),
        _row("Encoder time per image (ms)", _ms(encoder.ms_per_image)),
        _row("Mean prompt tokens (server-counted)", mean),
    ]


def ttft_by_turn(records: Sequence[RequestRecord]) -> dict[int, float]:
    """Mean TTFT in ms per agent turn (later turns resend earlier ones: prefix reuse shows)."""
    turns: dict[int, list[float]] = {}
    for r in records:
        if r.turn is not None and r.ttft is not None:
            turns.setdefault(r.turn, []).append(r.ttft * 1000.0)
    return {turn: sum(v) / len(v) for turn, v in sorted(turns.items())}


def write_result_json(path: Path, config: dict, runs: Sequence[RunResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"config": config, "runs": [run.to_json() for run in runs]}
    path.write_text(json.dumps(document, indent=2) + "\n")


def _latencies(m: Metrics) -> list[tuple[str, Distribution]]:
    return [("TTFT", m.ttft), ("TPOT", m.tpot), ("ITL", m.itl), ("E2EL", m.e2el)]


def _values(dist: Distribution) -> tuple[float | None, ...]:
    return (dist.mean, dist.p50, dist.p90, dist.p99)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _row(name: str, value: object) -> str:
    return f"{name + ':':<44}{value!s:>20}"
