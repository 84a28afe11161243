"""The cache budget split between a model's groups (metal_engine.cache.cache_plan)."""

from __future__ import annotations

import mlx.core as mx

from metal_engine.cache.cache_plan import CHECKPOINTS_PER_SEQ, plan_cache, window_blocks
from metal_engine.loading.model_config import ModelConfig

GEMMA3 = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
              intermediate_size=96, sliding_window=512, sliding_window_pattern=6,
              max_position_embeddings=131072)  # fmt: skip


def test_windowed_layers_get_what_running_requests_see_and_full_ones_the_rest():
    cfg = ModelConfig.from_dict(GEMMA3)
    budget = 1 << 30
    plan = plan_cache(cfg, budget, mx.float16, 16, max_num_seqs=8, max_num_batched_tokens=512,
                      prefix_caching=True)
    assert plan.windowed_pools == (0, 1, 2, 3, 4) and plan.window == 512
    assert plan.num_window_blocks == window_blocks(512, 16, 8, 512) == 8 * 34 + 32 + 1
    used = plan.num_blocks * plan.bytes_per_block
    used += plan.num_window_blocks * plan.bytes_per_window_block
    assert budget - plan.bytes_per_block < used <= budget
    everything_full = plan_cache(ModelConfig.from_dict({**GEMMA3, "sliding_window": None}),
                                 budget, mx.float16, 16, 8, 512, True)
    assert plan.num_blocks > 5 * everything_full.num_blocks  # the full layer is 1 of 6


def test_no_window_group_when_it_would_not_save_memory():
    cfg = ModelConfig.from_dict(GEMMA3)
    plan = plan_cache(cfg, 4 << 20, mx.float16, 16, 64, 512, True)  # fits less than a window
    assert plan.windowed_pools == () and plan.num_window_blocks == 0


def test_hybrid_models_take_live_slots_and_checkpoints_out_of_the_budget():
    cfg = ModelConfig.from_dict(dict(
        model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, intermediate_size=96,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"] * 2))
    on = plan_cache(cfg, 64 << 20, mx.float32, 16, 8, 256, prefix_caching=True)
    off = plan_cache(cfg, 64 << 20, mx.float32, 16, 8, 256, prefix_caching=False)
    assert on.num_state_slots == 8 + CHECKPOINTS_PER_SEQ * 8 and off.num_state_slots == 8
    assert off.num_blocks > on.num_blocks
