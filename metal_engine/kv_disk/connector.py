"""The disk tier of the prefix cache as one object: a scheduler side and a runner side.

The scheduler side (`lookup`, `find`, `read_ahead`, `load`, `evicted`, `computed`, `take_plan`; see
scheduler.kv_connector) answers from the store's in-memory index and queues moves; it reads
no file, so `schedule()` never waits on the disk. The runner side carries out each step's plan
on the KV pool (`before_step`, `after_launch`), and `close` saves the whole pool at shutdown.

Payloads read ahead wait in their tier's `staged` for the step that loads them:

    step N   schedule: a request's stored blocks are unread -> plan.reads; it waits
             after launch: read the files into staged
    step N+1 schedule: the blocks are ready -> admitted over fresh block ids -> plan.loads
             before the step: write the staged payloads into those blocks

Each cache kind (scheduler.kv_connector.CacheKind) takes that path through a store of its
own: a hybrid model's state checkpoints too, so a restarted server resumes a conversation
from the checkpoint at the end of its stored blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from metal_engine.kv_disk.store import KVDiskStore
from scheduler.kv_connector import TierLookup, TierShare
from scheduler.output import CacheKind, KVTransferPlan
from scheduler.prefix_hash import BlockHash

log = logging.getLogger(__name__)

# Ids read from memory per batch when saving (bounds the host copy at shutdown).
SAVE_BATCH = 64


class TierStore(NamedTuple):
    """One kind's store and how its data leaves and enters memory by id: the KV pool's blocks
    (KVCache.read_blocks / write_blocks), the state slots (RecurrentStates.read_slots / ...)."""

    store: KVDiskStore
    read: Callable[[list[int]], list[bytes]]
    write: Callable[[list[int], list[bytes]], None]


class _Tier:
    """One kind on disk, and payloads read from disk for the step that loads them (those no
    request looked up in the step after their read are dropped, read again if wanted)."""

    def __init__(self, parts: TierStore) -> None:
        self.store, self.parts = parts.store, parts
        self.staged: dict[BlockHash, bytes] = {}
        self.wanted: set[BlockHash] = set()

    def step_done(self) -> None:
        self.staged = {h: p for h, p in self.staged.items() if h in self.wanted}
        self.wanted = set()

    def save(self, items: Sequence[tuple[int, BlockHash]]) -> None:
        for start in range(0, len(items), SAVE_BATCH):
            batch = items[start : start + SAVE_BATCH]
            payloads = self.parts.read([index for index, _ in batch])
            for (_, block_hash), payload in zip(batch, payloads, strict=True):
                self.store.save(block_hash, payload)

    def load(self, items: Sequence[tuple[int, BlockHash]]) -> None:
        payloads = [self.staged.pop(block_hash) for _, block_hash in items]
        self.parts.write([index for index, _ in items], payloads)

    def read(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            payload = self.store.load(block_hash)
            if payload is not None:
                self.staged[block_hash] = payload


class KVDiskConnector:
    """Moves cached blocks (and state checkpoints) between memory and KVDiskStores. One
    engine thread calls it."""

    def __init__(self, stores: dict[CacheKind, TierStore], anchor: CacheKind = "blocks",
                 write_through: bool = False) -> None:
        """`stores`: per kind held on disk (the `anchor` group's blocks at least: "blocks", or
        MLA's "latent"), its store and data in memory. `write_through`: save each block as
        soon as a step has filled it, not only once memory drops it (what a prefill server
        hands its blocks to a decode server by)."""
        self._tiers = {kind: _Tier(parts) for kind, parts in stores.items()}
        self._anchor = anchor
        self._blocks = self._tiers[anchor]
        self._plan = KVTransferPlan()
        self._write_through = write_through
        self._computed: list[tuple[int, BlockHash]] = []

    # -- scheduler side: hashes and ids, no file reads ----------------------------------------

    def lookup(self, hashes: Sequence[BlockHash]) -> TierShare:
        tier, ready = self._blocks, []
        for index, block_hash in enumerate(hashes):
            if block_hash not in tier.staged:
                unread = []
                for later in hashes[index:]:
                    if later not in tier.store:
                        break
                    unread.append(later)
                tier.wanted.update(ready)
                return TierShare(ready, unread)
            ready.append(block_hash)
        tier.wanted.update(ready)
        return TierShare(ready, [])

    def find(self, kind: CacheKind, block_hash: BlockHash) -> str | None:
        tier = self._tiers.get(kind)
        if tier is None:
            return None
        if block_hash in tier.staged:
            tier.wanted.add(block_hash)
            return "ready"
        return "unread" if block_hash in tier.store else None

    def read_ahead(self, lookup: TierLookup) -> None:
        for kind, share in lookup.shares.items():
            reads = self._plan.of(kind).reads
            queued = set(reads)
            reads += [h for h in share.unread if h not in queued]

    def load(self, kind: CacheKind, items: Sequence[tuple[int, BlockHash]]) -> None:
        self._plan.of(kind).loads += items

    def evicted(self, kind: CacheKind, index: int, block_hash: BlockHash) -> None:
        tier = self._tiers.get(kind)
        if tier is not None and block_hash not in tier.store:
            self._plan.of(kind).saves.append((index, block_hash))

    def computed(self, kind: CacheKind, index: int, block_hash: BlockHash) -> None:
        if (self._write_through and kind == self._anchor
                and block_hash not in self._blocks.store):
            self._computed.append((index, block_hash))

    def take_plan(self) -> KVTransferPlan:
        plan, self._plan = self._plan, KVTransferPlan()
        for tier in self._tiers.values():
            tier.step_done()
        return plan

    # -- runner side: bytes -------------------------------------------------------------------

    def before_step(self, plan: KVTransferPlan) -> None:
        """Save evicted data before the step overwrites it, then load the admitted data."""
        for kind, tier in self._tiers.items():
            tier.save(plan.of(kind).saves)
        for kind, tier in self._tiers.items():
            if plan.of(kind).loads:
                tier.load(plan.of(kind).loads)

    def after_launch(self, plan: KVTransferPlan) -> None:
        """Read the files a waiting request needs next step, while this one runs. A file that
        cannot be read leaves its store's index, so the request computes that data instead."""
        for kind, tier in self._tiers.items():
            tier.read(plan.of(kind).reads)

    def save_computed(self) -> None:
        """Save the blocks steps have filled since the last call (with `write_through`): call
        once the step that filled them is resolved and before its outputs go out, so a
        client told its prompt is done finds the blocks on disk."""
        computed, self._computed = self._computed, []
        self._blocks.save(computed)

    def close(self, cached: dict[CacheKind, Sequence[tuple[int, BlockHash]]]) -> None:
        """Save all data held in memory (per kind: (id, hash)) that the stores lack, for the
        next start. The step that wrote it must have finished."""
        for kind, tier in self._tiers.items():
            missing = [(i, h) for i, h in cached.get(kind, ()) if h not in tier.store]
            tier.save(missing)
            log.info("KV disk cache: saved %d %s, %d on disk in %s", len(missing), kind,
                     tier.store.num_blocks, tier.store.root)
