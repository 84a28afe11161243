"""The anchor cache group: a KV block per `block_size` tokens of the request, every token kept.

Its blocks are what a prefix hit is made of: the request's block hashes name them, and every
other group answers for its part of a hit of so many of them (scheduler.cache_groups.group).
The table lives on the request (`Request.block_ids`, under its `block_table_epoch`), beside
the hashes it is matched by.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler.block_pool import BlockPool, cdiv
from scheduler.cache_groups.group import CacheGroup

if TYPE_CHECKING:
    from scheduler.kv_connector import KVConnectorScheduler, TierShare
    from scheduler.prefix_hash import BlockHash
    from scheduler.request import Request


class FullAttentionGroup(CacheGroup):
    kind = "blocks"

    def __init__(self, num_blocks: int, block_size: int,
                 connector: KVConnectorScheduler | None = None,
                 on_evict: Callable[[BlockHash], None] | None = None) -> None:
        """`connector`: the KV tier's, past memory, which keeps evicted blocks; `on_evict(hash)`
        hears of each cached block the pool reuses (the other groups' data hangs on it)."""
        self.block_size, self.connector, self._on_evict = block_size, connector, on_evict
        self.pool = BlockPool(num_blocks, on_evict=self._evicted)

    def _evicted(self, block_id: int, block_hash: BlockHash) -> None:
        if self._on_evict is not None:
            self._on_evict(block_hash)
        if self.connector is not None:
            self.connector.evicted(self.kind, block_id, block_hash)

    def match(self, request: Request, max_blocks: int) -> list[int]:
        """The pool's blocks of the request's longest hashed prefix, at most `max_blocks`.
        Changes no refcount."""
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_admit(self, request: Request, num_blocks: int, num_new: int) -> bool:
        """The pool's hits among the `num_blocks`, fresh blocks for the rest (the tier's) and
        for the first step's tokens; a cached block that is free leaves the free list when
        taken."""
        hits = self.match(request, num_blocks)
        needed = cdiv(num_blocks * self.block_size + num_new, self.block_size)
        free_hits = sum(1 for block_id in hits if self.pool.refcount(block_id) == 0)
        return needed - len(hits) <= self.pool.num_free_blocks - free_hits

    def admit(self, request: Request, num_blocks: int, share: TierShare) -> None:
        """The pool's hits, then fresh blocks registered at once for the tier's `share.ready`
        blocks after them, queued with the tier to be loaded before the step runs."""
        assert not request.block_ids and request.num_computed_tokens == 0
        hits = self.match(request, num_blocks - len(share.ready))
        self.pool.take_cached(hits)
        loads = []
        if share.ready:
            blocks = self.pool.allocate(len(share.ready))
            assert blocks is not None and self.connector is not None, "can_admit counted them"
            loads = list(zip(blocks, share.ready, strict=True))
            for block_id, block_hash in loads:
                self.pool.cache(block_id, block_hash)
            self.connector.load(self.kind, loads)
        request.start_block_table(hits + [block_id for block_id, _ in loads])

    def reserve(self, request: Request, num_new: int) -> bool:
        needed = cdiv(request.num_computed_tokens + num_new, self.block_size)
        missing = needed - len(request.block_ids)
        if missing > 0:
            blocks = self.pool.allocate(missing)
            if blocks is None:
                return False
            request.block_ids.extend(blocks)
        return True

    def ids(self, request: Request) -> list[int]:
        return list(request.block_ids)

    def resolved(self, request: Request, num_hashed_blocks: int, num_computed: int) -> None:
        """Cache the blocks newly hashed; a tier that saves blocks as they are computed hears
        of each."""
        num_full = min(num_computed // self.block_size, len(request.block_hashes))
        for i in range(num_hashed_blocks, num_full):
            block_id, block_hash = request.block_ids[i], request.block_hashes[i]
            if self.pool.cache(block_id, block_hash) and self.connector is not None:
                self.connector.computed(self.kind, block_id, block_hash)

    def release(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []

    def cached(self) -> list[tuple[int, BlockHash]]:
        return self.pool.cached_blocks()

    def usage(self) -> tuple[int, int]:
        return self.pool.num_used_blocks, self.pool.num_blocks
