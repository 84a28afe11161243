"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention with softmax-routed experts
in place of the MLP, except in the layers the config keeps dense."""

from __future__ import annotations

import mlx.nn as nn

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.layers import (
    MLP,
    Attention,
    Linear,
    PreNormDecoderLayer,
    RMSNorm,
)
from metal_engine.models.moe import SparseMoeBlock


def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
    """The layer's experts, or its dense MLP."""
    moe = cfg.moe
    if moe is None or not moe.is_moe_layer(layer):
        return MLP(cfg)
    gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)
    return SparseMoeBlock(cfg.hidden_size, moe, cfg.hidden_act, gate)


class Model(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        bias = cfg.attention_bias
        layers = [
            PreNormDecoderLayer(cfg, Attention(cfg, i, qkv_bias=bias, o_bias=bias,
                                               qk_norm=RMSNorm), feed_forward(cfg, i))
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(cfg, layers)
