"""The sliding-window cache group, in plain ints: the KV pools of windowed layers beside
full-attention ones (Gemma 2/3/4, GPT-OSS) have block ids of their own.

A row at position p of a windowed layer sees keys p - window + 1 .. p. So once a request's
next token is at position `start`, its blocks that end before `start - window + 1` are seen
by no row it will compute again: they go back to the pool (keeping their hash, for other
requests' prefix hits) and the request's table points there at the null block instead.

    window table:  [ null  null | b7  b9  b12 ]      start = 70, window = 32, block size 16
    positions:       0..15 16..31  32..                first key still seen: 39 -> block 2

A prefix hit of `n` blocks needs the group's blocks that the first computed row sees (those
from `n * block_size - window + 1` on), cached in the pool; the ones before stay null.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.block_pool import BlockPool, cdiv
from scheduler.cache_groups.group import CacheGroup
from scheduler.kv_connector import TierShare

if TYPE_CHECKING:
    from scheduler.kv_connector import KVConnectorScheduler
    from scheduler.prefix_hash import BlockHash
    from scheduler.request import Request

# Freed entries of a window table point at this block, which no request is ever given.
NULL_BLOCK = 0


class SlidingWindowGroup(CacheGroup):
    """The group's pool and each running request's window table."""

    kind = "window"

    def __init__(self, num_blocks: int, block_size: int, window: int,
                 connector: KVConnectorScheduler | None = None) -> None:
        """`connector`: the KV tier's, past memory, which keeps the group's evicted blocks too."""
        if num_blocks < 2:
            raise ValueError(f"a sliding-window group needs at least 2 blocks, got {num_blocks}")
        self.connector = connector
        self.pool = BlockPool(num_blocks, on_evict=self._evicted if connector else None)
        assert self.pool.allocate(1) == [NULL_BLOCK]  # held for good
        self.block_size, self.window = block_size, window
        self._tables: dict[str, list[int]] = {}  # request id -> its block per block of tokens

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def first_seen(self, position: int) -> int:
        """The first block that a row at `position` (or after it) still sees."""
        return max(position - self.window + 1, 0) // self.block_size

    def needed(self, request: Request, num_blocks: int) -> list[tuple[int, int | None]]:
        """What a hit of `num_blocks` leading blocks needs of the group: from the first block
        its next row sees, (index, the pool's cached block or None). Changes nothing."""
        hashes = request.block_hashes
        return [(index, self.pool.lookup(hashes[index]))
                for index in range(self.first_seen(num_blocks * self.block_size), num_blocks)]

    def hit(self, request: Request, num_blocks: int) -> TierShare | int:
        """The blocks the pool lacks, from the tier; below a block neither has at index i,
        every count above i needs it too."""
        share = TierShare()
        for index, block_id in self.needed(request, num_blocks):
            if block_id is not None:
                continue
            block_hash = request.block_hashes[index]
            where = None if self.connector is None else self.connector.find(self.kind, block_hash)
            if where is None:
                return index
            (share.ready if where == "ready" else share.unread).append(block_hash)
        return share

    def _evicted(self, block_id: int, block_hash: BlockHash) -> None:
        self.connector.evicted(self.kind, block_id, block_hash)

    def can_admit(self, request: Request, num_blocks: int, num_new: int) -> bool:
        needed = self.needed(request, num_blocks)
        taken = sum(1 for _, b in needed if b is None or self.pool.refcount(b) == 0)
        new = cdiv(num_blocks * self.block_size + num_new, self.block_size) - num_blocks
        return new + taken <= self.pool.num_free_blocks

    def admit(self, request: Request, num_blocks: int, share: TierShare) -> None:
        """Start the window table: the pool's cached blocks the hit needs, and fresh ones for
        those the tier loads."""
        needed = self.needed(request, num_blocks)
        self.pool.take_cached([b for _, b in needed if b is not None])
        table = [NULL_BLOCK] * (num_blocks - len(needed))
        loads = []
        for index, block_id in needed:
            if block_id is None:
                assert self.connector is not None, "the prefix cache found it in the tier"
                [block_id] = self.pool.allocate(1)
                self.pool.cache(block_id, request.block_hashes[index])
                loads.append((block_id, request.block_hashes[index]))
            table.append(block_id)
        if loads:
            self.connector.load(self.kind, loads)
        self._tables[request.request_id] = table

    def reserve(self, request: Request, num_new: int) -> bool:
        """Free the blocks out of the request's window, then give it blocks for its next
        `num_new` tokens."""
        table = self._tables.setdefault(request.request_id, [])
        self._free_outside(request, table)
        missing = cdiv(request.num_computed_tokens + num_new, self.block_size) - len(table)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(missing)
        if blocks is None:
            return False
        table.extend(blocks)
        return True

    def _free_outside(self, request: Request, table: list[int]) -> None:
        """Give back the blocks no row from `num_computed_tokens` on will see. A block the
        step in flight still reads is overwritten only by a later step, which the runner
        queues once that one is done."""
        # Rejected drafts of a step in flight move the request back to its known tokens.
        start = min(request.num_computed_tokens, request.num_known_tokens)
        end = min(self.first_seen(start), len(table))
        freed = [b for b in table[:end] if b != NULL_BLOCK]
        if freed:
            self.pool.free(freed)
            table[:end] = [NULL_BLOCK] * end

    def ids(self, request: Request) -> list[int]:
        return list(self._tables.get(request.request_id, ()))

    def resolved(self, request: Request, num_hashed_blocks: int, num_computed: int) -> None:
        """Cache the newly hashed blocks the request still holds under their hashes."""
        table = self._tables.get(request.request_id, [])
        num_full = min(num_computed // self.block_size, len(request.block_hashes), len(table))
        for index in range(num_hashed_blocks, num_full):
            if table[index] != NULL_BLOCK:
                self.pool.cache(table[index], request.block_hashes[index])

    def release(self, request: Request) -> None:
        table = self._tables.pop(request.request_id, [])
        self.pool.free([b for b in table if b != NULL_BLOCK])

    def cached(self) -> list[tuple[int, BlockHash]]:
        return self.pool.cached_blocks()

    def usage(self) -> tuple[int, int]:
        return self.pool.num_used_blocks - 1, self.pool.num_blocks - 1  # the null block aside
