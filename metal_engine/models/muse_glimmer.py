"""Muse Glimmer's text model (muse_glimmer_text; Meta): Gemma's sandwich of `1 + w` norms
around attention and MLP (the post norms with their own eps), token embeddings RMS-normed
without a scale, and attention over scaleless-normed q and k, q scaled after its norm, an
output gated per feature by the sigmoid of `gate_proj`, sliding layers beside full ones whose
attention has no rope (NoPE); the logits multiplied by `output_multiplier`, then soft-capped.
Only text: the multimodal checkpoint's vision tower is left out at conversion."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM, DecoderModel
from metal_engine.models.gemma2 import SandwichDecoderLayer
from metal_engine.models.layers import MLP, UnitRMSNorm
from metal_engine.models.output_gate import OutputGatedAttention


class NormedEmbeddingDecoder(DecoderModel):
    """The decoder whose token embeddings are RMS-normed (no learned scale) before the first
    layer."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], norm: type[nn.Module],
                 embed_scale: float | None) -> None:
        super().__init__(cfg, layers, norm, embed_scale)
        self._embed_eps = cfg.rms_norm_eps

    def embed(self, input_ids: mx.array) -> mx.array:
        return self.ops.rms_norm(super().embed(input_ids), None, self._embed_eps)


class Model(CausalLM):
    decoder_class = NormedEmbeddingDecoder

    def __init__(self, cfg: ModelConfig) -> None:
        muse, bias = cfg.muse_glimmer, cfg.attention_bias
        layers = [
            SandwichDecoderLayer(cfg, OutputGatedAttention(
                cfg, i, "gate_proj", "sigmoid", per_head=cfg.output_gate == "per-head",
                qkv_bias=bias, o_bias=bias, qk_norm=UnitRMSNorm,
                query_scale=muse.qk_scale_factor, rotary=muse.rotary(i)),
                MLP(cfg), post_norm_eps=muse.post_norm_eps)
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(cfg, layers)

    def logits(self, hidden: mx.array) -> mx.array:
        return self.capped(self.head(hidden) * self.config.muse_glimmer.output_multiplier)
