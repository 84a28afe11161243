"""The prefix cache's second tier through its connector: blocks evicted from the pool are
saved, and a later request waits one step for its stored prefix to be read, then loads it
instead of computing it. `schedule()` itself never reads the store."""

from __future__ import annotations

from scheduler_helpers import resolve_step

from metal_engine.kv_disk.connector import KVDiskConnector, TierStore
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.output import SchedulerOutput


class MemoryStore:
    """A KVDiskStore in a dict; `unreadable` hashes are listed but fail to load, and leave."""

    root = "memory"

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.unreadable: set[bytes] = set()
        self.loads = 0
        self.scheduling = False  # set while schedule() runs: a read then is a bug

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def save(self, block_hash: bytes, payload: bytes) -> None:
        self.blocks.setdefault(block_hash, payload)

    def load(self, block_hash: bytes) -> bytes | None:
        assert not self.scheduling, "schedule() read the store"
        self.loads += 1
        if block_hash in self.unreadable:
            del self.blocks[block_hash]
            return None
        return self.blocks.get(block_hash)


class PoolContents:
    """The pool's bytes: a computed block holds its id; a loaded one what was written."""

    def __init__(self) -> None:
        self.blocks: dict[int, bytes] = {}

    def compute(self, block_id: int) -> None:
        self.blocks[block_id] = f"block {block_id}".encode()

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        return [self.blocks[block_id] for block_id in block_ids]

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        self.blocks.update(zip(block_ids, payloads, strict=True))


def blocks_connector(store, pool) -> KVDiskConnector:
    """A connector that keeps KV blocks only, in `store`, from and to `pool`."""
    return KVDiskConnector({"blocks": TierStore(store, pool.read_blocks, pool.write_blocks)})


class Tier:
    """A scheduler wired to a connector over a MemoryStore, stepped as the engine steps it."""

    def __init__(self, num_blocks: int = 8, budget: int = 64) -> None:
        self.store, self.pool = MemoryStore(), PoolContents()
        self.connector = blocks_connector(self.store, self.pool)
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=budget,
            max_model_len=64,
        ), self.connector)  # fmt: skip

    def step(self) -> SchedulerOutput:
        self.store.scheduling = True
        out = self.scheduler.schedule()
        self.store.scheduling = False
        self.connector.before_step(out.kv_plan)
        for item in out.scheduled:  # the forward writes the blocks it computes
            end = item.start_position + len(item.token_ids)
            for block_id in item.block_ids[item.start_position // 4 : -(-end // 4)]:
                self.pool.compute(block_id)
        self.connector.after_launch(out.kv_plan)
        resolve_step(self.scheduler, out, {x.request_id: 7 for x in out.scheduled if x.samples})
        return out

    def run(self, request: Request) -> list[SchedulerOutput]:
        """Run one request (and whatever else is queued) to the end; return every step."""
        self.scheduler.add_request(request)
        outs = []
        while self.scheduler.has_unfinished_requests():
            outs.append(self.step())
        return outs

    def evict_everything(self) -> None:
        """Run an unrelated request that needs every block of the pool."""
        self.run(req("filler", 31, first=100))


def req(rid: str, n: int, first: int = 10) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=1))


def loads(outs: list[SchedulerOutput]) -> list[tuple[int, bytes]]:
    return [load for out in outs for load in out.kv_plan.of("blocks").loads]


def test_evicted_cached_blocks_are_saved_and_loaded_back_for_the_next_hit():
    tier = Tier()
    tier.run(req("a", 14))  # caches 3 full blocks
    a_blocks = dict(tier.scheduler.pool.cached_blocks())
    a_contents = {h: tier.pool.blocks[b] for b, h in a_blocks.items()}
    tier.evict_everything()
    assert set(a_blocks.values()) <= set(tier.store.blocks)  # a's blocks were saved
    assert {h: tier.store.blocks[h] for h in a_contents} == a_contents
    waits, admitted, *_ = tier.run(req("again", 14))
    assert waits.scheduled == [] and waits.kv_plan.of("blocks").reads == list(a_blocks.values())
    assert admitted.kv_plan.of("blocks").reads == []
    assert [h for _, h in admitted.kv_plan.of("blocks").loads] == list(a_blocks.values())
    (item,) = admitted.scheduled
    assert item.start_position == 12 and len(item.token_ids) == 2
    assert tier.scheduler.prefix_cache.stats.stored_hit_tokens == 12
    loaded = [block_id for block_id, _ in admitted.kv_plan.of("blocks").loads]
    assert item.block_ids[:3] == loaded  # the loaded blocks back the prefix
    assert [tier.pool.blocks[b] for b in loaded] == list(a_contents.values())


