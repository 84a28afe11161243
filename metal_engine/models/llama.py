"""Llama (1-3, incl. Llama 3.x rope scaling) and Llama-layout models such as SmolLM."""

from __future__ import annotations

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.layers import MLP, Attention, PreNormDecoderLayer


class Model(CausalLM):
    """`attention_bias` puts biases on q, k, v and o; `mlp_bias` on the MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        bias = cfg.attention_bias
        layers = [
            PreNormDecoderLayer(cfg, Attention(cfg, i, qkv_bias=bias, o_bias=bias),
                                MLP(cfg, bias=cfg.mlp_bias))
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(cfg, layers)
