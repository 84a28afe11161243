"""What the families' multi-token-prediction heads share (metal_engine.drafting.mtp): one
decoder layer over a projection of the next token's embedding and the model's hidden state,
its K/V in a pool of its own, then a norm; a family's head says how it projects (`_input`)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kernels_metal.metadata import AttentionMetadata
from metal_engine.cache.kv_cache import KVCache


class OneLayerHead(nn.Module):
    """Needs `layers` (its one decoder layer), `norm`, `_rope` (the layer's rotary embedding)
    and `_input(embeds, hidden)`."""

    def __call__(self, embeds: mx.array, hidden: mx.array, positions: mx.array,
                 meta: AttentionMetadata, cache: KVCache) -> mx.array:
        """The head's final hidden states at the rows (`cache`: its one pool)."""
        layer = self.layers[0]
        rope = layer.self_attn.ops.rope_step(self._rope, positions, meta)
        return self.norm(layer(self._input(embeds, hidden), rope, meta, cache, 0))

    def write_kv(self, embeds: mx.array, hidden: mx.array, positions: mx.array,
                 meta: AttentionMetadata, cache: KVCache) -> None:
        """Only the rows' K/V (or latents), written into the head's pool."""
        layer = self.layers[0]
        rope = layer.self_attn.ops.rope_step(self._rope, positions, meta)
        layer.self_attn.write_kv(layer.input_layernorm(self._input(embeds, hidden)), rope, meta,
                                 cache, 0)

    def _input(self, embeds: mx.array, hidden: mx.array) -> mx.array:
        raise NotImplementedError
