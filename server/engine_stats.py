"""A snapshot of the engine's gauges and counters, taken on the engine thread between steps."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from scheduler.spec_decode.drafter import SpecDecodeStats


class RequestState(NamedTuple):
    """Where one request the scheduler holds stands (what its outputs do not say)."""

    request_id: str
    running: bool  # False: waiting (not yet admitted, or preempted)
    num_computed_tokens: int  # with K/V written: cached + prefilled + decoded
    num_cached_tokens: int  # prompt tokens found in the prefix cache at admission
    num_preemptions: int


@dataclass(frozen=True)
class EngineStats:
    """Plain numbers, safe to hand to another thread once taken.

    Prefix-cache counts are tokens over first admissions, split by tier the way vLLM splits
    local hits from a KV connector's: `prefix_cache_*` is the KV pool (every prompt token is
    a query), `kv_disk_*` the disk tier (queried for what the pool lacked).
    """

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks: int = 0
    num_used_kv_blocks: int = 0
    block_size: int = 0
    kv_cache_dtype: str = ""  # what the pool stores: the model dtype's name, int8 or int4
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    has_kv_disk: bool = False
    kv_disk_queried_tokens: int = 0
    kv_disk_hit_tokens: int = 0
    num_preemptions: int = 0
    spec_decode: SpecDecodeStats | None = None  # None: no speculative decoding
    num_state_slots: int = 0  # hybrid models' recurrent-state slots (0: none)
    num_used_state_slots: int = 0  # live ones, and checkpoints a step is writing
    requests: tuple[RequestState, ...] = ()  # running first, then waiting in queue order

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the pool's blocks held by requests (free cached blocks count as free)."""
        return self.num_used_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


def read_engine_stats(engine: Any) -> EngineStats:
    """Read the scheduler's numbers; only the engine thread may call this.

    An engine without a scheduler (a test double) reports zeros.
    """
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is None:
        return EngineStats()
    pool, prefix_cache = scheduler.pool, scheduler.prefix_cache
    cache_stats = prefix_cache.stats
    states = scheduler.states
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_kv_blocks=pool.num_blocks,
        num_used_kv_blocks=pool.num_used_blocks,
        block_size=scheduler.config.block_size,
        kv_cache_dtype=engine.runner.cache.storage,
        prefix_cache_queried_tokens=cache_stats.queried_tokens,
        prefix_cache_hit_tokens=cache_stats.hit_tokens - cache_stats.stored_hit_tokens,
        has_kv_disk=prefix_cache.store is not None,
        kv_disk_queried_tokens=cache_stats.stored_queried_tokens,
        kv_disk_hit_tokens=cache_stats.stored_hit_tokens,
        num_preemptions=scheduler.num_preemptions,
        spec_decode=_copy(drafter.stats) if (drafter := scheduler.drafter) else None,
        num_state_slots=states.pool.num_blocks if states else 0,
        num_used_state_slots=states.pool.num_used_blocks if states else 0,
        requests=_request_states(scheduler),
    )


def _request_states(scheduler: Any) -> tuple[RequestState, ...]:
    """A tuple per request: about 0.3 µs a request, each step."""
    return tuple(
        RequestState(r.request_id, running, r.num_computed_tokens, r.num_cached_tokens,
                     r.num_preemptions)
        for running, queue in ((True, scheduler.running), (False, scheduler.waiting))
        for r in queue
    )  # fmt: skip


def _copy(stats: SpecDecodeStats) -> SpecDecodeStats:
    return replace(stats, accepted_per_position=list(stats.accepted_per_position))
