"""The results section of docs/benchmarks.md (and its plots), written by `bench compare`.

Only the text between the two markers is replaced; the rest of the page is kept.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from server.bench.report import ttft_by_turn

if TYPE_CHECKING:
    from server.bench.runner import RunResult

@dataclass(frozen=True)
class PeerResult:
    """One peer's part of a comparison, as the doc shows it."""

    name: str
    version: str | None
    install_s: float | None
    startup_s: float | None = None
    runs: dict[str, RunResult] = field(default_factory=dict)  # by workload: the median round
    error: str | None = None
    # by workload: output tokens/s of each round, in the order they ran
    rounds: dict[str, list[float]] = field(default_factory=dict)


BEGIN = "<!-- bench-compare:begin -->"
END = "<!-- bench-compare:end -->"
DOC_NAME = "benchmarks.md"
COLUMNS = (
    "server",
    "ok",
    "failed",
    "wall s",
    "out tok/s",
    "req/s",
    "TTFT mean",
    "TTFT p50",
    "TTFT p90",
    "TTFT p99",
    "TPOT mean",
    "TPOT p50",
    "ITL p50",
    "ITL p99",
    "E2EL p50",
)


def write_doc(
    docs_dir: Path,
    results: Sequence[PeerResult],
    engine: dict[str, dict | str],
    workloads: dict[str, dict],
    output_len: int,
    doc_name: str = DOC_NAME,
) -> Path:
    """Replace the results section of `docs_dir/doc_name` (create the page if needed); its
    plots are named after the page."""
    docs_dir.mkdir(parents=True, exist_ok=True)
    images = _plots(docs_dir, Path(doc_name).stem, results, list(workloads))
    section = "\n".join([BEGIN, *_section(results, engine, workloads, output_len, images), END])
    path = docs_dir / doc_name
    page = path.read_text() if path.is_file() else "# Benchmarks\n"
    if BEGIN in page and END in page:
        head, rest = page.split(BEGIN, 1)
        page = head + section + rest.split(END, 1)[1]
    else:
        page = page.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(page)
    return path


# What each peer serves of the default model.
WEIGHTS_SERVED = {
    "metal-serve": "a float32 MLX conversion of the Q4_1 GGUF",
    "mlx-lm": "the same float32 MLX conversion",
    "llama-cpp-python": "the Q4_1 GGUF itself",
    "llama-server": "a float32 GGUF made from the Q4_1 one",
}


def _weights_served(names: Sequence[str]) -> str:
    """One clause per peer that ran: which weights it served."""
    return ", ".join(f"{n} {WEIGHTS_SERVED[n]}" for n in names if n in WEIGHTS_SERVED)


