"""Mistral 4 (Mistral Small 4): DeepSeek V3's layers (multi-head latent attention, experts plus
shared experts, optionally first layers dense) with two differences:

- the router scores experts with a softmax (by group where configured), no correction bias;
- past the pretraining length each query is scaled up by `1 + beta * log(1 + floor(position /
  original_max_position_embeddings))` (Llama 4's attention temperature), `beta` being the
  rope's `llama_4_scaling_beta`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kernels_metal.metadata import AttentionMetadata
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models import deepseek_v3
from metal_engine.models.mla import MlaAttention


class Mistral4Attention(MlaAttention):
    """MLA whose queries grow with their position's multiple of the pretraining length."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self._beta = cfg.rope.llama_4_scaling_beta
        self._original = cfg.rope.original_max_position_embeddings
        if self._beta is not None and not self._original:
            raise ValueError("mistral4's rope_parameters set llama_4_scaling_beta without "
                             "original_max_position_embeddings")

    def scale_queries(self, queries: mx.array, meta: AttentionMetadata) -> mx.array:
        if self._beta is None:
            return queries
        # The same for every layer of the step: made once, looked up by the others.
        key = ("llama4-query-scale", self._beta, self._original, queries.dtype)
        scale = meta.backend_plans.get(key)
        if scale is None:
            multiple = np.floor(meta.positions.astype(np.float32) / np.float32(self._original))
            rows = 1 + np.float32(self._beta) * np.log(1 + multiple)
            scale = meta.backend_plans[key] = mx.array(rows[:, None, None]).astype(queries.dtype)
        return queries * scale


class Model(deepseek_v3.Model):
    attention = Mistral4Attention
    mtp_class = None  # its checkpoints carry no multi-token-prediction layer
