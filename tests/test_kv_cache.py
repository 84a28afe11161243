"""K/V writes land in the pool in place: a step never allocates a pool-sized buffer."""

from __future__ import annotations

import mlx.core as mx
from engine_helpers import make_runner_and_scheduler
from scheduler_helpers import run_step

from metal_engine.cache.kv_cache import KVCache, bytes_per_block
from scheduler import Request, SamplingParams


def step_peak_bytes(runner, scheduler) -> int:
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    out = scheduler.schedule()
    run_step(runner, scheduler, out)
    return mx.get_peak_memory() - active


def test_step_writes_kv_in_place(tiny_llama, monkeypatch):
    """MLX's scatter (the Metal path's K/V write) donates the pool; the CPU backend's host
    forward writes into the pool's buffer and is off here."""
    import kernels_metal.cpu.host_forward as host

    monkeypatch.setattr(host, "numpy_serves", lambda: False)
    _, path = tiny_llama
    runner, scheduler = make_runner_and_scheduler(path, num_blocks=16384, max_model_len=4096)
    pool_bytes = runner.cache.k[0].nbytes
    scheduler.add_request(Request("a", list(range(3, 40)), SamplingParams(max_tokens=8)))
    step_peak_bytes(runner, scheduler)  # warm up
    assert step_peak_bytes(runner, scheduler) < pool_bytes // 4
    # The measurement does see a copy: a second view of a pool forces the scatter to copy it.
    view = runner.cache.k[0].reshape(-1)
    assert step_peak_bytes(runner, scheduler) >= pool_bytes
    del view


def test_written_slots_hold_the_new_keys(tiny_llama):
    _, path = tiny_llama
    runner, scheduler = make_runner_and_scheduler(path, num_blocks=8, block_size=4)
    scheduler.add_request(Request("a", list(range(3, 13)), SamplingParams(max_tokens=2)))
    out = scheduler.schedule()
    runner.launch(out).sampled()
    blocks = out.scheduled[0].block_ids
    k = runner.cache.k[0]
    written = mx.abs(k[mx.array(blocks)]).sum(axis=(-1, -2)).reshape(-1)  # per slot
    assert (written[:10] > 0).all().item() and (written[10:] == 0).all().item()
    untouched = [b for b in range(8) if b not in blocks]
    assert mx.abs(k[mx.array(untouched)]).sum().item() == 0


def test_blocks_read_as_bytes_write_back_bit_exact_into_other_blocks():
    for dtype in (mx.float32, mx.bfloat16):
        # Pools of different shapes, as Gemma 4's sliding and full layers have.
        shapes = [(2, 8), (1, 16), (2, 8)]
        cache = KVCache(shapes, num_blocks=6, block_size=4, dtype=dtype)
        for layer in range(3):
            k, v = cache.take(layer)
            cache.put(layer, mx.random.normal(k.shape).astype(dtype),
                      mx.random.normal(v.shape).astype(dtype))
        payloads = cache.read_blocks([1, 4], cache.kind)
        assert len(payloads[0]) == bytes_per_block(shapes, 4, dtype)
        cache.write_blocks([0, 5], payloads, cache.kind)
        for pools in (cache.k, cache.v):
            for pool in pools:
                assert mx.array_equal(pool[0], pool[1]) and mx.array_equal(pool[5], pool[4])
                assert not mx.array_equal(pool[0], pool[4])
