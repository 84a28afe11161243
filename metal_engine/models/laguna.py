"""Laguna (poolside): attention with per-head q/k norms, a query head count per layer, a
softplus output gate per head or per element (`g_proj`), sliding-window layers beside full
ones each with its own rope (the full ones partially rotated); experts routed by the sigmoid of
optionally soft-capped logits with a choice-only correction bias, the renormalized weights
scaled, plus a shared expert (`shared_expert`); the layers listed dense keep an MLP."""

from __future__ import annotations

import mlx.nn as nn

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.layers import MLP, PreNormDecoderLayer, RMSNorm
from metal_engine.models.moe import CorrectedGate, SparseMoeBlock
from metal_engine.models.output_gate import OutputGatedAttention


def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
    moe = cfg.moe
    if not moe.is_moe_layer(layer):
        return MLP(cfg)
    gate = CorrectedGate(cfg.hidden_size, moe.num_experts, float32_logits=False)
    return SparseMoeBlock(cfg.hidden_size, moe, cfg.hidden_act, gate,
                          MLP(cfg, inner=moe.shared_intermediate_size),
                          shared_name="shared_expert")


class Model(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        bias = cfg.attention_bias
        layers = [
            PreNormDecoderLayer(cfg, OutputGatedAttention(
                cfg, i, "g_proj", "softplus", per_head=cfg.output_gate == "per-head",
                qkv_bias=bias, o_bias=bias, qk_norm=RMSNorm), feed_forward(cfg, i))
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(cfg, layers)
