"""DeepSeek V3 / R1, Kimi K2's text model (deepseek_v3) and GLM-4.7-Flash (glm4_moe_lite, the
same layers): multi-head latent attention over a latent pool (models/mla.py); sigmoid-routed
experts chosen by group with a correction bias, scaled, plus shared experts every token runs;
the first layers (or those listed dense) keep a dense MLP.

Their checkpoints carry a multi-token-prediction layer after the stack (`model.layers.{N}.*`,
N = num_hidden_layers), which `metal-serve convert` keeps as `mtp.*` (convert/hf_source.py)
for speculative decoding (`MultiTokenPredictor`, metal_engine.drafting.mtp)."""

from __future__ import annotations

import mlx.core as mx

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.glm4_moe import experts, feed_forward
from metal_engine.models.layers import MLP, Linear, PreNormDecoderLayer, RMSNorm
from metal_engine.models.mla import MlaAttention, rope_pairs_as_halves
from metal_engine.models.mtp_head import OneLayerHead
from metal_engine.models.rope import RotaryEmbedding


class MultiTokenPredictor(OneLayerHead):
    """The checkpoint's multi-token-prediction layer (transformers' `MtpLayer`, under the
    names DeepSeek's layer `N` keeps, `shared_head.norm` as `norm`): from the final hidden
    state h at position p and the embedding e of the token at p + 1, one decoder layer of the
    model's kind (latent attention, experts) predicts the token at p + 2 through the model's
    own head:

        norm(layers.0(eh_proj([enorm(e), hnorm(h)])))

    Its latents are a pool of their own (see metal_engine.drafting.mtp)."""

    def __init__(self, cfg: ModelConfig, moe: bool) -> None:
        super().__init__()
        hidden, eps, index = cfg.hidden_size, cfg.rms_norm_eps, cfg.num_hidden_layers
        self.enorm = RMSNorm(hidden, eps=eps)
        self.hnorm = RMSNorm(hidden, eps=eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.layers = [PreNormDecoderLayer(cfg, MlaAttention(cfg, index),
                                           experts(cfg) if moe else MLP(cfg))]
        self.norm = RMSNorm(hidden, eps=eps)
        self._rope = RotaryEmbedding(cfg.rope_for(cfg.layer_type(0)), cfg.rope_head_dim(0),
                                     cfg.max_position_embeddings)
        self._config = cfg

    def pool_shape(self) -> tuple[int, int]:
        return self._config.kv_shape(0)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The head's weights (its own names) with the rope rows reordered as the model's."""
        return rope_pairs_as_halves(weights, self._config)

    def _input(self, embeds: mx.array, hidden: mx.array) -> mx.array:
        return self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))


class Model(CausalLM):
    attention: type[MlaAttention] = MlaAttention  # a family's variant of it (mistral4.py)
    mtp_class = MultiTokenPredictor

    def __init__(self, cfg: ModelConfig) -> None:
        layers = [PreNormDecoderLayer(cfg, self.attention(cfg, i), feed_forward(cfg, i))
                  for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return rope_pairs_as_halves(super().sanitize(weights), self.config)
