"""Qwen3-Next stores each linear-attention layer's input projections fused (`in_proj_qkvz`,
`in_proj_ba`); the layout here keeps Qwen3.5's four (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`), which the same layer class loads."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx

from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.weights import split_fused


def unfused_shapes(config: ModelConfig,
                   shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`shapes` with each fused projection replaced by the ones it splits into."""
    if config.model_type != "qwen3_next":
        return shapes
    linear, out = config.linear_attention, {}
    for name, shape in shapes.items():
        prefix, hidden = name.rpartition(".")[0].rpartition(".")[0], shape[-1]
        if name.endswith("in_proj_qkvz.weight"):
            out[f"{prefix}.in_proj_qkv.weight"] = (linear.conv_dim, hidden)
            out[f"{prefix}.in_proj_z.weight"] = (linear.value_dim, hidden)
        elif name.endswith("in_proj_ba.weight"):
            out[f"{prefix}.in_proj_b.weight"] = (linear.num_value_heads, hidden)
            out[f"{prefix}.in_proj_a.weight"] = (linear.num_value_heads, hidden)
        else:
            out[name] = shape
    return out


def unfuse(config: ModelConfig,
           tensors: Iterator[tuple[str, mx.array]]) -> Iterator[tuple[str, mx.array]]:
    """The tensor stream with each fused projection split as it passes."""
    if config.linear_attention is None:
        yield from tensors
        return
    for name, tensor in tensors:
        yield from split_fused(name, tensor, config.linear_attention)
