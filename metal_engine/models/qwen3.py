"""Qwen3: the Llama layout with an RMSNorm over each head of q and k before rope."""

from __future__ import annotations

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.layers import MLP, Attention, PreNormDecoderLayer, RMSNorm


class Model(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        bias = cfg.attention_bias
        layers = [
            PreNormDecoderLayer(cfg, Attention(cfg, i, qkv_bias=bias, o_bias=bias,
                                               qk_norm=RMSNorm), MLP(cfg))
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(cfg, layers)
