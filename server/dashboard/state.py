"""The JSON of `GET /dashboard/state`: what the dashboard page and `metal-serve status` show.

Its shape is documented in docs/dashboard.md and versioned by `schema`. Engine numbers come
from the snapshot that /metrics reads (`AsyncEngine.stats()`), token and request totals from
/metrics' own registry, so the page and a scrape agree. Prompt text appears only when the
server logs prompts (--log-prompts), and only to the API key that sent it when keys are
tenants (`--prefix-cache-scope key`, the default).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from metal_engine.outputs import EngineStats
from scheduler.stats import RequestState
from server.async_engine import AsyncEngine, LiveRequest
from server.dashboard import SCHEMA
from server.dashboard.history import INTERVAL_S
from server.http.metrics import ServerMetrics
from server.http.tenants import current_tenant

# The ids each API gives its requests (a choice of n adds a suffix), which name the API.
_API_OF_ID_PREFIX = (("chatcmpl-", "chat"), ("cmpl-", "completions"), ("resp_", "responses"),
                     ("msg_", "anthropic"))  # fmt: skip
_STATUS_ORDER = {"running": 0, "waiting": 1, "queued": 2}
PROMPT_CHARS = 240  # of a prompt's end: agents' prompts share their start


@dataclass(frozen=True)
class ServerInfo:
    """What stays fixed while a server runs."""

    served_model_name: str
    model_name: str
    max_model_len: int
    started: float  # time.time()


def dashboard_state(engine: AsyncEngine, metrics: ServerMetrics, info: ServerInfo) -> dict:
    """The whole document, read on the handlers' event loop."""
    stats, now = engine.stats(), time.time()
    return {
        "schema": SCHEMA,
        "time": now,
        "uptime_s": now - info.started,
        "model": {"served_name": info.served_model_name, "name": info.model_name,
                  "max_model_len": info.max_model_len},
        "requests": requests_section(stats, engine),
        "kv_cache": {"blocks_total": stats.num_kv_blocks, "blocks_used": stats.num_used_kv_blocks,
                     "usage": stats.kv_cache_usage, "block_size": stats.block_size,
                     "dtype": stats.kv_cache_dtype},
        "state_slots": ({"total": stats.num_state_slots, "used": stats.num_used_state_slots}
                        if stats.num_state_slots else None),
        "prefix_cache": _prefix_cache(stats),
        "totals": {**metrics.totals(), "preemptions": stats.num_preemptions},
        "recent": metrics.recent.summary(),
        "history": {"interval_s": INTERVAL_S, "points": metrics.recent.points()},
        "speculative": _speculative(stats),
        "memory": memory_in_use(),
        "kernels": {"fallbacks": [f._asdict() for f in metrics.kernel_fallbacks()]},
    }  # fmt: skip


def api_of(request_id: str) -> str:
    """"chat", "completions", "responses", "anthropic", or "other"."""
    return next((api for prefix, api in _API_OF_ID_PREFIX if request_id.startswith(prefix)),
                "other")


def requests_section(stats: EngineStats, engine: AsyncEngine) -> dict:
    """The counts of /metrics and a row per request a handler waits on: running, then
    waiting, then queued, the oldest first."""
    states = {state.request_id: state for state in stats.requests}
    now = time.monotonic()
    rows = [_row(live, states.get(live.request_id), now, engine)
            for live in engine.live_requests()
            if live.last is None or not live.last.finished]  # fmt: skip
    rows.sort(key=lambda row: (_STATUS_ORDER[row["status"]], -row["age_s"]))
    queued = sum(row["status"] == "queued" for row in rows)
    return {"running": stats.num_running, "waiting": stats.num_waiting, "queued": queued,
            "list": rows}


def _row(live: LiveRequest, state: RequestState | None, now: float, engine: AsyncEngine) -> dict:
    """One request. Without a scheduler state it is `queued`: handed to the engine thread,
    which has not taken it in yet (it does between steps). A server that keeps cached tokens
    from its clients keeps them from here too."""
    last = live.last
    cached = state.num_cached_tokens if state else (last.num_cached_tokens if last else 0)
    row = {
        "id": live.request_id,
        "http_request_id": live.http_request_id,
        "api": api_of(live.request_id),
        "status": "queued" if state is None else "running" if state.running else "waiting",
        "age_s": now - live.started,
        "ttft_s": None if live.first_output_at is None else live.first_output_at - live.started,
        "prompt_tokens": live.num_prompt_tokens,
        "cached_tokens": cached if engine.report_cached_tokens else None,
        "computed_tokens": state.num_computed_tokens if state else 0,
        "generated_tokens": last.num_output_tokens if last else 0,
        "preemptions": state.num_preemptions if state else 0,
        "draft_tokens": last.num_draft_tokens if last else 0,
        "accepted_draft_tokens": last.num_accepted_tokens if last else 0,
    }
    if live.prompt is not None and live.tenant == current_tenant():  # a key sees its own
        cut = len(live.prompt) > PROMPT_CHARS
        row["prompt"] = "…" + live.prompt[-PROMPT_CHARS:] if cut else live.prompt
    return row


def _prefix_cache(stats: EngineStats) -> dict:
    queried, hits = stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens
    disk = None
    if stats.has_kv_disk:
        disk = {"queried_tokens": stats.kv_disk_queried_tokens,
                "hit_tokens": stats.kv_disk_hit_tokens}
    return {"queried_tokens": queried, "hit_tokens": hits,
            "hit_rate": hits / queried if queried else 0.0, "disk": disk}


def _speculative(stats: EngineStats) -> dict | None:
    spec = stats.spec_decode
    if spec is None:
        return None
    drafted = spec.num_draft_tokens
    return {
        "drafts": spec.num_drafts,
        "draft_tokens": drafted,
        "accepted_tokens": spec.num_accepted_tokens,
        "acceptance_rate": spec.num_accepted_tokens / drafted if drafted else 0.0,
        "mean_acceptance_length": spec.mean_accepted_length,
        "accepted_per_position": list(spec.accepted_per_position),
        "by_method": {method: {"draft_tokens": c.num_draft_tokens,
                               "accepted_tokens": c.num_accepted_tokens}
                      for method, c in sorted(spec.by_method.items())},
        "speedup_estimate": spec.speedup_estimate,
    }


def memory_in_use() -> dict:
    """MLX's allocator counters (the engine has loaded MLX) and the process's resident set
    (Linux only: None elsewhere)."""
    import mlx.core as mx

    return {
        "mlx_active_bytes": mx.get_active_memory(),
        "mlx_cache_bytes": mx.get_cache_memory(),
        "mlx_peak_bytes": mx.get_peak_memory(),
        "process_rss_bytes": _resident_bytes(),
    }


def _resident_bytes() -> int | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
