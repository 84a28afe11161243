"""DeepSeek sparse attention (deepseek_v32, glm_moe_dsa) past its `index_topk` (8 in the tiny
configs): the index key rides in the latent pool's row, so prefix hits, preemption and an int8
pool carry it; served tokens equal transformers'. Whole, chunked and token-by-token logits and
mixed batches on every backend are test_model_parity's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import (
    greedy_after_preemptions,
    make_runner_and_scheduler,
    run_counting_preemptions,
)
from test_model_parity import random_ids, run_logits
from tiny_models import build_tiny_model, hf_greedy

from convert import convert_model
from metal_engine.cache.cache_plan import group_bytes
from metal_engine.loading.model_config import ModelConfig
from scheduler import Request, SamplingParams

# The tiny configs' kv_lora_rank + qk_rope_head_dim, index_head_dim and index_topk.
LATENT, INDEX_KEY, TOP_K = 32 + 8, 16, 8
FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_dsa(request, tmp_path_factory):
    source = tmp_path_factory.mktemp(f"{request.param}-hf")
    model = build_tiny_model(request.param, source)
    return model, convert_model(source, tmp_path_factory.mktemp(request.param) / "model",
                                progress=False)


def test_an_indexing_layers_row_keeps_its_index_key_after_the_latent(tiny_dsa):
    """GLM-5's shared middle layer keeps no index key; the memory plan counts each row."""
    _, path = tiny_dsa
    cfg = ModelConfig.from_model_dir(path)
    shared = cfg.model_type == "glm_moe_dsa"
    widths = [LATENT + INDEX_KEY, LATENT + (0 if shared else INDEX_KEY), LATENT + INDEX_KEY]
    assert cfg.kv_pool_shapes() == [(1, w) for w in widths]
    assert group_bytes(cfg, mx.float16, 16, 4, 64).bytes_per_block == 16 * sum(widths) * 2


def test_prefix_hits_past_index_topk_serve_transformers_tokens(tiny_dsa):
    """Later prompts hit the first's blocks (latent rows and index keys) and choose their keys
    among the cached ones: a short tail, a long one, and a prompt ending inside a block."""
    model, path = tiny_dsa
    runner, scheduler = make_runner_and_scheduler(path, block_size=8)
    shared = random_ids(9, 40)
    asked = {"first": shared + [5, 6, 7], "second": shared + [8, 9],
             "third": shared + random_ids(10, 20), "fourth": shared[:35]}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for rid, ids in asked.items():  # one after the other: each hits the blocks before it
        request = Request(rid, ids, params, eos_token_ids=(2,))
        run_counting_preemptions(runner, scheduler, [request])
        assert request.output_token_ids == hf_greedy(model, ids, 8), rid
        if rid != "first":
            assert request.num_cached_tokens >= 32, rid


def test_preempted_requests_resume_exactly(tiny_dsa):
    model, path = tiny_dsa
    rng = np.random.default_rng(4)
    asked = {f"r{i}": [int(t) for t in rng.integers(3, 128, size=15 + 4 * i)] for i in range(4)}
    # Together the requests need ~16 blocks of 8; the pool has 9.
    served = greedy_after_preemptions(path, asked, num_blocks=9)
    assert served == {rid: hf_greedy(model, ids, 10) for rid, ids in asked.items()}


def test_an_int8_pool_stays_near_the_float_one(tiny_dsa):
    """Index keys stored as codes and scales with their latent rows, and chosen from them.
    The codes move a row's logits as little as MLA's unless they move a key across the top-k
    boundary (a different key attended): every row before index_topk, and most after, stay
    within 2% of the largest logit."""
    from kernels_metal.kv_quant import KVQuant

    _, path = tiny_dsa
    ids = random_ids(6, 30)
    exact = run_logits(*make_runner_and_scheduler(path, block_size=8), "a", ids, chunk=7)
    runner, scheduler = make_runner_and_scheduler(path, block_size=8, kv_quant=KVQuant(8))
    got = run_logits(runner, scheduler, "a", ids, chunk=7)
    error = np.abs(got - exact).max(axis=1) / np.abs(exact).max()
    assert 0 < error[:TOP_K].max() < 0.02, error
    assert (error[TOP_K:] < 0.02).mean() > 0.75, error


@pytest.mark.parametrize(("config_class", "layers"), [("DeepseekV32Config", 61),
                                                      ("GlmMoeDsaConfig", 78)])
def test_dry_run_of_published_dsa_configs_counts_the_index_key(tmp_path, capsys, config_class,
                                                                layers):
    """transformers' defaults for these classes are DeepSeek V3.2's and GLM-5's configs: a
    latent row of 576 and an index key of 128 a layer."""
    import json

    import transformers

    from server.cli import main

    published = getattr(transformers, config_class)().to_dict()
    published["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(published))
    main(["serve", "--dry-run", str(tmp_path)])
    per_token = layers * (512 + 64 + 128) * 2
    assert f"bfloat16, {per_token / 1024:.1f} KiB a token" in capsys.readouterr().out
