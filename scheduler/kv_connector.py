"""What the scheduler asks of a KV tier outside the pool (the disk), and the plan it hands on.

The scheduler side of a connector works on hashes and block ids only, and never touches the
tier's storage: it answers from an index and queues work. Each step's queued work leaves
`schedule()` as a `KVTransferPlan` on the `SchedulerOutput`, which the runner side of the same
connector carries out around the step:

    before the step:  save   pool block -> tier     (an evicted block is about to be reused)
                      load   staged payload -> pool (a request admitted over it)
    after launching:  read   tier -> staging        (a waiting request needs it next step)

Each kind of cached data moves that way under its own `CacheKind`: KV blocks between pool block
ids and the tier, and hybrid models' recurrent-state checkpoints (scheduler.state_cache)
between state slots and the tier, keyed by the hash of the block they end at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.output import CacheKind, KVTransferPlan
from scheduler.prefix_hash import BlockHash


@dataclass(frozen=True)
class TierLookup:
    """A request's blocks right after its pool hits, as the tier has them.

    `ready`: read into memory, loadable into the pool this step. `unread`: the stored blocks
    after those, still on disk; the request waits for them rather than compute them.
    """

    ready: list[BlockHash]
    unread: list[BlockHash]
    # Hybrid models: the hash of the block whose state checkpoint the request resumes from,
    # when the tier holds it (None: the pool does, or no checkpoint is needed), and whether it
    # is still on disk.
    checkpoint: BlockHash | None = None
    checkpoint_unread: bool = False
    # Sliding-window group: the blocks it needs that the tier holds, read or not.
    window_ready: list[BlockHash] = field(default_factory=list)
    window_unread: list[BlockHash] = field(default_factory=list)

    @property
    def is_ready(self) -> bool:
        return not (self.unread or self.checkpoint_unread or self.window_unread)


class KVConnectorScheduler(Protocol):
    """The scheduler side. Single-threaded; called only from `Scheduler`. Reads no storage."""

    def lookup(self, hashes: Sequence[BlockHash]) -> TierLookup:
        """Of `hashes` (a request's uncached prefix, in chain order), the leading run of
        blocks the tier holds. Marks the ready ones as wanted this step; changes nothing else."""

    def find(self, kind: CacheKind, block_hash: BlockHash) -> str | None:
        """Whether the tier holds `block_hash`'s data of `kind`: "ready" (read into memory:
        marked as wanted this step), "unread", or None."""

    def read_ahead(self, lookup: TierLookup) -> None:
        """Queue what `lookup` found unread to be read into memory after this step launches."""

    def load(self, kind: CacheKind, items: Sequence[tuple[int, BlockHash]]) -> None:
        """Queue ready data to be written into these freshly allocated ids of `kind`."""

    def evicted(self, kind: CacheKind, index: int, block_hash: BlockHash) -> None:
        """Memory is dropping or reusing id `index` of `kind`, which holds `block_hash`'s data:
        queue it to be saved unless the tier has it."""

    def computed(self, kind: CacheKind, index: int, block_hash: BlockHash) -> None:
        """A step has just filled id `index` of `kind` with `block_hash`'s data (its step has
        run): a tier that saves blocks as they are computed queues it."""

    def take_plan(self) -> KVTransferPlan:
        """This step's queued moves; the queues start empty again. Drops staged payloads that
        no request wanted this step (they are read again if wanted later)."""
