"""A prefill/decode split over a shared --kv-cache-dir: a prefill engine with write-through
computes a prompt (one token), a decode engine started before that finds the prompt's blocks
on disk, computes only the rest, and gives the tokens one engine gives."""

from __future__ import annotations

import numpy as np
import pytest

from metal_engine.config import EngineConfig
from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine
from scheduler import SamplingParams

BLOCK = 16
PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 128, size=6 * BLOCK + 5)]


@pytest.fixture(scope="module")
def model_dir(tiny_llama_with_tokenizer):
    return tiny_llama_with_tokenizer


def engine(model_dir, kv_dir=None, write_through: bool = False) -> LLMEngine:
    return build_engine(EngineConfig(
        model_dir=model_dir, block_size=BLOCK, kv_cache_memory=8 << 20, max_model_len=256,
        kv_cache_dir=kv_dir, kv_write_through=write_through))


def run(engine: LLMEngine, rid: str, max_tokens: int) -> tuple[list[int], int]:
    """(output tokens, cached prompt tokens) of one greedy request run alone."""
    engine.add_request(rid, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                   ignore_eos=True))
    tokens, cached = [], 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.new_token_ids
            cached = output.num_cached_tokens
    return tokens, cached


def test_a_prompt_prefilled_on_one_engine_is_decoded_on_another(model_dir, tmp_path):
    expected, _ = run(engine(model_dir), "alone", 12)
    decode = engine(model_dir, tmp_path)  # running before the prefill engine saves anything
    prefill = engine(model_dir, tmp_path, write_through=True)
    first, _ = run(prefill, "prefill", 1)
    assert first == expected[:1]
    # The blocks are on disk once the prefill engine's answer is out: no shutdown, no eviction.
    assert prefill.connector._blocks.store.num_blocks == len(PROMPT) // BLOCK
    tokens, cached = run(decode, "decode", 12)
    assert cached == len(PROMPT) // BLOCK * BLOCK
    assert tokens == expected


def test_without_write_through_nothing_is_handed_over(model_dir, tmp_path):
    decode = engine(model_dir, tmp_path)
    run(engine(model_dir, tmp_path), "prefill", 1)
    _, cached = run(decode, "decode", 4)
    assert cached == 0


def test_write_through_needs_a_directory(model_dir):
    with pytest.raises(ValueError, match="--kv-write-through saves blocks to --kv-cache-dir"):
        EngineConfig(model_dir=model_dir, kv_write_through=True)
