"""The prefix cache's second tier: blocks evicted from the pool go to a store, and a later
request loads its prefix back from there instead of computing it."""

from __future__ import annotations

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig


class MemoryStore:
    """A BlockStore in a dict; `unreadable` hashes are listed but fail to load."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.unreadable: set[bytes] = set()
        self.loads = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    def load(self, block_hash: bytes) -> bytes | None:
        self.loads += 1
        return None if block_hash in self.unreadable else self.blocks.get(block_hash)


def make(store: MemoryStore, num_blocks: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=4,
                                     max_num_batched_tokens=budget, max_model_len=64), store)


def req(rid: str, n: int, first: int = 10) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=1))


def run(s: Scheduler, request: Request):
    """Run one request to the end; return the first step's output."""
    s.add_request(request)
    first = None
    while s.has_unfinished_requests():
        out = s.schedule()
        first = first or out
        s.update(out, {x.request_id: 7 for x in out.scheduled if x.samples})
    return first


def spill(s: Scheduler, store: MemoryStore, out) -> None:
    """What the engine does with `blocks_to_save`: the payload names the block it came from."""
    for block_id, block_hash in out.blocks_to_save:
        store.blocks[block_hash] = f"block {block_id}".encode()


def evict_everything(s: Scheduler, store: MemoryStore) -> None:
    """Run an unrelated request that needs every block of the pool."""
    s.add_request(req("filler", 31, first=100))
    while s.has_unfinished_requests():
        out = s.schedule()
        spill(s, store, out)
        s.update(out, {x.request_id: 7 for x in out.scheduled if x.samples})


def test_evicted_cached_blocks_are_spilled_and_loaded_back_for_the_next_hit():
    store = MemoryStore()
    s = make(store)
    run(s, req("a", 14))  # caches 3 full blocks
    a_blocks = dict(s.pool.cached_blocks())
    evict_everything(s, store)
    assert set(a_blocks.values()) <= set(store.blocks)  # a's blocks were spilled
    out = run(s, req("again", 14))
    assert [payload for _, payload in out.blocks_to_load] == [
        store.blocks[h] for h in a_blocks.values()
    ]
    (item,) = out.scheduled
    assert item.start_position == 12 and len(item.token_ids) == 2
    assert s.prefix_cache.stats.stored_hit_tokens == 12
    loaded = [block_id for block_id, _ in out.blocks_to_load]
    assert item.block_ids[:3] == loaded  # the loaded blocks back the prefix


def test_loaded_blocks_are_pool_hits_for_the_next_request():
    store = MemoryStore()
    s = make(store)
    run(s, req("a", 14))
    evict_everything(s, store)
    run(s, req("b", 14))
    loads = store.loads
    out = run(s, req("c", 14))
    assert out.blocks_to_load == [] and store.loads == loads
    assert out.scheduled[0].start_position == 12


def test_an_unreadable_stored_block_ends_the_loaded_prefix():
    store = MemoryStore()
    s = make(store)
    run(s, req("a", 14))
    hashes = [h for _, h in s.pool.cached_blocks()]
    evict_everything(s, store)
    store.unreadable.add(hashes[1])
    out = run(s, req("again", 14))
    assert len(out.blocks_to_load) == 1  # the first block only
    assert out.scheduled[0].start_position == 4 and len(out.scheduled[0].token_ids) == 10


def test_blocks_already_in_the_store_are_not_spilled_again():
    store = MemoryStore()
    s = make(store)
    run(s, req("a", 14))
    a_hashes = {h for _, h in s.pool.cached_blocks()}
    evict_everything(s, store)
    run(s, req("again", 14))  # back in the pool, and still in the store
    s.add_request(req("filler2", 31, first=200))
    out = s.schedule()
    spilled = {h for _, h in out.blocks_to_save}
    assert spilled and not spilled & a_hashes  # the filler's blocks go, a's are there already


def test_nothing_is_read_from_the_store_for_a_request_the_pool_cannot_admit():
    store = MemoryStore()
    s = make(store)
    run(s, req("a", 14))
    evict_everything(s, store)
    s.add_request(req("hog", 20, first=300))  # takes 5 of the 8 blocks
    s.add_request(req("b", 14))  # 3 stored blocks + 1 for the rest: does not fit yet
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["hog"] and store.loads == 0


def test_without_a_store_evictions_are_not_reported():
    s = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=4,
                                  max_num_batched_tokens=64, max_model_len=64))
    run(s, req("a", 14))
    s.add_request(req("filler", 31, first=100))
    assert s.schedule().blocks_to_save == []
