"""Automatic prefix caching: reuse the K/V of full blocks whose token prefix was seen before.

A hit is a run of the anchor group's blocks (scheduler.cache_groups.full_attention), cut
short where another group lacks its part: a sliding window's blocks that the next row sees,
a hybrid model's state checkpoint at the hit's end. So every group hits together or not at
all.

Two tiers: blocks in the KV pool (free ones keep their contents until evicted), and, when a
connector is given, blocks its tier holds (e.g. on disk), loaded back into fresh pool blocks at
admission (see scheduler.kv_connector). Requests share blocks only under the same `cache_salt`
(e.g. one per API key): the salt roots the hash chain, so the tiers need not know of it. A
request's LoRA adapter enters every block hash the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.cache_groups import CacheGroup, FullAttentionGroup
from scheduler.kv_connector import KVConnectorScheduler, TierLookup, TierShare
from scheduler.prefix_hash import extend_block_hashes
from scheduler.request import Request


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
    """Finds a request's cached prefix at admission, across the cache groups, and registers
    the blocks it fills.

    Block contents live in the groups' pools; this class only maps request tokens to block
    hashes (kept on the request, `request.block_hashes`) and asks each group for its part.
    """

    def __init__(self, groups: list[CacheGroup], block_size: int, enabled: bool,
                 connector: KVConnectorScheduler | None = None):
        """`groups`: the model's cache groups, the anchor (full attention) first; `connector`:
        the scheduler side of the tier past the pools, if any."""
        self.groups = groups
        self.blocks: FullAttentionGroup = groups[0]
        self.block_size = block_size
        self.enabled = enabled
        self.connector = connector if enabled else None
        self.stats = PrefixCacheStats()

    def match(self, request: Request) -> list[int]:
        """Block ids of the longest prefix of the request's tokens cached in the anchor's
        pool. Changes no refcount.

        At most `(num_tokens - 1) // block_size` blocks, so at least one token is left to
        compute and the step has logits to sample from. Extends `request.block_hashes`.
        """
        if not self.enabled:
            return []
        max_blocks = self._max_blocks(request)
        self._hash(request, max_blocks)
        return self.blocks.match(request, max_blocks)

    def lookup_stored(self, request: Request,
                      hits: list[int]) -> tuple[list[int], TierLookup]:
        """The pool `hits` (from `match`) and the tier's blocks right after them (see
        `KVConnectorScheduler.lookup`), both cut to end where every other group has its part
        in memory or in the tier; the lookup holds each group's share of the tier."""
        stored = TierShare()
        if self.connector is not None:
            uncached = request.block_hashes[len(hits) : self._max_blocks(request)]
            stored = self.connector.lookup(uncached)
        count = len(hits) + len(stored.ready) + len(stored.unread)
        while count > 0:
            shares = self._shares_at(request, count)
            if isinstance(shares, dict):
                num_stored = max(count - len(hits), 0)
                ready = stored.ready[:num_stored]
                unread = stored.unread[: num_stored - len(ready)]
                shares[self.blocks.kind] = TierShare(ready, unread)
                return hits[:count], TierLookup(shares)
            count = shares
        return [], TierLookup()

    def _shares_at(self, request: Request, count: int) -> dict[str, TierShare] | int:
        """Each other group's tier share of a hit of `count` blocks, or the next count worth
        trying if a group lacks its part."""
        shares = {}
        for group in self.groups[1:]:
            share = group.hit(request, count)
            if isinstance(share, int):
                return share
            shares[group.kind] = share
        return shares

    def admit(self, request: Request, hits: list[int], lookup: TierLookup) -> None:
        """Start a request with no blocks over `hits` and the tier's ready blocks after them
        (each group takes its part), and count all their tokens as computed. The caller
        checked that every group has room. Mutates the pools, the request's tables and
        counters, and the stats."""
        num_stored = len(lookup.of(self.blocks.kind).ready)
        num_blocks = len(hits) + num_stored
        for group in self.groups:
            group.admit(request, num_blocks, lookup.of(group.kind))
        num_cached_tokens = num_blocks * self.block_size
        request.num_computed_tokens = num_cached_tokens
        request.num_hashed_blocks = num_blocks
        # Readmitted after a preemption, its own blocks would read as cache hits: usage and
        # stats count the first admission only.
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached_tokens
            if self.enabled:
                self._count(request.num_tokens, len(hits), num_stored)

    def _count(self, num_tokens: int, num_pool_hits: int, num_stored_hits: int) -> None:
        stats, block_size = self.stats, self.block_size
        stats.queried_tokens += num_tokens
        stats.hit_tokens += (num_pool_hits + num_stored_hits) * block_size
        if self.connector is not None:
            stats.stored_queried_tokens += num_tokens - num_pool_hits * block_size
            stats.stored_hit_tokens += num_stored_hits * block_size

    def _hash(self, request: Request, num_blocks: int) -> None:
        # An adapter's K/V differ from the base's for the same tokens: its blocks never
        # serve other weights, in the pool or on disk (keyed by what the weights are).
        adapter = () if request.lora_key is None else (request.lora_key,)
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            num_blocks, adapter, cache_salt=request.cache_salt,
                            media=request.media)  # fmt: skip

    def _max_blocks(self, request: Request) -> int:
        if request.pooling is not None and request.pooling.reads_every_row:
            return 0  # its pooled vector reads every prompt token's hidden state
        return (request.num_tokens - 1) // self.block_size

    def register(self, request: Request, num_tokens: int) -> None:
        """Hash every block of the first `num_tokens` tokens (all computed and known) that
        the request filled since the last call, and let each group cache what it holds
        there (and commit what it saved up to them)."""
        if self.enabled:
            self._hash(request, num_tokens // self.block_size)
        for group in self.groups:
            group.resolved(request, request.num_hashed_blocks, num_tokens)
        if self.enabled:
            request.num_hashed_blocks = max(request.num_hashed_blocks,
                                            num_tokens // self.block_size)
