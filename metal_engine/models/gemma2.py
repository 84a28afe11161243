"""Gemma 2: embeddings scaled by sqrt(hidden), `1 + w` RMSNorms before and after attention and
MLP, GELU-tanh MLP, soft-capped attention scores and logits, query scale from
`query_pre_attn_scalar`, and sliding-window layers alternating with global ones."""

from __future__ import annotations

import mlx.nn as nn

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.layers import MLP, Attention, OffsetRMSNorm


class SandwichDecoderLayer(nn.Module):
    """`h = x + norm(attn(norm(x))); h + norm(mlp(norm(h)))` (Gemma 2 and 3, Muse Glimmer);
    `post_norm_eps`: the eps of the norms after attention and MLP where it is their own."""

    def __init__(self, cfg: ModelConfig, attention: Attention, mlp: MLP,
                 post_norm_eps: float | None = None) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        post_eps = eps if post_norm_eps is None else post_norm_eps
        self.input_layernorm = OffsetRMSNorm(hidden, eps)
        self.post_attention_layernorm = OffsetRMSNorm(hidden, post_eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(hidden, post_eps)

    def __call__(self, x, rope, meta, cache, pool):
        attn = self.self_attn(self.input_layernorm(x), rope, meta, cache, pool)
        h = x + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Model(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        bias = cfg.attention_bias
        layers = [
            SandwichDecoderLayer(cfg, Attention(cfg, i, qkv_bias=bias, o_bias=bias), MLP(cfg))
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(cfg, layers, norm=OffsetRMSNorm, embed_scale=cfg.hidden_size**0.5)
