"""Mistral: the Llama layout without biases, with a sliding window on every layer when the
config sets one (ModelConfig marks the layers)."""

from __future__ import annotations

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.layers import MLP, Attention, PreNormDecoderLayer


class Model(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        layers = [PreNormDecoderLayer(cfg, Attention(cfg, i), MLP(cfg))
                  for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers)
