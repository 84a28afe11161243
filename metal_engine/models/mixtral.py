"""Mixtral: Mistral's attention with softmax-routed experts (top-k weights renormalized) in
every layer, under `block_sparse_moe`."""

from __future__ import annotations

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.layers import Attention, Linear, PreNormDecoderLayer
from metal_engine.models.moe import SparseMoeBlock


class MixtralDecoderLayer(PreNormDecoderLayer):
    """PreNormDecoderLayer whose feed-forward is named `block_sparse_moe`."""

    def __init__(self, cfg: ModelConfig, attention: Attention, moe: SparseMoeBlock) -> None:
        super().__init__(cfg, attention, moe)
        self.block_sparse_moe = self.pop("mlp")

    def __call__(self, x, rope, meta, cache, pool):
        h = x + self.self_attn(self.input_layernorm(x), rope, meta, cache, pool)
        return h + self.block_sparse_moe(self.post_attention_layernorm(h))


class Model(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        moe, act = cfg.moe, cfg.hidden_act
        layers = [
            MixtralDecoderLayer(cfg, Attention(cfg, i), SparseMoeBlock(
                cfg.hidden_size, moe, act, Linear(cfg.hidden_size, moe.num_experts, bias=False)))
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(cfg, layers)
