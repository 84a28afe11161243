"""The on-disk prefix cache with the real engine on a tiny random Llama: a restarted engine
(and one whose pool evicted the prefix) loads it from disk, computes only the rest, and
gives exactly the tokens of an uncached run; a corrupted file is recomputed, never served."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY_LLAMA

from kernels_metal.kv_quant import kv_quant_of
from metal_engine.cache.kv_cache import bytes_per_block
from metal_engine.config import EngineConfig
from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine
from scheduler import SamplingParams
from scheduler.prefix_hash import extend_block_hashes

BLOCK = 8
PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 128, size=5 * BLOCK + 3)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_llama_with_tokenizer):
    return tiny_llama_with_tokenizer


def engine(model_dir, kv_dir, num_blocks: int = 64, kv_cache_dtype: str = "auto") -> LLMEngine:
    per_block = bytes_per_block([(TINY_LLAMA["num_key_value_heads"], TINY_LLAMA["head_dim"])]
                                * TINY_LLAMA["num_hidden_layers"], BLOCK, mx.float32,
                                kv_quant_of(kv_cache_dtype))
    return build_engine(EngineConfig(
        model_dir=model_dir, block_size=BLOCK, kv_cache_memory=num_blocks * per_block,
        max_model_len=min(256, num_blocks * BLOCK), kv_cache_dir=kv_dir,
        kv_cache_dtype=kv_cache_dtype,
    ))


def generate(engine: LLMEngine, rid: str, prompt: list[int] = PROMPT):
    """(output token ids, cached prompt tokens) of one request run alone."""
    engine.add_request(rid, prompt, GREEDY)
    tokens, cached = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.new_token_ids
            cached = output.num_cached_tokens
    return tokens, cached


def cached_contents(engine: LLMEngine) -> dict[bytes, bytes]:
    """K/V bytes of every block the engine's pool holds under a prefix hash."""
    blocks = engine.scheduler.pool.cached_blocks()
    cache = engine.runner.cache
    payloads = cache.read_blocks([block_id for block_id, _ in blocks], cache.kind)
    return {block_hash: payload for (_, block_hash), payload in zip(blocks, payloads, strict=True)}


@pytest.fixture(scope="module")
def uncached(model_dir):
    """Tokens of the prompt computed in full, and the K/V of its blocks."""
    computed = engine(model_dir, None)
    return generate(computed, "uncached")[0], cached_contents(computed)


def assert_same_prefix_kv(engine: LLMEngine, uncached) -> None:
    """The prompt's 5 full blocks hold bit for bit the K/V of the run that computed them."""
    prefix = []
    extend_block_hashes(prefix, PROMPT, BLOCK, 5)
    contents, reference = cached_contents(engine), uncached[1]
    assert all(contents[h] == reference[h] for h in prefix)


def test_a_restarted_engine_loads_the_prefix_from_disk(model_dir, tmp_path, uncached):
    first = engine(model_dir, tmp_path)
    assert generate(first, "a") == (uncached[0], 0)
    first.close()
    restarted = engine(model_dir, tmp_path)
    assert generate(restarted, "a-again") == (uncached[0], 5 * BLOCK)
    assert restarted.scheduler.prefix_cache.stats.stored_hit_tokens == 5 * BLOCK
    assert_same_prefix_kv(restarted, uncached)


def test_a_prefix_evicted_from_a_small_pool_comes_back_from_disk(model_dir, tmp_path,
                                                                  uncached):
    small = engine(model_dir, tmp_path, num_blocks=8)
    generate(small, "a")
    rng = np.random.default_rng(9)
    for i in range(2):  # unrelated prompts that need the whole pool
        generate(small, f"other-{i}", [int(t) for t in rng.integers(3, 128, size=7 * BLOCK)])
    assert generate(small, "a-again") == (uncached[0], 5 * BLOCK)
    assert small.scheduler.prefix_cache.stats.stored_hit_tokens == 5 * BLOCK
    assert_same_prefix_kv(small, uncached)


def test_a_corrupted_block_file_is_recomputed_not_served(model_dir, tmp_path, uncached):
    first = engine(model_dir, tmp_path)
    generate(first, "a")
    first.close()
    files = sorted(tmp_path.rglob("*.kvb"))
    assert len(files) == 6  # 43 prompt + 5 computed output tokens fill 6 blocks
    for path in files:  # flip a byte in the middle of every block's K/V
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    restarted = engine(model_dir, tmp_path)
    assert generate(restarted, "a-again") == (uncached[0], 0)
    assert_same_prefix_kv(restarted, uncached)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_quantized_blocks_go_to_disk_and_come_back_as_they_are(model_dir, tmp_path,
                                                                kv_cache_dtype):
    """A quantized pool's blocks are stored and loaded as codes and scales: the restarted
    engine's blocks are the first one's byte for byte and its tokens the same; a float
    engine on the same dir has a namespace of its own, so it hits nothing there."""
    first = engine(model_dir, tmp_path, kv_cache_dtype=kv_cache_dtype)
    tokens, _ = generate(first, "a")
    stored = cached_contents(first)
    first.close()
    restarted = engine(model_dir, tmp_path, kv_cache_dtype=kv_cache_dtype)
    assert generate(restarted, "a-again") == (tokens, 5 * BLOCK)
    assert restarted.scheduler.prefix_cache.stats.stored_hit_tokens == 5 * BLOCK
    assert_same_prefix_kv(restarted, (tokens, stored))
    float_engine = engine(model_dir, tmp_path)
    assert generate(float_engine, "a-float")[1] == 0
