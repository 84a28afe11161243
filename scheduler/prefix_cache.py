"""Automatic prefix caching: reuse the K/V of full blocks whose token prefix was seen before.

Windowed layers with blocks of their own (scheduler.window_blocks) need only the blocks the
next row sees: a hit reaches as far as those are cached too.

A hybrid model's request also needs its recurrent state at the end of the prefix: there a
hit reaches only as far as the last block boundary with a state checkpoint (see
scheduler.state_cache), so blocks and state hit together or not at all.

Two tiers: blocks in the KV pool (free ones keep their contents until evicted), and, when a
connector is given, blocks its tier holds (e.g. on disk), loaded back into fresh pool blocks at
admission (see scheduler.kv_connector). Requests share blocks only under the same `cache_salt`
(e.g. one per API key): the salt roots the hash chain, so the tiers need not know of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.block_pool import BlockPool
from scheduler.kv_connector import KVConnectorScheduler, TierLookup
from scheduler.prefix_hash import BlockHash, extend_block_hashes
from scheduler.request import Request
from scheduler.state_cache import StateCache
from scheduler.window_blocks import WindowBlocks


@dataclass
class PrefixCacheStats:
    """Token counts over first admissions: looked up, found cached (either tier); and, with a
    store, looked up there (the tokens the pool lacked) and found there.

    A preempted request admitted again is not counted, as vLLM counts: its own blocks would
    read as hits and inflate the rate.
    """

    queried_tokens: int = 0
    hit_tokens: int = 0
    stored_queried_tokens: int = 0
    stored_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    """Finds a request's cached blocks at admission and registers the blocks it fills.

    Block contents live in the pool; this class only maps request tokens to block hashes
    (kept on the request, `request.block_hashes`) and those to block ids.
    """

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool,
                 store: KVConnectorScheduler | None = None,
                 states: StateCache | None = None, window: WindowBlocks | None = None):
        """`store`: the scheduler side of the tier past the pool (its connector), if any;
        `states`: the state checkpoints of a hybrid model; `window`: its sliding-window
        group's blocks."""
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.store = store if enabled else None
        self.states, self.window = states, window
        self.stats = PrefixCacheStats()

    def match(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request's tokens. Changes no refcount.

        At most `(num_tokens - 1) // block_size` blocks, so at least one token is left to
        compute and the step has logits to sample from. Extends `request.block_hashes`.
        """
        if not self.enabled:
            return []
        max_blocks = self._max_blocks(request)
        self._hash(request, max_blocks)
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def lookup_stored(self, request: Request,
                      hits: list[int]) -> tuple[list[int], TierLookup]:
        """The pool `hits` (from `match`) and the tier's blocks right after them (see
        `KVConnectorScheduler.lookup`), both cut to end where every other group has what the
        request needs there: a state checkpoint, the window's blocks (pool or tier)."""
        stored = TierLookup([], [])
        if self.store is not None:
            stored = self.store.lookup(request.block_hashes[len(hits) : self._max_blocks(request)])
        if self.states is None and self.window is None:
            return hits, stored
        count = len(hits) + len(stored.ready) + len(stored.unread)
        while count > 0:
            cut, count = self._resume_at(request, count, hits, stored)
            if cut is not None:
                return hits[:count], cut
        return [], TierLookup([], [])

    def _resume_at(self, request: Request, count: int, hits: list[int],
                   stored: TierLookup) -> tuple[TierLookup | None, int]:
        """(the tier's share of a hit of `count` blocks, count), or (None, the next count
        worth trying) if a group lacks its part: below a window block missing at index i,
        every count above i needs it too."""
        checkpoint, state = None, None
        if self.states is not None and not self.states.has(request.block_hashes[count - 1]):
            checkpoint = request.block_hashes[count - 1]
            state = self._in_tier("states", checkpoint)
            if state is None:
                return None, count - 1
        window_ready, window_unread = [], []
        if self.window is not None:
            for index, block_id in reversed(self.window.needed(request, count)):
                if block_id is None:
                    where = self._in_tier("window", request.block_hashes[index])
                    if where is None:
                        return None, index
                    (window_ready if where == "ready" else window_unread).append(
                        request.block_hashes[index])
        num_stored = max(count - len(hits), 0)
        ready = stored.ready[:num_stored]
        return TierLookup(ready, stored.unread[: num_stored - len(ready)], checkpoint,
                          state == "unread", window_ready[::-1], window_unread[::-1]), count

    def _in_tier(self, kind, block_hash: BlockHash) -> str | None:
        return None if self.store is None else self.store.find(kind, block_hash)

    def take(self, request: Request, hits: list[int], stored: Sequence[BlockHash] = ()) -> None:
        """Give a request with no blocks the `hits` blocks, then fresh blocks for the `stored`
        (ready) blocks after them, and count all their tokens as computed.

        Stored blocks are registered at once and queued with the tier to be loaded before the
        step runs. The caller checked that the pool has room. Mutates the pool, the request's
        block table and counters, and the stats.
        """
        assert not request.block_ids and request.num_computed_tokens == 0
        self.pool.take_cached(hits)
        loads = self._allocate_stored(stored)
        request.start_block_table(hits + [block_id for block_id, _ in loads])
        if self.window is not None:
            self.window.take(request, len(request.block_ids))
        num_cached_tokens = len(request.block_ids) * self.block_size
        request.num_computed_tokens = num_cached_tokens
        request.num_hashed_blocks = len(request.block_ids)
        # Readmitted after a preemption, its own blocks would read as cache hits: usage and
        # stats count the first admission only.
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached_tokens
            if self.enabled:
                self._count(request.num_tokens, len(hits), len(loads))

    def _count(self, num_tokens: int, num_pool_hits: int, num_stored_hits: int) -> None:
        stats, block_size = self.stats, self.block_size
        stats.queried_tokens += num_tokens
        stats.hit_tokens += (num_pool_hits + num_stored_hits) * block_size
        if self.store is not None:
            stats.stored_queried_tokens += num_tokens - num_pool_hits * block_size
            stats.stored_hit_tokens += num_stored_hits * block_size

    def _allocate_stored(self, stored: Sequence[BlockHash]) -> list[tuple[int, BlockHash]]:
        if not stored:
            return []
        blocks = self.pool.allocate(len(stored))
        assert blocks is not None and self.store is not None, "the caller checked"
        loads = list(zip(blocks, stored, strict=True))
        for block_id, block_hash in loads:
            self.pool.cache(block_id, block_hash)
        self.store.load("blocks", loads)
        return loads

    def _hash(self, request: Request, num_blocks: int) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            num_blocks, cache_salt=request.cache_salt)  # fmt: skip

    def _max_blocks(self, request: Request) -> int:
        return (request.num_tokens - 1) // self.block_size

    def register(self, request: Request, num_tokens: int) -> None:
        """Hash every block of the first `num_tokens` tokens (all computed and known) that
        the request filled since the last call, and cache it in the pool."""
        if not self.enabled:
            return
        num_full = num_tokens // self.block_size
        self._hash(request, num_full)
        for i in range(request.num_hashed_blocks, num_full):
            block_id, block_hash = request.block_ids[i], request.block_hashes[i]
            if self.pool.cache(block_id, block_hash) and self.store is not None:
                self.store.computed("blocks", block_id, block_hash)
        if self.window is not None:
            self.window.register(request, request.num_hashed_blocks, num_full)
        request.num_hashed_blocks = max(request.num_hashed_blocks, num_full)
