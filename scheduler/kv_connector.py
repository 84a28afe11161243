"""What the scheduler asks of a KV tier outside the pool (the disk), and the plan it hands on.

The scheduler side of a connector works on hashes and block ids only, and never touches the
tier's storage: it answers from an index and queues work. Each step's queued work leaves
`schedule()` as a `KVTransferPlan` on the `SchedulerOutput`, which the runner side of the same
connector carries out around the step:

    before the step:  save   pool block -> tier     (an evicted block is about to be reused)
                      load   staged payload -> pool (a request admitted over it)
    after launching:  read   tier -> staging        (a waiting request needs it next step)

Each cache group's data moves that way under its own `CacheKind` (scheduler.cache_groups):
KV blocks between pool block ids and the tier, a sliding window's blocks likewise, and hybrid
models' recurrent-state checkpoints between state slots and the tier, keyed by the hash of
the block they end at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.output import CacheKind, KVTransferPlan
from scheduler.prefix_hash import BlockHash


@dataclass
class TierShare:
    """What the tier holds of one cache group's part of a prefix hit, in chain order: data
    read into memory (`ready`, loadable this step) and data still on disk (`unread`; the
    request waits for it rather than compute it)."""

    ready: list[BlockHash] = field(default_factory=list)
    unread: list[BlockHash] = field(default_factory=list)


@dataclass
class TierLookup:
    """A prefix hit's share in the tier, per cache group that has one: the KV blocks right
    after the pool's hits (the anchor's: "blocks", or "latent"), and what the other groups
    need there that memory lacks (a state checkpoint, a sliding window's blocks)."""

    shares: dict[CacheKind, TierShare] = field(default_factory=dict)

    def of(self, kind: CacheKind) -> TierShare:
        return self.shares.get(kind) or TierShare()

    @property
    def is_ready(self) -> bool:
        return not any(share.unread for share in self.shares.values())


class KVConnectorScheduler(Protocol):
    """The scheduler side. Single-threaded; called only from `Scheduler`. Reads no storage."""

    def lookup(self, hashes: Sequence[BlockHash]) -> TierShare:
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
