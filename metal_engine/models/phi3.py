"""Phi-3 / Phi-3.5 / Phi-4-mini: one fused `qkv_proj` and one fused `gate_up_proj` per layer,
partial rotary and LongRoPE where the config asks for them."""

from __future__ import annotations

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.layers import MLP, Attention, PreNormDecoderLayer


class Model(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        layers = [PreNormDecoderLayer(cfg, Attention(cfg, i, fused_qkv=True), MLP(cfg, fused=True))
                  for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers)
