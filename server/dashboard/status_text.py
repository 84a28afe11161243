"""The dashboard's JSON as terminal lines: a summary, then a table of the requests in flight."""

from __future__ import annotations

_COLUMNS = ("REQUEST", "API", "STATUS", "AGE", "TTFT", "PROMPT", "CACHED", "COMPUTED",
            "GENERATED", "PREEMPTED")  # fmt: skip


def format_status(state: dict, url: str) -> str:
    return "\n".join([*_summary(state, url), "", *_request_table(state["requests"]["list"])])


def _summary(state: dict, url: str) -> list[str]:
    model, requests, kv = state["model"], state["requests"], state["kv_cache"]
    totals, prefix, recent = state["totals"], state["prefix_cache"], state["recent"]
    finished = totals["requests_finished"]
    lines = [
        f"metal-serve at {url}: {model['served_name']} ({model['name']}, context "
        f"{model['max_model_len']:,}), up {duration(state['uptime_s'])}",
        _row("requests", f"{requests['running']} running, {requests['waiting']} waiting, "
             f"{requests['queued']} queued, "
             f"{totals['preemptions']:,} preemptions; finished "
             + ", ".join(f"{reason} {count:,}" for reason, count in finished.items())
             + f", rejected {totals['requests_rejected']:,}"),
        _row("kv cache", f"{kv['blocks_used']:,} / {kv['blocks_total']:,} blocks in use "
             f"({kv['usage']:.1%}), {kv['block_size']} tokens each, {kv['dtype']}"),
    ]  # fmt: skip
    if (slots := state["state_slots"]) is not None:
        lines.append(_row("state slots", f"{slots['used']:,} / {slots['total']:,} in use"))
    hits = (f"{prefix['hit_rate']:.1%} hit: {prefix['hit_tokens']:,} of "
            f"{prefix['queried_tokens']:,} prompt tokens")  # fmt: skip
    if (disk := prefix["disk"]) is not None:
        hits += f"; disk tier {disk['hit_tokens']:,} of {disk['queried_tokens']:,}"
    lines += [
        _row("prefix cache", hits),
        _row("throughput", f"{recent['output_tokens_per_s']:.1f} output tok/s; "
             f"{totals['generation_tokens']:,} generated, {totals['prompt_tokens']:,} prompt "
             "tokens in all"),
        _row("latency", f"last {duration(recent['window_s'])}: TTFT "
             f"{_percentiles(recent['ttft_s'])}; ITL {_percentiles(recent['itl_s'])}"),
    ]  # fmt: skip
    if (spec := state["speculative"]) is not None:
        lines.append(_row("speculative", f"{spec['acceptance_rate']:.1%} of "
                          f"{spec['draft_tokens']:,} draft tokens accepted, "
                          f"{spec['mean_acceptance_length']:.2f} tokens per draft step"
                          + _speculative_details(spec)))
    lines.append(_row("memory", _memory(state["memory"])))
    if (kernels := state.get("kernels")) is not None:  # servers before it have none
        lines.append(_row("kernels", f"{len(kernels['fallbacks'])} fallbacks" + "".join(
            f"; {f['kernel']} {f['variant']}: {f['reason']}" for f in kernels["fallbacks"])))
    return lines


def _request_table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["no requests in flight"]
    cells = [_COLUMNS] + [_cells(row) for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
    lines = []
    for line, row in zip(cells, [None, *rows], strict=True):
        lines.append("  ".join(
            cell.ljust(width) if i < 3 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ).rstrip())  # fmt: skip
        if row is not None and "prompt" in row:
            lines.append("    prompt: " + " ".join(row["prompt"].split()))
    return lines


def _cells(row: dict) -> tuple[str, ...]:
    cached = row["cached_tokens"]
    return (row["id"], row["api"], row["status"], seconds(row["age_s"]),
            "-" if row["ttft_s"] is None else seconds(row["ttft_s"]),
            f"{row['prompt_tokens']:,}", "-" if cached is None else f"{cached:,}",
            f"{row['computed_tokens']:,}", f"{row['generated_tokens']:,}",
            f"{row['preemptions']:,}")  # fmt: skip


def _row(name: str, text: str) -> str:
    return f"{name:<13}{text}"


def _percentiles(values: dict | None) -> str:
    if values is None:
        return "-"
    return ", ".join(f"{name} {seconds(value)}" for name, value in values.items())


def _memory(memory: dict) -> str:
    rss = memory["process_rss_bytes"]
    text = f"resident {size(rss)}; " if rss is not None else ""
    return text + (f"MLX {size(memory['mlx_active_bytes'])} active, "
                   f"{size(memory['mlx_cache_bytes'])} cache, "
                   f"{size(memory['mlx_peak_bytes'])} peak")  # fmt: skip


def seconds(value: float) -> str:
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def duration(value: float) -> str:
    total = int(value)
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m" + (f" {total % 60}s" if total % 60 else "")
    return f"{total // 3600}h {total % 3600 // 60}m"


def size(num_bytes: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    value, index = float(num_bytes), 0
    while value >= 1024 and index < len(units) - 1:
        value, index = value / 1024, index + 1
    return f"{value:.0f} B" if index == 0 else f"{value:.1f} {units[index]}"


def _speculative_details(spec: dict) -> str:
    """Accepted of drafted per method and the estimated speed-up (servers before them have
    neither)."""
    methods = "".join(f"; {name} {c['accepted_tokens']:,}/{c['draft_tokens']:,}"
                      for name, c in spec.get("by_method", {}).items())
    speedup = spec.get("speedup_estimate")
    return methods + (f"; ~{speedup:.2f}x estimated" if speedup is not None else "")
