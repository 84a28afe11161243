"""Blocks of a sliding-window group, in plain ints: the KV pools of windowed layers beside
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

if TYPE_CHECKING:
    from scheduler.kv_connector import KVConnectorScheduler
    from scheduler.request import Request

# Freed entries of a window table point at this block, which no request is ever given.
NULL_BLOCK = 0


class WindowBlocks:
    """The group's pool and each request's window table (`request.window_block_ids`).
    Single-threaded (the scheduler)."""

    def __init__(self, num_blocks: int, block_size: int, window: int,
                 tier: KVConnectorScheduler | None = None) -> None:
        """`tier`: the KV tier past memory, which keeps the group's evicted blocks too."""
        if num_blocks < 2:
            raise ValueError(f"a sliding-window group needs at least 2 blocks, got {num_blocks}")
        self.tier = tier
        on_evict = (lambda block_id, h: tier.evicted("window", block_id, h)) if tier else None
        self.pool = BlockPool(num_blocks, on_evict=on_evict)
        assert self.pool.allocate(1) == [NULL_BLOCK]  # held for good
        self.block_size, self.window = block_size, window

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

    def can_take(self, request: Request, num_blocks: int, num_new: int) -> bool:
        """Whether the pool can back a request admitted over `num_blocks` cached blocks and
        its first `num_new` tokens. Changes nothing."""
        needed = self.needed(request, num_blocks)
        taken = sum(1 for _, b in needed if b is None or self.pool.refcount(b) == 0)
        new = cdiv(num_blocks * self.block_size + num_new, self.block_size) - num_blocks
        return new + taken <= self.pool.num_free_blocks

    def take(self, request: Request, num_blocks: int) -> None:
        """Start the window table of a request admitted over `num_blocks` cached blocks: the
        pool's cached blocks it needs, and fresh ones for those the tier loads."""
        needed = self.needed(request, num_blocks)
        self.pool.take_cached([b for _, b in needed if b is not None])
        table = [NULL_BLOCK] * (num_blocks - len(needed))
        loads = []
        for index, block_id in needed:
            if block_id is None:
                assert self.tier is not None, "the prefix cache found it in the tier"
                [block_id] = self.pool.allocate(1)
                self.pool.cache(block_id, request.block_hashes[index])
                loads.append((block_id, request.block_hashes[index]))
            table.append(block_id)
        if loads:
            self.tier.load("window", loads)
        request.window_block_ids = table

    def reserve(self, request: Request, num_new: int) -> bool:
        """Free the blocks out of the request's window, then give it blocks for its next
        `num_new` tokens. False (and none given) if the pool is short."""
        self.free_outside(request)
        table = request.window_block_ids
        missing = cdiv(request.num_computed_tokens + num_new, self.block_size) - len(table)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(missing)
        if blocks is None:
            return False
        table.extend(blocks)
        return True

    def free_outside(self, request: Request) -> None:
        """Give back the blocks no row from `num_computed_tokens` on will see. A block the
        step in flight still reads is overwritten only by a later step, which the runner
        queues once that one is done."""
        table = request.window_block_ids
        # Rejected drafts of a step in flight move the request back to its known tokens.
        start = min(request.num_computed_tokens, request.num_known_tokens)
        end = min(self.first_seen(start), len(table))
        freed = [b for b in table[:end] if b != NULL_BLOCK]
        if freed:
            self.pool.free(freed)
            table[:end] = [NULL_BLOCK] * end

    def register(self, request: Request, first: int, last: int) -> None:
        """Cache blocks `first..last-1` of the request under their hashes (those still held)."""
        table = request.window_block_ids
        for index in range(first, min(last, len(table))):
            if table[index] != NULL_BLOCK:
                self.pool.cache(table[index], request.block_hashes[index])

    def release(self, request: Request) -> None:
        """The request leaves the running batch: every block it holds goes back."""
        self.pool.free([b for b in request.window_block_ids if b != NULL_BLOCK])
        request.window_block_ids = []
