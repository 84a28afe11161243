"""Fixed pool of KV-cache block ids handed out to requests, with a prefix cache. Plain ints."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from scheduler.prefix_hash import BlockHash


def cdiv(a: int, b: int) -> int:
    """Blocks of `b` that `a` tokens fill, the last one partly."""
    return -(-a // b)


class BlockPool:
    """Refcounted allocator over block ids `0..num_blocks-1` that keeps freed blocks' contents.

    A block is used (refcount > 0, held by that many requests) or free (refcount 0, in the free
    list). The free list is an LRU queue:

        head (taken first)                                      tail (freed last)
        [ blocks without a hash ... | cached blocks, oldest freed ... newest freed ]

    A free block keeps its hash until `allocate` takes it, so `lookup` still finds it.
    Invariants: free + used == num_blocks; a hash maps to at most one block and back.
    Running out is a return value (`None`), never an exception: the scheduler preempts.
    """

    def __init__(
        self, num_blocks: int, on_evict: Callable[[int, BlockHash], None] | None = None
    ) -> None:
        """`on_evict(block_id, hash)` hears of each cached block `allocate` reuses, before
        the caller can overwrite its contents."""
        self.num_blocks = num_blocks
        self._on_evict = on_evict
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refcounts = [0] * num_blocks
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash`'s contents, used or free, or None. Changes nothing."""
        return self._block_of.get(block_hash)

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` blocks from the LRU head (refcount 1), evicting their hashes.

        Takes none at all if fewer than `count` are free.
        """
        if count > len(self._free):
            return None
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block_hash = self._hash_of.pop(block_id, None)
            if block_hash is not None:
                del self._block_of[block_hash]
                if self._on_evict is not None:
                    self._on_evict(block_id, block_hash)
            self._refcounts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def cached_blocks(self) -> list[tuple[int, BlockHash]]:
        """Every block that holds a cached prefix, used or free: (block id, hash)."""
        return list(self._hash_of.items())

    def take_cached(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each cached block; a free one leaves the free list."""
        for block_id in block_ids:
            assert block_id in self._hash_of, f"block {block_id} holds no cached prefix"
            if self._refcounts[block_id] == 0:
                del self._free[block_id]
            self._refcounts[block_id] += 1

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a used, full block's contents under `block_hash`.

        Returns False (and changes nothing) if the hash already names another block, as when
        two requests computed the same prefix side by side, or the block already has a hash.
        """
        assert self._refcounts[block_id] > 0, f"block {block_id} is free"
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def forget(self, block_hash: BlockHash) -> None:
        """Drop a free block's hash (nothing if no block has it): it is reused first."""
        block_id = self._block_of.get(block_hash)
        if block_id is None:
            return
        assert self._refcounts[block_id] == 0, f"block {block_id} is in use"
        del self._block_of[block_hash], self._hash_of[block_id]
        self._free.move_to_end(block_id, last=False)

    def free(self, block_ids: list[int]) -> None:
        """Drop one holder from each block; a block left with none joins the free list.

        Pass a request's blocks in table order: they are released last block first, so the
        tail of a prefix is evicted before its head (a shorter prefix is likelier to recur).
        """
        for block_id in reversed(block_ids):
            assert self._refcounts[block_id] > 0, f"block {block_id} freed twice"
            self._refcounts[block_id] -= 1
            if self._refcounts[block_id] == 0:
                self._free[block_id] = None
                if block_id not in self._hash_of:
                    self._free.move_to_end(block_id, last=False)  # nothing to keep: reuse first
