"""PNG charts of benchmark results; matplotlib is an optional extra, imported only here."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from server.bench.report import concurrency_label
from server.bench.runner import RunResult

INSTALL_HINT = "pip install 'metal-serve[bench]'  (or: pip install matplotlib)"


def pyplot() -> Any:
    """matplotlib's pyplot on a file-only backend, or a RuntimeError naming the install."""
    try:
        import matplotlib
    except ImportError:
        message = f"plots need matplotlib, which is not installed: {INSTALL_HINT}"
        raise RuntimeError(message) from None
    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(runs: Sequence[RunResult], out_dir: Path, title: str) -> list[Path]:
    """TTFT p50/p99 and output throughput against concurrency; returns the files written."""
    labels = [concurrency_label(r.max_concurrency) for r in runs]
    ttft = {
        "TTFT p50": [_number(r.metrics.ttft.p50) for r in runs],
        "TTFT p99": [_number(r.metrics.ttft.p99) for r in runs],
    }
    throughput = {"output tokens/s": [r.metrics.output_throughput for r in runs]}
    return [
        plot_lines(out_dir / "ttft_vs_concurrency.png", title, "TTFT (ms)", labels, ttft),
        plot_lines(
            out_dir / "throughput_vs_concurrency.png",
            title,
            "output tokens / s",
            labels,
            throughput,
        ),
    ]


def plot_lines(
    path: Path, title: str, ylabel: str, xs: Sequence[str], series: dict[str, list[float]]
) -> Path:
    """One line per `series` name over the concurrency labels `xs`."""
    plt = pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in series.items():
        ax.plot(list(xs), values, "o-", label=name)
    _finish(ax, title, "max concurrency", ylabel)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_bars(
    path: Path, title: str, ylabel: str, groups: Sequence[str], series: dict[str, list[float]]
) -> Path:
    """Grouped bars: one group per entry of `groups`, one bar per `series` name in each."""
    plt = pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    _finish(ax, title, "", ylabel)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _finish(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()


def _number(value: float | None) -> float:
    return float("nan") if value is None else value
