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

from scheduler.block_pool import BlockPool

if TYPE_CHECKING:
    from scheduler.request import Request

# Freed entries of a window table point at this block, which no request is ever given.
NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class WindowBlocks:
    """The group's pool and each request's window table (`request.window_block_ids`).
    Single-threaded (the scheduler)."""

    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a sliding-window group needs at least 2 blocks, got {num_blocks}")
        self.pool = BlockPool(num_blocks)
        assert self.pool.allocate(1) == [NULL_BLOCK]  # held for good
        self.block_size, self.window = block_size, window

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def first_seen(self, position: int) -> int:
        """The first block that a row at `position` (or after it) still sees."""
        return max(position - self.window + 1, 0) // self.block_size

    def hits(self, request: Request, num_blocks: int) -> list[int] | None:
        """The group's cached blocks a hit of `num_blocks` leading blocks needs (from the
        first one its next row sees), or None if one is missing. Changes nothing."""
        hashes = request.block_hashes
        found = []
        for index in range(self.first_seen(num_blocks * self.block_size), num_blocks):
            block_id = self.pool.lookup(hashes[index])
            if block_id is None:
                return None
            found.append(block_id)
        return found

    def can_take(self, request: Request, num_blocks: int, num_new: int) -> bool:
        """Whether the pool can back a request admitted over `num_blocks` cached blocks (the
        group's hits for them exist) and its first `num_new` tokens. Changes nothing."""
        hits = self.hits(request, num_blocks) or []
        free_hits = sum(1 for block_id in hits if self.pool.refcount(block_id) == 0)
        new = cdiv(num_blocks * self.block_size + num_new, self.block_size) - num_blocks
        return new + free_hits <= self.pool.num_free_blocks

    def take(self, request: Request, num_blocks: int) -> None:
        """Start the window table of a request admitted over `num_blocks` cached blocks."""
        hits = self.hits(request, num_blocks)
        assert hits is not None, "the prefix cache matched these blocks"
        self.pool.take_cached(hits)
        request.window_block_ids = [NULL_BLOCK] * (num_blocks - len(hits)) + hits

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
        end = min(self.first_seen(request.num_computed_tokens), len(table))
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
