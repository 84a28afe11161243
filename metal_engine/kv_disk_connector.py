"""The disk tier of the prefix cache as one object: a scheduler side and a runner side.

The scheduler side (`lookup`, `read_ahead`, `load`, `block_evicted`, `take_plan`; see
scheduler.kv_connector) answers from the store's in-memory index and queues moves; it reads
no file, so `schedule()` never waits on the disk. The runner side carries out each step's plan
on the KV pool (`before_step`, `after_launch`), and `close` saves the whole pool at shutdown.

Payloads read ahead wait in `_staged` for the step that loads them:

    step N   schedule: a request's stored blocks are unread -> plan.reads; it waits
             after launch: read the files into _staged
    step N+1 schedule: the blocks are ready -> admitted over fresh block ids -> plan.loads
             before the step: write the staged payloads into those blocks
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from metal_engine.kv_disk_store import KVDiskStore
from scheduler.kv_connector import KVTransferPlan, TierLookup
from scheduler.prefix_hash import BlockHash

log = logging.getLogger(__name__)

# Blocks read from the pool per batch when saving at shutdown (bounds the host copy).
SAVE_BATCH = 64


class BlockCopier(Protocol):
    """What the connector needs of the KV pool (metal_engine.kv_cache.KVCache)."""

    def read_blocks(self, block_ids: list[int]) -> list[bytes]: ...

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None: ...


class KVDiskConnector:
    """Moves cached blocks between the pool and a KVDiskStore. One engine thread calls it."""

    def __init__(self, store: KVDiskStore, cache: BlockCopier) -> None:
        self.store, self.cache = store, cache
        self._staged: dict[BlockHash, bytes] = {}  # read from disk, not yet loaded
        self._wanted: set[BlockHash] = set()  # staged hashes a request looked up this step
        self._plan = KVTransferPlan()

    # -- scheduler side: hashes and block ids, no file reads ----------------------------------

    def lookup(self, hashes: Sequence[BlockHash]) -> TierLookup:
        ready: list[BlockHash] = []
        for index, block_hash in enumerate(hashes):
            if block_hash in self._staged:
                ready.append(block_hash)
                continue
            unread = []
            for later in hashes[index:]:
                if later not in self.store:
                    break
                unread.append(later)
            self._wanted.update(ready)
            return TierLookup(ready, unread)
        self._wanted.update(ready)
        return TierLookup(ready, [])

    def read_ahead(self, hashes: Sequence[BlockHash]) -> None:
        queued = set(self._plan.reads)
        self._plan.reads += [h for h in hashes if h not in queued]

    def load(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        self._plan.loads += blocks

    def block_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        if block_hash not in self.store:
            self._plan.saves.append((block_id, block_hash))

    def take_plan(self) -> KVTransferPlan:
        plan, self._plan = self._plan, KVTransferPlan()
        self._staged = {h: p for h, p in self._staged.items() if h in self._wanted}
        self._wanted = set()
        return plan

    # -- runner side: bytes -------------------------------------------------------------------

    def before_step(self, plan: KVTransferPlan) -> None:
        """Save evicted blocks before the step overwrites them, then load the admitted ones."""
        if plan.saves:
            self._save(plan.saves)
        if plan.loads:
            block_ids = [block_id for block_id, _ in plan.loads]
            payloads = [self._staged.pop(block_hash) for _, block_hash in plan.loads]
            self.cache.write_blocks(block_ids, payloads)

    def after_launch(self, plan: KVTransferPlan) -> None:
        """Read the files a waiting request needs next step, while this one runs. A file that
        cannot be read leaves the store's index, so the request computes that block instead."""
        for block_hash in plan.reads:
            payload = self.store.load(block_hash)
            if payload is not None:
                self._staged[block_hash] = payload

    def close(self, cached_blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """Save every cached pool block the store lacks, for the next start. The step that
        wrote them must have finished."""
        missing = [(b, h) for b, h in cached_blocks if h not in self.store]
        for start in range(0, len(missing), SAVE_BATCH):
            self._save(missing[start : start + SAVE_BATCH])
        log.info("KV disk cache: saved %d blocks, %d on disk in %s", len(missing),
                 self.store.num_blocks, self.store.root)

    def _save(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        payloads = self.cache.read_blocks([block_id for block_id, _ in blocks])
        for (_, block_hash), payload in zip(blocks, payloads, strict=True):
            self.store.save(block_hash, payload)
