"""MiniMax M2 / M2.1 (minimax_m2): grouped-query attention whose q and k are RMS-normed across
all their heads at once (one norm `heads x head_dim` wide, before the split into heads) with a
partial rope, and in every layer sigmoid-routed experts under `block_sparse_moe`, chosen with
a correction bias the block itself holds (not its router), the chosen weights renormalized."""

from __future__ import annotations

import mlx.core as mx

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.layers import Attention, Linear, RMSNorm
from metal_engine.models.mixtral import MixtralDecoderLayer
from metal_engine.models.moe import SparseMoeBlock


class CrossHeadNormAttention(Attention):
    """Attention whose q and k norms span every head: `q_norm` is `heads x head_dim` wide and
    normalizes each row's whole projection, before it is split into heads."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, eps=cfg.rms_norm_eps)

    def heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        total = x.shape[0]
        q, k, v = self.project(x)
        return (self.q_norm(q).reshape(total, self.num_heads, self.head_dim),
                self.k_norm(k).reshape(total, self.num_kv_heads, self.head_dim),
                v.reshape(total, self.num_kv_heads, self.head_dim))


class Model(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        moe, hidden = cfg.moe, cfg.hidden_size
        layers = [
            MixtralDecoderLayer(cfg, CrossHeadNormAttention(cfg, i), SparseMoeBlock(
                hidden, moe, cfg.hidden_act, Linear(hidden, moe.num_experts, bias=False),
                correction_on_block=True))
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(cfg, layers)
