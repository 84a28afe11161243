"""GPT-OSS: attention with biases and a learned sink logit per head, sliding-window layers
alternating with full ones, YaRN; every layer's MLP is experts with biases and a clamped
SwiGLU, routed by a softmax over the top-k router logits.

Weights follow mlx-lm's layout: `mlp.router`, `mlp.experts.{gate,up,down}_proj` stacked.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.layers import Attention, Linear, PreNormDecoderLayer
from metal_engine.models.moe import Activation, SwitchGLU, route
from metal_engine.models.moe_config import MoeConfig


def clamped_swiglu(alpha: float, limit: float) -> Activation:
    def act(gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, limit)
        return (mx.clip(up, -limit, limit) + 1) * gate * mx.sigmoid(alpha * gate)

    return act


class GptOssMoe(nn.Module):
    """The MoE block under GPT-OSS's names: `router` (with bias) and `experts`."""

    def __init__(self, hidden: int, moe: MoeConfig) -> None:
        super().__init__()
        self.router = Linear(hidden, moe.num_experts, bias=True)
        self.experts = SwitchGLU(hidden, moe.expert_intermediate_size, moe.num_experts,
                                 clamped_swiglu(moe.swiglu_alpha, moe.swiglu_limit), bias=True)
        self._moe = moe

    def __call__(self, x: mx.array) -> mx.array:
        weights, experts = route(self.router(x), self._moe)
        return self.experts.mix(x, weights, experts)


class Model(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        bias = cfg.attention_bias
        layers = [
            PreNormDecoderLayer(cfg, Attention(cfg, i, qkv_bias=bias, o_bias=bias, sinks=True),
                                GptOssMoe(cfg.hidden_size, cfg.moe))
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(cfg, layers)
