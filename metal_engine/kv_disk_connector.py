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

A hybrid model's state checkpoints take the same path through a store of their own, so a
restarted server resumes a conversation from the checkpoint at the end of its stored blocks.
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


class SlotCopier(Protocol):
    """What the connector needs of the state slots (metal_engine.recurrent_states)."""

    def read_slots(self, slots: list[int]) -> list[bytes]: ...

    def write_slots(self, slots: list[int], payloads: list[bytes]) -> None: ...


class _Staging:
    """Payloads read from disk for a step that loads them; those no request looked up in
    the step after their read are dropped (read again if wanted later)."""

    def __init__(self) -> None:
        self.payloads: dict[BlockHash, bytes] = {}
        self.wanted: set[BlockHash] = set()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.payloads

    def want(self, hashes) -> None:
        self.wanted.update(hashes)

    def step_done(self) -> None:
        self.payloads = {h: p for h, p in self.payloads.items() if h in self.wanted}
        self.wanted = set()


class KVDiskConnector:
    """Moves cached blocks (and state checkpoints) between memory and KVDiskStores. One
    engine thread calls it."""

    def __init__(self, store: KVDiskStore, cache: BlockCopier,
                 state_store: KVDiskStore | None = None, states: SlotCopier | None = None):
        """`state_store` and `states`: a hybrid model's checkpoints on disk and its slots."""
        self.store, self.cache = store, cache
        self.state_store, self.states = state_store, states
        self._staged = _Staging()  # blocks read from disk, not yet loaded
        self._staged_states = _Staging()
        self._plan = KVTransferPlan()

    # -- scheduler side: hashes and block ids, no file reads ----------------------------------

    def lookup(self, hashes: Sequence[BlockHash]) -> TierLookup:
        run = self._run(hashes)
        self._staged.want(run.ready)
        return run

    def find_checkpoint(self, block_hash: BlockHash) -> str | None:
        if block_hash in self._staged_states:
            self._staged_states.want([block_hash])
            return "ready"
        if self.state_store is not None and block_hash in self.state_store:
            return "unread"
        return None

    def _run(self, hashes: Sequence[BlockHash]) -> TierLookup:
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
            return TierLookup(ready, unread)
        return TierLookup(ready, [])

    def read_ahead(self, lookup: TierLookup) -> None:
        queued = set(self._plan.reads)
        self._plan.reads += [h for h in lookup.unread if h not in queued]
        if lookup.checkpoint_unread and lookup.checkpoint not in self._plan.state_reads:
            self._plan.state_reads.append(lookup.checkpoint)

    def load(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        self._plan.loads += blocks

    def load_checkpoint(self, slot: int, block_hash: BlockHash) -> None:
        self._plan.state_loads.append((slot, block_hash))

    def block_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        if block_hash not in self.store:
            self._plan.saves.append((block_id, block_hash))

    def checkpoint_evicted(self, slot: int, block_hash: BlockHash) -> None:
        if self.state_store is not None and block_hash not in self.state_store:
            self._plan.state_saves.append((slot, block_hash))

    def take_plan(self) -> KVTransferPlan:
        plan, self._plan = self._plan, KVTransferPlan()
        self._staged.step_done()
        self._staged_states.step_done()
        return plan

    # -- runner side: bytes -------------------------------------------------------------------

    def before_step(self, plan: KVTransferPlan) -> None:
        """Save evicted blocks and checkpoints before the step overwrites them, then load the
        admitted ones."""
        if plan.saves:
            _save(self.store, self.cache.read_blocks, plan.saves)
        if plan.state_saves:
            _save(self.state_store, self.states.read_slots, plan.state_saves)
        if plan.loads:
            block_ids = [block_id for block_id, _ in plan.loads]
            payloads = [self._staged.payloads.pop(block_hash) for _, block_hash in plan.loads]
            self.cache.write_blocks(block_ids, payloads)
        if plan.state_loads:
            slots = [slot for slot, _ in plan.state_loads]
            payloads = [self._staged_states.payloads.pop(h) for _, h in plan.state_loads]
            self.states.write_slots(slots, payloads)

    def after_launch(self, plan: KVTransferPlan) -> None:
        """Read the files a waiting request needs next step, while this one runs. A file that
        cannot be read leaves the store's index, so the request computes that block instead."""
        _read(self.store, plan.reads, self._staged)
        if plan.state_reads:
            _read(self.state_store, plan.state_reads, self._staged_states)

    def close(self, cached_blocks: Sequence[tuple[int, BlockHash]],
              checkpoints: Sequence[tuple[int, BlockHash]] = ()) -> None:
        """Save every cached pool block (and state checkpoint) the stores lack, for the next
        start. The step that wrote them must have finished."""
        missing = [(b, h) for b, h in cached_blocks if h not in self.store]
        for start in range(0, len(missing), SAVE_BATCH):
            _save(self.store, self.cache.read_blocks, missing[start : start + SAVE_BATCH])
        log.info("KV disk cache: saved %d blocks, %d on disk in %s", len(missing),
                 self.store.num_blocks, self.store.root)
        if self.state_store is None:
            return
        missing = [(s, h) for s, h in checkpoints if h not in self.state_store]
        for start in range(0, len(missing), SAVE_BATCH):
            _save(self.state_store, self.states.read_slots, missing[start : start + SAVE_BATCH])
        log.info("KV disk cache: saved %d state checkpoints, %d on disk", len(missing),
                 self.state_store.num_blocks)


def _save(store: KVDiskStore, read, items: Sequence[tuple[int, BlockHash]]) -> None:
    payloads = read([index for index, _ in items])
    for (_, block_hash), payload in zip(items, payloads, strict=True):
        store.save(block_hash, payload)


def _read(store: KVDiskStore, hashes: Sequence[BlockHash], staging: _Staging) -> None:
    for block_hash in hashes:
        payload = store.load(block_hash)
        if payload is not None:
            staging.payloads[block_hash] = payload