def _section(
    results: Sequence[PeerResult],
    engine: dict[str, dict | str],
    workloads: dict[str, dict],
    output_len: int,
    images: list[tuple[str, str]],
) -> list[str]:
    lines = [
        "## Results",
        "",
        f"Written by `metal-serve bench compare` on {time.strftime('%Y-%m-%d')}. "
        f"Machine: {_machine()}.",
        "",
        f"Model: SmolLM2-135M-Instruct; {_weights_served([r.name for r in results])}. "
        f"Every request asks for exactly {output_len} tokens (greedy, end-of-sequence "
        "disabled); output tokens are counted by the client with the model's tokenizer. "
        "Latencies in ms.",
        "",
        "| server | version | install | startup | status |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        status = "ok" if r.error is None else r.error.replace("|", "/")
        lines.append(
            f"| {r.name} | {r.version or '-'} | {_seconds(r.install_s)} | "
            f"{_seconds(r.startup_s)} | {status} |"
        )
    for name, fields in workloads.items():
        lines += ["", f"### {name}: {_describe(fields, output_len)}", "", *_table(results, name)]
        lines += _rounds_table(results, name)
        if fields["workload"] == "agents":
            lines += _turn_table(results, name)
    lines += [""] + [f"![{title}]({image})" for title, image in images]
    return lines + _engine_lines(engine)


def _table(results: Sequence[PeerResult], workload: str) -> list[str]:
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        run = r.runs.get(workload)
        if run is not None:
            rows.append("| " + " | ".join([r.name, *_cells(run)]) + " |")
    return rows


def _rounds_table(results: Sequence[PeerResult], workload: str) -> list[str]:
    """Each round's output tokens/s, and metal-serve's rate over each other peer's in the
    same round."""
    rates = {r.name: r.rounds[workload] for r in results if r.rounds.get(workload)}
    count = max(map(len, rates.values()), default=0)
    if count < 2:
        return []
    rows = [(name, values, "{:.1f}") for name, values in rates.items()]
    ours = rates.get("metal-serve")
    for name, theirs in rates.items():
        if ours is not None and name != "metal-serve":
            # A peer that failed part way has fewer rounds: pairs stop at the shorter list.
            ratios = [a / b if b else float("inf") for a, b in zip(ours, theirs, strict=False)]
            rows.append((f"metal-serve / {name}", ratios, "{:.2f}"))
    lines = ["", "Output tokens/s of each round (the peers took turns; above: each one's "
             "median round):", "",
             "| | " + " | ".join(f"round {i + 1}" for i in range(count)) + " | median |",
             "|" + "---|" * (count + 2)]
    for name, values, form in rows:
        cells = [form.format(v) for v in values] + ["-"] * (count - len(values))
        median = form.format(sorted(values)[(len(values) - 1) // 2])
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {median} |")
    return lines


def _cells(run: RunResult) -> list[str]:
    m = run.metrics
    values = (m.ttft.mean, m.ttft.p50, m.ttft.p90, m.ttft.p99, m.tpot.mean, m.tpot.p50,
              m.itl.p50, m.itl.p99, m.e2el.p50)
    return [
        str(m.completed),
        str(m.failed),
        f"{m.duration_s:.1f}",
        f"{m.output_throughput:.1f}",
        f"{m.request_throughput:.2f}",
        *("-" if v is None else f"{v:.1f}" for v in values),
    ]


def _turn_table(results: Sequence[PeerResult], workload: str) -> list[str]:
    by_peer = {
        r.name: ttft_by_turn(r.runs[workload].records) for r in results if workload in r.runs
    }
    turns = sorted({t for turns in by_peer.values() for t in turns})
    if not turns:
        return []
    lines = ["", "Mean TTFT by turn (each turn resends the conversation so far):", ""]
    lines += ["| server | " + " | ".join(f"turn {t + 1}" for t in turns) + " |"]
    lines += ["|" + "---|" * (len(turns) + 1)]
    for name, values in by_peer.items():
        cells = [f"{values[t]:.1f}" if t in values else "-" for t in turns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _engine_lines(engine: dict[str, dict | str]) -> list[str]:
    if not engine:
        return []
    lines = ["", "### metal-serve engine, without HTTP", ""]
    for name, result in engine.items():
        if isinstance(result, str):
            lines += [f"`bench {name}`: {result}", ""]
            continue
        lines += [f"`metal-serve bench {name}`:", "", "```json"]
        lines += [_json(result), "```", ""]
    return lines


def _plots(
    docs_dir: Path, stem: str, results: Sequence[PeerResult], workloads: list[str]
) -> list[tuple[str, str]]:
    from server.bench.plots import plot_bars

    ran = [r for r in results if r.runs]
    if not ran:
        return []
    charts = {
        "output tokens/s": lambda run: run.metrics.output_throughput,
        "TTFT p50 (ms)": lambda run: run.metrics.ttft.p50 or 0.0,
    }
    images = []
    try:
        for (title, value), file in zip(charts.items(), ("throughput", "ttft"), strict=True):
            series = {
                r.name: [value(r.runs[w]) if w in r.runs else 0.0 for w in workloads] for r in ran
            }
            path = plot_bars(docs_dir / f"{stem}-{file}.png", title, title, workloads, series)
            images.append((title, path.name))
    except RuntimeError as exc:  # matplotlib missing: the tables are still written
        print(f"no plots: {exc}", file=sys.stderr)
    return images


def _describe(fields: dict, output_len: int) -> str:
    if fields["workload"] == "agents":
        return (
            f"{fields['sessions']} sessions x {fields['turns']} turns, a shared "
            f"{fields['prefix_len']}-token system prompt with tool schemas, "
            f"{fields['tool_result_len']}-token tool results, {output_len} tokens per answer"
        )
    concurrency = fields["max_concurrency"][0]
    return (
        f"{fields['num_prompts']} requests, {concurrency} at a time, "
        f"{fields['input_len']}-token prompts, {output_len} output tokens"
    )


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores, "
        f"Python {sys.version.split()[0]}"
    )


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 60:.1f} min" if value >= 120 else f"{value:.1f} s"


def _json(value: dict) -> str:
    return json.dumps(value, indent=2)
