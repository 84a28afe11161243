"""Gemma 3 (text): Gemma 2's layout plus a `1 + w` RMSNorm over each head of q and k, and a
separate rope (its own theta, no scaling) for the sliding-window layers."""

from __future__ import annotations

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.gemma2 import SandwichDecoderLayer
from metal_engine.models.layers import MLP, Attention, OffsetRMSNorm


class Model(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        bias = cfg.attention_bias
        layers = [
            SandwichDecoderLayer(cfg, Attention(cfg, i, qkv_bias=bias, o_bias=bias,
                                                qk_norm=OffsetRMSNorm), MLP(cfg))
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(cfg, layers, norm=OffsetRMSNorm, embed_scale=cfg.hidden_size**0.5)
