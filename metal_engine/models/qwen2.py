"""Qwen2 / Qwen2.5: the Llama layout with biases on q, k and v (never on o or the MLP)."""

from __future__ import annotations

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.layers import MLP, Attention, PreNormDecoderLayer


class Model(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        layers = [PreNormDecoderLayer(cfg, Attention(cfg, i, qkv_bias=True), MLP(cfg))
                  for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers)
