"""The scheduler's numbers as plain data, taken between steps: what the server's stats,
metrics and dashboard read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from scheduler.spec_decode.stats import SpecDecodeStats


class RequestState(NamedTuple):
    """Where one request the scheduler holds stands (what its outputs do not say)."""

    request_id: str
    running: bool  # False: waiting (not yet admitted, or preempted)
    num_computed_tokens: int  # with K/V written: cached + prefilled + decoded
    num_cached_tokens: int  # prompt tokens found in the prefix cache at admission
    num_preemptions: int


@dataclass(frozen=True)
class SchedulerStats:
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
