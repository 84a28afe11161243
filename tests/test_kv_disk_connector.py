"""The disk tier's connector on its own: the runner side's order of moves, saving at close, and
a restart that loads what the last run saved, through real pools of two shapes on disk."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from scheduler_helpers import hash_of, resolve_step
from test_scheduler_block_store import MemoryStore, PoolContents, blocks_connector

from metal_engine.cache.kv_cache import KVCache
from metal_engine.kv_disk.connector import KVDiskConnector, TierStore
from metal_engine.kv_disk.directory import KVDiskDir
from metal_engine.kv_disk.store import BlockLayout, KVDiskStore
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.output import KVTransferPlan, TierMoves
from scheduler.prefix_hash import hash_block

SHAPES = ((2, 8), (1, 16), (2, 8))  # pools may differ in shape
BLOCK = 4


def test_an_evicted_block_is_saved_before_a_load_overwrites_it():
    store, pool = MemoryStore(), PoolContents()
    connector = blocks_connector(store, pool)
    old, new = hash_block(None, [1]), hash_block(None, [2])
    store.blocks[new] = b"new contents"
    pool.blocks[0] = b"old contents"
    connector.after_launch(KVTransferPlan({"blocks": TierMoves(reads=[new])}))
    assert connector.lookup([new]).ready == [new]
    connector.evicted("blocks", 0, old)
    connector.load("blocks", [(0, new)])
    plan = connector.take_plan()
    assert plan == KVTransferPlan({"blocks": TierMoves(saves=[(0, old)], loads=[(0, new)])})
    connector.before_step(plan)
    assert store.blocks[old] == b"old contents" and pool.blocks[0] == b"new contents"


def test_lookup_reads_nothing_and_stops_at_the_first_block_the_tier_lacks():
    store = MemoryStore()
    connector = blocks_connector(store, PoolContents())
    a, b, c, d = (hash_block(None, [i]) for i in range(4))
    store.blocks.update({a: b"a", b: b"b", d: b"d"})
    store.scheduling = True  # any read fails the test
    lookup = connector.lookup([a, b, c, d])
    assert lookup.ready == [] and lookup.unread == [a, b]
    assert connector.take_plan().is_empty  # looking up queues nothing


def test_close_saves_the_cached_blocks_the_store_lacks():
    store, pool = MemoryStore(), PoolContents()
    hashes = [hash_block(None, [i]) for i in range(100)]
    for block_id in range(100):
        pool.compute(block_id)
    store.blocks[hashes[0]] = b"saved earlier"
    blocks_connector(store, pool).close({"blocks": list(enumerate(hashes))})
    assert store.blocks[hashes[0]] == b"saved earlier"
    assert all(store.blocks[hashes[i]] == f"block {i}".encode() for i in range(1, 100))


def engine_parts(kv_dir) -> tuple[Scheduler, KVCache, KVDiskConnector, KVDiskStore]:
    cache = KVCache(SHAPES, 16, BLOCK, mx.float16)
    store = KVDiskStore(KVDiskDir(kv_dir, 1 << 20), "test", BlockLayout(SHAPES, BLOCK, "float16"))
    blocks = cache.groups()["blocks"]  # as the engine wires its disk tier
    connector = KVDiskConnector({"blocks": TierStore(store, blocks.read, blocks.write)})
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=BLOCK, max_num_seqs=2,
                                          max_num_batched_tokens=64, max_model_len=64), connector)
    return scheduler, cache, connector, store


def serve(scheduler: Scheduler, cache: KVCache, connector: KVDiskConnector, request: Request,
          rng: np.random.Generator) -> list[int]:
    """Step one request to the end as the engine does, the forward writing random K/V into
    the blocks it computes; return the block ids each step loaded."""
    scheduler.add_request(request)
    loaded = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        connector.before_step(out.kv_plan)
        loaded += [block_id for block_id, _ in out.kv_plan.of("blocks").loads]
        for item in out.scheduled:
            end = item.start_position + len(item.token_ids)
            computed = item.block_ids[item.start_position // BLOCK : -(-end // BLOCK)]
            payload_len = 2 * BLOCK * sum(h * d for h, d in SHAPES) * 2
            cache.write_blocks(computed, [rng.bytes(payload_len) for _ in computed],
                               cache.kind)
        connector.after_launch(out.kv_plan)
        resolve_step(scheduler, out, {x.request_id: 7 for x in out.scheduled if x.samples})
    return loaded


def test_a_restart_loads_the_blocks_the_last_run_saved_at_close(tmp_path):
    rng = np.random.default_rng(0)
    prompt = list(range(10, 24))  # 3 full blocks and 2 tokens
    scheduler, cache, connector, _ = engine_parts(tmp_path)
    serve(scheduler, cache, connector, Request("a", prompt, SamplingParams(max_tokens=1)), rng)
    cached = scheduler.pool.cached_blocks()
    saved = cache.read_blocks([b for b, _ in cached], cache.kind)
    before = dict(zip((h for _, h in cached), saved, strict=True))
    connector.close({"blocks": cached})

    scheduler, cache, connector, store = engine_parts(tmp_path)
    assert store.num_blocks == 3
    loaded = serve(scheduler, cache, connector,
                   Request("b", prompt, SamplingParams(max_tokens=1)), rng)
    assert len(loaded) == 3 and scheduler.prefix_cache.stats.stored_hit_tokens == 3 * BLOCK
    after = dict(zip((hash_of(scheduler.pool, b) for b in loaded),
                     cache.read_blocks(loaded, cache.kind), strict=True))
    assert after == before  # bit for bit, every pool
