"""The block pool against a model of live requests: refcounts, sharing, LRU eviction."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from scheduler_helpers import hash_of

from scheduler.block_pool import BlockPool
from scheduler.prefix_hash import hash_block

NUM_BLOCKS = 8
BLOCK_SIZE = 2


@dataclass
class Live:
    """A request's block table and which of its blocks the pool knows by hash."""

    hashes: list[bytes]
    blocks: list[int]
    registered: list[bool] = field(default_factory=list)


def chain(contents: list[int]) -> list[bytes]:
    hashes, parent = [], None
    for c in contents:
        parent = hash_block(parent, [c] * BLOCK_SIZE)
        hashes.append(parent)
    return hashes


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.live: dict[int, Live] = {}
        self.next_id = 0
        self.seen: set[bytes] = set()

    def held(self) -> set[int]:
        return {b for r in self.live.values() for b in r.blocks}

    @rule(contents=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def admit(self, contents):
        """Reuse the longest cached prefix, allocate the rest (all or nothing)."""
        hashes = chain(contents)
        hits = []
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        free_hits = sum(self.pool.refcount(b) == 0 for b in hits)
        if len(hashes) - len(hits) > self.pool.num_free_blocks - free_hits:
            return
        held_before = self.held()
        self.pool.take_cached(hits)
        new = self.pool.allocate(len(hashes) - len(hits))
        assert new is not None and not set(new) & held_before and not set(new) & set(hits)
        for h in self.seen:  # a block handed out fresh lost whatever prefix it cached
            assert self.pool.lookup(h) not in new
        self.live[self.next_id] = Live(hashes, hits + new, [True] * len(hits))
        self.next_id += 1

    @rule(count=st.integers(0, NUM_BLOCKS + 1))
    def allocate_too_many_or_not(self, count):
        if count > self.pool.num_free_blocks:
            assert self.pool.allocate(count) is None

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def register_next(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live[rid]
        i = len(r.registered)
        if i == len(r.blocks):
            return
        was = self.pool.lookup(r.hashes[i])
        ok = self.pool.cache(r.blocks[i], r.hashes[i])
        assert ok == (was is None and hash_of(self.pool, r.blocks[i]) == r.hashes[i])
        r.registered.append(ok)
        self.seen.add(r.hashes[i])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.pool.free(self.live.pop(rid).blocks)

    @invariant()
    def counts_add_up(self):
        held = self.held()
        assert self.pool.num_free_blocks + len(held) == NUM_BLOCKS
        assert self.pool.num_used_blocks == len(held)
        for b in range(NUM_BLOCKS):
            holders = sum(r.blocks.count(b) for r in self.live.values())
            assert self.pool.refcount(b) == holders >= 0

    @invariant()
    def shared_blocks_hold_identical_prefixes(self):
        where: dict[int, tuple[int, bytes]] = {}
        for r in self.live.values():
            for i, b in enumerate(r.blocks):
                if b in where:
                    assert where[b] == (i, r.hashes[i])  # chained: same hash, same prefix
                where[b] = (i, r.hashes[i])

    @invariant()
    def hashes_resolve_one_to_one(self):
        for r in self.live.values():
            for i, ok in enumerate(r.registered):
                if ok:  # a held block is never evicted
                    assert self.pool.lookup(r.hashes[i]) == r.blocks[i]
        blocks = [self.pool.lookup(h) for h in self.seen]
        found = [b for b in blocks if b is not None]
        assert len(found) == len(set(found))
        for h, b in zip(self.seen, blocks, strict=True):
            assert b is None or hash_of(self.pool, b) == h


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockPool = PoolMachine.TestCase


def test_freed_cached_blocks_are_evicted_oldest_first_after_unhashed_ones():
    pool = BlockPool(4)
    a, b = pool.allocate(2), pool.allocate(2)
    pool.cache(a[0], b"a0")
    pool.cache(b[0], b"b0")
    pool.free(a)  # a[1] has no hash: reused before any cached block
    pool.free(b)
    assert pool.allocate(2) == [b[1], a[1]]
    assert pool.allocate(1) == [a[0]] and pool.lookup(b"a0") is None
    assert pool.lookup(b"b0") == b[0]
    pool.take_cached([b[0]])
    assert pool.num_free_blocks == 0 and pool.refcount(b[0]) == 1
