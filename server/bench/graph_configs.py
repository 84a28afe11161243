"""The model configs `bench graph` traces: one per family, shaped like a released checkpoint.

Each is a Hugging Face `config.json` dict, which both metal-serve and mlx-lm read. Traces
shrink the widths that only size the weights (`TRACE_WIDTHS`): a step's graph and the host
time to build it depend on layers, heads and layer kinds, not on how wide a product is, and
the weights then fit on any machine.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIGS: dict[str, dict] = {
    # Llama-3.1-8B
    "llama": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=False),
    # Qwen3-8B
    "qwen3": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=False),
    # Qwen3-30B-A3B
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        tie_word_embeddings=False),
    # Qwen3.5-9B-like: Gated DeltaNet layers, every fourth one gated full attention
    "qwen3_5": dict(
        model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        vocab_size=248320, rms_norm_eps=1e-6, max_position_embeddings=262144,
        full_attention_interval=4, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                             partial_rotary_factor=0.25),
        tie_word_embeddings=False),
    # gemma-3-4b (text): five sliding-window layers to one global
    "gemma3": dict(
        model_type="gemma3_text", hidden_size=2560, intermediate_size=10240,
        num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        vocab_size=262208, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling=dict(rope_type="linear", factor=8.0),
        query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
        max_position_embeddings=131072, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True),
    # GLM-4.7-Flash (30B-A3B): multi-head latent attention over sigmoid-routed experts
    "glm4_moe_lite": dict(
        model_type="glm4_moe_lite", hidden_size=2048, intermediate_size=10240,
        moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20,
        num_key_value_heads=20, n_shared_experts=1, n_routed_experts=64,
        routed_scaling_factor=1.8, kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64,
        v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=202752, rms_norm_eps=1e-5,
        rope_theta=1000000.0, rope_interleave=True, vocab_size=154880,
        tie_word_embeddings=False),
}
# Widths that only size weights, and what a trace sets them to.
TRACE_WIDTHS = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                    shared_expert_intermediate_size=128, vocab_size=1024)


def layer_period(config: dict) -> int:
    """Layers after which the kinds of layer repeat (1 for a uniform stack)."""
    return int(config.get("full_attention_interval") or config.get("sliding_window_pattern")
               or 1) if config["model_type"] in ("qwen3_5_text", "gemma3_text") else 1


def load_config(name: str) -> dict:
    """A built-in config by name, or a model dir's / a file's `config.json`."""
    if name in CONFIGS:
        return dict(CONFIGS[name])
    path = Path(name)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"{name!r} is neither a built-in config ({', '.join(CONFIGS)}) nor a "
                         "model dir or config.json")
    config = json.loads(path.read_text())
    return dict(config.get("text_config") or config)


def for_trace(config: dict, num_layers: int | None = None) -> dict:
    """`config` with narrow weights (and `num_layers` layers, if given)."""
    narrow = {k: v for k, v in TRACE_WIDTHS.items() if k in config or k == "vocab_size"}
    out = {**config, **narrow}
    if num_layers is not None:
        out["num_hidden_layers"] = num_layers
        if "layer_types" in out:
            out["layer_types"] = out["layer_types"][:num_layers]
    return out
