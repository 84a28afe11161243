"""Attention whose heads' output is gated before o_proj by a projection of the layer's input:
`out * act(gate(x))`, one gate value per head (broadcast over its features) or one per feature.
Laguna gates with the softplus of `g_proj` (taken in float32), Muse Glimmer with the sigmoid
of `gate_proj`; the projection keeps the family's name so checkpoints load unrenamed."""

from __future__ import annotations

from typing import Literal

import mlx.core as mx
import mlx.nn as nn

from kernels_metal.metadata import AttentionMetadata
from metal_engine.cache.kv_cache import KVCache
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.layers import Attention, Linear

GateActivation = Literal["softplus", "sigmoid"]


def _softplus(gate: mx.array) -> mx.array:
    return nn.softplus(gate.astype(mx.float32)).astype(gate.dtype)


_ACTIVATIONS = {"softplus": _softplus, "sigmoid": mx.sigmoid}


class OutputGatedAttention(Attention):
    """`Attention` (with the options it is given) and an output gate named `gate_name`. Its
    gate computes on MLX arrays, so the CPU backend runs its layers on MLX (not OPS_ONLY)."""

    OPS_ONLY = False

    def __init__(self, cfg: ModelConfig, layer: int, gate_name: str,
                 activation: GateActivation, per_head: bool, **options) -> None:
        super().__init__(cfg, layer, **options)
        width = self.num_heads if per_head else self.num_heads * self.head_dim
        setattr(self, gate_name, Linear(cfg.hidden_size, width, bias=False))
        self._gate_name, self._activation = gate_name, _ACTIVATIONS[activation]
        self._gate_width = 1 if per_head else self.head_dim

    def __call__(self, x: mx.array, rope, meta: AttentionMetadata, cache: KVCache,
                 pool: int) -> mx.array:
        total = x.shape[0]
        out = self.heads_out(x, rope, meta, cache, pool)
        gate = self[self._gate_name](x).reshape(total, self.num_heads, self._gate_width)
        return self.o_proj((out * self._activation(gate)).reshape(total, -1))
