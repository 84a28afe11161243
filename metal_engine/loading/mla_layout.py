"""MLA's `kv_b_proj` as mlx-lm writes it, back in one piece.

mlx-lm (mlx_lm/models/deepseek_v3.py, glm4_moe_lite.py: `sanitize`) splits each layer's
`self_attn.kv_b_proj` into two per-head products and quantizes them with the rest:
`embed_q` `[heads, rank, nope]` (each head's key up-projection, turned to take queries) and
`unembed_out` `[heads, v, rank]` (its value up-projection). mlx-community's DeepSeek, Kimi and
GLM-4.7-Flash checkpoints hold those. The layers here read `kv_b_proj` `[heads * (nope + v),
rank]`: this rebuilds it in float, which the attention reads per head anyway
(metal_engine/models/mla.py), so a quantized split comes back dequantized.
"""

from __future__ import annotations

import mlx.core as mx

from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.quantization import QuantizationConfig, dequantize

_SPLIT = ("embed_q", "unembed_out")


def join_kv_b_proj(weights: dict[str, mx.array], config: ModelConfig,
                   quantization: QuantizationConfig | None) -> dict[str, mx.array]:
    """`weights` with each layer's `embed_q` / `unembed_out` (float or quantized) replaced
    by its `kv_b_proj.weight`; unchanged for a checkpoint that has none."""
    if config.mla is None or not any(".self_attn.embed_q." in name for name in weights):
        return weights
    joined = dict(weights)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.self_attn"
        keys, values = (_float(joined, f"{prefix}.{part}", quantization) for part in _SPLIT)
        per_head = mx.concatenate([keys.swapaxes(1, 2), values], axis=1)  # [H, nope + v, rank]
        joined[f"{prefix}.kv_b_proj.weight"] = per_head.reshape(-1, per_head.shape[-1])
    return joined


def _float(weights: dict[str, mx.array], module: str,
           quantization: QuantizationConfig | None) -> mx.array:
    """Module `module`'s weight, popped from `weights` with its scales and biases, in float."""
    weight = weights.pop(f"{module}.weight")
    scales, biases = weights.pop(f"{module}.scales", None), weights.pop(f"{module}.biases", None)
    if scales is None:
        return weight
    if quantization is None:
        raise ValueError(f"{module} is quantized but config.json has no quantization entry")
    return dequantize(weight, scales, biases, quantization.params_for(module))
