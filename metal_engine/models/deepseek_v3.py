"""DeepSeek V3 / R1, Kimi K2's text model (deepseek_v3) and GLM-4.7-Flash (glm4_moe_lite, the
same layers): multi-head latent attention over a latent pool (models/mla.py); sigmoid-routed
experts chosen by group with a correction bias, scaled, plus shared experts every token runs;
the first layers (or those listed dense) keep a dense MLP."""

from __future__ import annotations

import mlx.core as mx

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.glm4_moe import feed_forward
from metal_engine.models.layers import PreNormDecoderLayer
from metal_engine.models.mla import MlaAttention, rope_pairs_as_halves


class Model(CausalLM):
    attention: type[MlaAttention] = MlaAttention  # a family's variant of it (mistral4.py)

    def __init__(self, cfg: ModelConfig) -> None:
        layers = [PreNormDecoderLayer(cfg, self.attention(cfg, i), feed_forward(cfg, i))
                  for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return rope_pairs_as_halves(super().sanitize(weights), self.config)