def test_loaded_blocks_are_pool_hits_for_the_next_request():
    tier = Tier()
    tier.run(req("a", 14))
    tier.evict_everything()
    tier.run(req("b", 14))
    reads = tier.store.loads
    (out,) = tier.run(req("c", 14))
    moves = out.kv_plan.of("blocks")
    assert moves.loads == moves.reads == [] and tier.store.loads == reads
    assert out.scheduled[0].start_position == 12


def test_an_unreadable_stored_block_ends_the_loaded_prefix():
    tier = Tier()
    tier.run(req("a", 14))
    hashes = [h for _, h in tier.scheduler.pool.cached_blocks()]
    tier.evict_everything()
    tier.store.unreadable.add(hashes[1])
    outs = tier.run(req("again", 14))
    assert len(loads(outs)) == 1  # the first block only
    (item,) = outs[1].scheduled
    assert item.start_position == 4 and len(item.token_ids) == 10


def test_blocks_already_in_the_store_are_not_saved_again():
    tier = Tier()
    tier.run(req("a", 14))
    a_hashes = {h for _, h in tier.scheduler.pool.cached_blocks()}
    tier.evict_everything()
    tier.run(req("again", 14))  # back in the pool, and still in the store
    tier.scheduler.add_request(req("filler2", 31, first=200))
    out = tier.step()
    saved = {h for _, h in out.kv_plan.of("blocks").saves}
    assert saved and not saved & a_hashes  # the filler's blocks go, a's are there already


def test_nothing_is_read_from_the_store_for_a_request_the_pool_cannot_admit():
    tier = Tier()
    tier.run(req("a", 14))
    tier.evict_everything()
    tier.scheduler.add_request(req("hog", 20, first=300))  # takes 5 of the 8 blocks
    tier.scheduler.add_request(req("b", 14))  # 3 stored blocks + 1 for the rest: does not fit
    out = tier.step()
    assert [x.request_id for x in out.scheduled] == ["hog"]
    assert out.kv_plan.of("blocks").reads == [] and tier.store.loads == 0


def test_a_request_behind_one_waiting_for_its_reads_is_admitted_meanwhile():
    tier = Tier(num_blocks=16)
    tier.run(req("a", 14))
    tier.run(req("filler", 63, first=100))
    tier.scheduler.add_request(req("again", 14))
    tier.scheduler.add_request(req("other", 6, first=500))
    out = tier.step()
    assert [x.request_id for x in out.scheduled] == ["other"]
    assert len(out.kv_plan.of("blocks").reads) == 3


def test_staged_blocks_no_request_wants_are_dropped_and_read_again_when_wanted():
    tier = Tier()
    tier.run(req("a", 14))
    tier.evict_everything()
    tier.scheduler.add_request(req("again", 14))
    tier.step()  # reads a's 3 blocks
    tier.scheduler.finish_request("again", "abort")
    tier.step()  # no one wants them now
    assert tier.store.loads == 3
    outs = tier.run(req("later", 14))
    assert tier.store.loads == 6 and len(loads(outs)) == 3


def test_without_a_store_evictions_are_not_reported():
    s = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=4,
                                  max_num_batched_tokens=64, max_model_len=64))
    s.add_request(req("a", 14))
    while s.has_unfinished_requests():
        out = s.schedule()
        resolve_step(s, out, {x.request_id: 7 for x in out.scheduled if x.samples})
    s.add_request(req("filler", 31, first=100))
    assert s.schedule().kv_plan.of("blocks").saves == []
