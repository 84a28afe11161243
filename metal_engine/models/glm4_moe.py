"""GLM-4.5 / 4.6 / 4.7 (glm4_moe): partial rotary attention with q/k/v biases and optional q/k
norms; sigmoid-routed experts chosen with a correction bias (and by group), scaled, plus a
shared expert every token runs; the first layers keep a dense MLP."""

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
from metal_engine.models.moe import CorrectedGate, SparseMoeBlock


def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
    """The layer's dense MLP, or its experts (and shared experts) under a router with the
    correction bias, or a plain one (Mistral 4)."""
    return experts(cfg) if cfg.moe.is_moe_layer(layer) else MLP(cfg)


def experts(cfg: ModelConfig) -> nn.Module:
    """A MoE layer's feed-forward: experts (and shared experts) under their router."""
    moe = cfg.moe
    shared = MLP(cfg, inner=moe.shared_intermediate_size) if moe.shared_intermediate_size else None
    gate = (CorrectedGate(cfg.hidden_size, moe.num_experts) if moe.score_correction_bias
            else Linear(cfg.hidden_size, moe.num_experts, bias=False))
    return SparseMoeBlock(cfg.hidden_size, moe, cfg.hidden_act, gate, shared)


class Model(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        norm = RMSNorm if cfg.qk_norm else None
        layers = [
            PreNormDecoderLayer(cfg, Attention(cfg, i, qkv_bias=cfg.attention_bias,
                                               qk_norm=norm), feed_forward(cfg, i))
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(cfg, layers)
