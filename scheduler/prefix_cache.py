"""Automatic prefix caching: reuse the K/V of full blocks whose token prefix was seen before."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.block_pool import BlockPool
from scheduler.prefix_hash import extend_block_hashes
from scheduler.request import Request


@dataclass
class PrefixCacheStats:
    """Token counts over admitted requests: looked up, and found cached."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    """Finds a request's cached blocks at admission and registers the blocks it fills.

    Block contents live in the pool; this class only maps request tokens to block hashes
    (kept on the request, `request.block_hashes`) and those to block ids.
    """

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.stats = PrefixCacheStats()

    def match(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request's tokens. Changes no refcount.

        At most `(num_tokens - 1) // block_size` blocks, so at least one token is left to
        compute and the step has logits to sample from. Extends `request.block_hashes`.
        """
        if not self.enabled:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, max_blocks
        )
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def take(self, request: Request, hits: list[int]) -> None:
        """Give a request with no blocks the `hits` blocks and count their tokens as computed.

        Mutates the pool refcounts, the request's block table and counters, and the stats.
        """
        assert not request.block_ids and request.num_computed_tokens == 0
        self.pool.take_cached(hits)
        num_hit_tokens = len(hits) * self.block_size
        request.block_ids = list(hits)
        request.num_computed_tokens = num_hit_tokens
        request.num_hashed_blocks = len(hits)
        if request.num_output_tokens == 0:  # first admission: what usage reports
            request.num_cached_tokens = num_hit_tokens
        if self.enabled:
            self.stats.queried_tokens += request.num_tokens
            self.stats.hit_tokens += num_hit_tokens

    def register(self, request: Request, num_tokens: int) -> None:
        """Hash every block of the first `num_tokens` tokens (all computed and known) that
        the request filled since the last call, and cache it in the pool."""
        if not self.enabled:
            return
        num_full = num_tokens // self.block_size
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, num_full)
        for i in range(request.num_hashed_blocks, num_full):
            self.pool.cache(request.block_ids[i], request.block_hashes[i])
        request.num_hashed_blocks = max(request.num_hashed_blocks, num_full)
