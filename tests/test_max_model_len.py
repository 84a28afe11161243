"""The context limit: the model's trained context unless the user asks for more, and asking
for more takes an explicit override."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from conftest import TINY_LLAMA

from metal_engine.cache.kv_cache import bytes_per_block
from metal_engine.config import EngineConfig, check_kv_cache_blocks, resolve_max_model_len
from metal_engine.engine_build import build_engine
from metal_engine.loading.model_config import ModelConfig


def _config(**fields) -> EngineConfig:
    return EngineConfig(model_dir="m", **fields)


def test_unset_is_the_trained_context_capped_by_the_kv_cache():
    assert resolve_max_model_len(_config(), trained=8192, kv_tokens=100_000) == 8192
    assert resolve_max_model_len(_config(), trained=8192, kv_tokens=4096) == 4096


def test_up_to_the_trained_context_is_taken_as_asked():
    assert resolve_max_model_len(_config(max_model_len=8192), 8192, 100_000) == 8192


def test_a_context_the_kv_cache_cannot_hold_is_refused():
    # Else a request within the context could still not fit the cache: a 400 for every one.
    with pytest.raises(ValueError, match="--max-model-len 8192 .* holds 4096.*--kv-cache-memory"):
        resolve_max_model_len(_config(max_model_len=8192), 8192, 4096)


def test_beyond_the_trained_context_names_the_flag_and_the_override(caplog):
    with pytest.raises(ValueError, match="--max-model-len 9000 .* 8192 tokens") as error:
        resolve_max_model_len(_config(max_model_len=9000), 8192, 100_000)
    assert "--allow-long-max-model-len" in str(error.value)
    allowed = _config(max_model_len=9000, allow_long_max_model_len=True)
    with caplog.at_level(logging.WARNING):
        assert resolve_max_model_len(allowed, 8192, 100_000) == 9000
    assert "beyond the model's trained context of 8192" in caplog.text


def test_yarn_stretches_the_original_context():
    plain = ModelConfig.from_dict({**TINY_LLAMA, "model_type": "qwen2"})
    assert plain.trained_context_len == 512
    yarn = ModelConfig.from_dict({
        **TINY_LLAMA, "model_type": "qwen2",
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    })  # fmt: skip
    assert yarn.trained_context_len == 2048


def test_a_kv_cache_of_fewer_than_two_blocks_is_refused():
    check_kv_cache_blocks(2, budget=2048)
    with pytest.raises(ValueError, match="2048 bytes holds 1 blocks.*raise --kv-cache-memory"):
        check_kv_cache_blocks(1, budget=2048)


def test_an_engine_with_a_one_block_kv_cache_names_the_flag(tiny_llama_with_tokenizer):
    # The context is capped by the cache, so a check against the context could never fire.
    per_block = bytes_per_block([(TINY_LLAMA["num_key_value_heads"], TINY_LLAMA["head_dim"])]
                                * TINY_LLAMA["num_hidden_layers"], 16, mx.float32)
    config = EngineConfig(model_dir=tiny_llama_with_tokenizer, dtype="float32",
                          kv_cache_memory=per_block)
    with pytest.raises(ValueError, match="holds 1 blocks.*raise --kv-cache-memory"):
        build_engine(config)
