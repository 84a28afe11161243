"""Fixed pool of KV-cache block ids handed out to requests. Plain ints, no tensors."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Free-list allocator over block ids `0..num_blocks-1`.

    Invariant: every id is either in the free list or owned by exactly one request.
    Running out is a return value (`None`), never an exception: the scheduler preempts.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` free blocks, or none at all if there are fewer than that."""
        if count > len(self._free):
            return None
        return [self._free.popleft() for _ in range(count)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)
