"""Steps driven by hand: what the engine does around each step, in one call."""

from __future__ import annotations

from collections.abc import Mapping

from scheduler import Scheduler
from scheduler.block_pool import BlockPool
from scheduler.output import RequestUpdate, SchedulerOutput
from scheduler.prefix_hash import BlockHash


def resolve_step(scheduler: Scheduler, out: SchedulerOutput,
                 sampled: Mapping[str, int | list[int]]) -> list[RequestUpdate]:
    """The scheduler's bookkeeping of a step whose tokens are known: `advance` (at launch)
    then `resolve` (once they are read)."""
    scheduler.advance(out)
    return scheduler.resolve(out, sampled)


def run_step(runner, scheduler: Scheduler, out: SchedulerOutput) -> list[RequestUpdate]:
    """`out` launched on the runner, its tokens waited for, and resolved."""
    return resolve_step(scheduler, out, runner.launch(out).sampled())


def hash_of(pool: BlockPool, block_id: int) -> BlockHash | None:
    """The prefix hash a block of `pool` holds, if any."""
    return dict(pool.cached_blocks()).get(block_id)
