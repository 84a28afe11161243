"""The decoder stack and causal-LM head every family builds on.

A family's `Model` passes its layers and norm class; this module embeds the packed tokens
(image rows taking their vision features where a step has images: models/step_images.py),
has its ops backend run the layers (each step's rope built once per distinct rope, e.g.
Gemma 3's local and global) and computes logits for the rows that need them.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kernels_metal.backends import device_ops_name
from kernels_metal.metadata import AttentionMetadata
from metal_engine.cache.kv_cache import KVCache
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.layers import Linear, RMSNorm
from metal_engine.models.ops_user import OpsModel, OpsUser
from metal_engine.models.rope import LayerRopes
from metal_engine.models.step_images import StepImages

# Source checkpoints may hold these; they are derived from the config, not parameters here.
DERIVED_WEIGHTS = ("rotary_emb.inv_freq",)


class DecoderModel(nn.Module, OpsUser):
    """Embedding, decoder layers and final norm (the `model.*` weights)."""

    adapters = None  # the LoRA adapters loaded over it (metal_engine.lora.slots.AdapterSlots)

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], norm: type[nn.Module],
                 embed_scale: float | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = layers
        self.norm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self._embed_scale = embed_scale  # Gemma: sqrt(hidden_size)
        self._ropes = LayerRopes(cfg)
        self._pools = [cfg.cache_index(i) for i in range(cfg.num_hidden_layers)]

    @property
    def ropes(self) -> LayerRopes:
        """Each layer's rope kind."""
        return self._ropes

    @property
    def pools(self) -> list[int]:
        """Each layer's K/V pool (`ModelConfig.cache_index`)."""
        return self._pools

    def __call__(self, input_ids: mx.array, positions: mx.array, meta: AttentionMetadata,
                 cache: KVCache, images: StepImages | None = None) -> mx.array:
        h = self.embed(input_ids)
        if images is not None:
            h = images.placed(h)
        h = self.run_layers(h, positions, meta, cache, range(len(self.layers)), images)
        return self.norm(h)

    def run_layers(self, h: mx.array, positions: mx.array, meta: AttentionMetadata,
                   cache: KVCache, layers: range, images: StepImages | None = None) -> mx.array:
        """Layers `layers` over hidden states `h` (a pipeline stage runs its own), as the
        model's ops backend runs them; `images`' deepstack features added after their
        layers."""
        if images is None or not images.deepstack:
            return self.ops.run_layers(self, h, positions, meta, cache, layers)
        for stretch in images.stretches(layers):
            h = self.ops.run_layers(self, h, positions, meta, cache, stretch)
            h = images.after_layer(stretch.stop - 1, h)
        return h

    def embed(self, input_ids: mx.array) -> mx.array:
        h = self.embed_tokens(input_ids)
        if self._embed_scale is not None:
            h = h * mx.array(self._embed_scale, dtype=h.dtype)  # rounded as transformers does
        return h


class CausalLM(OpsModel):
    """`__call__` gives final hidden states for every packed row; `logits` only for chosen rows."""

    decoder_class: type[DecoderModel] = DecoderModel
    # The family's multi-token-prediction head (`mtp.*` weights), if it has one.
    mtp_class: type[nn.Module] | None = None

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module],
                 norm: type[nn.Module] = RMSNorm, embed_scale: float | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.decoder_class(cfg, layers, norm, embed_scale)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.use_ops(device_ops_name())

    def __call__(self, input_ids: mx.array, positions: mx.array, meta: AttentionMetadata,
                 cache: KVCache, images: StepImages | None = None) -> mx.array:
        """Final hidden states of the packed rows. `positions`: `[total_q]`, or `[3, total_q]`
        (time, height, width) for a multimodal-rope step with image rows; `images`: the
        step's image rows and their features (None: a text-only step, today's graph)."""
        return self.model(input_ids, positions, meta, cache, images)

    @property
    def has_head(self) -> bool:
        """Whether it can compute logits: an embedding model's checkpoint may have no head."""
        return self.config.tie_word_embeddings or "lm_head" in self

    def drop_head(self) -> None:
        """Go without the LM head (a checkpoint without one): it pools, it never samples."""
        self.pop("lm_head", None)

    def logits(self, hidden: mx.array) -> mx.array:
        return self.capped(self.head(hidden))

    def head(self, hidden: mx.array) -> mx.array:
        """The LM head's product: `lm_head`, or the tied embedding's."""
        embed = self.model.embed_tokens
        if not self.config.tie_word_embeddings:
            return self.lm_head(hidden)
        if isinstance(embed, nn.QuantizedEmbedding):  # its weight is packed
            return embed.as_linear(hidden)
        return self.ops.linear(hidden, embed)

    def capped(self, logits: mx.array) -> mx.array:
        """`logits` soft-capped where the config says."""
        cap = self.config.final_logit_softcapping
        return logits if cap is None else self.ops.softcap(logits, cap)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop source tensors that are not parameters here (a tied head has no weight)."""
        dropped = DERIVED_WEIGHTS + (("lm_head.",) if self.config.tie_word_embeddings else ())
        return {k: v for k, v in weights.items() if not any(d in k for d in dropped)}
