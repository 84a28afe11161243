"""Llama-architecture decoder (Llama 2/3, Mistral, SmolLM) over packed tokens."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kernels_metal.attention import AttentionMetadata, paged_attention, write_kv
from kernels_metal.cpu_math import linear, silu_mul
from metal_engine.kv_cache import KVCache
from metal_engine.model_config import ModelConfig
from metal_engine.models.rope import apply_rope, inv_frequencies, rope_tables


class Linear(nn.Linear):
    """nn.Linear (same parameters) with the CPU backend's one-row fast path."""

    def __call__(self, x: mx.array) -> mx.array:
        return linear(x, self.weight, self.get("bias"))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(cfg.hidden_size, q_out, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, kv_out, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, kv_out, bias=cfg.attention_bias)
        self.o_proj = Linear(q_out, cfg.hidden_size, bias=cfg.attention_bias)

    def __call__(
        self, x: mx.array, rope: tuple[mx.array, mx.array], meta: AttentionMetadata,
        cache: KVCache, layer: int,
    ) -> mx.array:
        total = x.shape[0]
        q = self.q_proj(x).reshape(total, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(total, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(total, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k_pool, v_pool = cache.take(layer)
        k_pool, v_pool = write_kv(k_pool, k, meta), write_kv(v_pool, v, meta)
        cache.put(layer, k_pool, v_pool)
        out = paged_attention(q, k_pool, v_pool, meta, self.scale)
        return self.o_proj(out.reshape(total, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, rope, meta, cache, layer):
        h = x + self.self_attn(self.input_layernorm(x), rope, meta, cache, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self._inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta)
        # Evaluate now: a lazy array built here cannot be evaluated on the engine thread.
        mx.eval(self._inv_freq)

    def __call__(self, input_ids, positions, meta, cache):
        h = self.embed_tokens(input_ids)
        rope = rope_tables(positions, self._inv_freq)  # shared by every layer
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, meta, cache, i)
        return self.norm(h)


class Model(nn.Module):
    """`__call__` gives final hidden states for every packed row; `logits` only for chosen rows."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(self, input_ids, positions, meta, cache) -> mx.array:
        return self.model(input_ids, positions, meta, cache)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.config.tie_word_embeddings:
            return linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # Precomputed rotary tables are not parameters here; a tied head has no weight of its own.
        dropped = ["rotary_emb.inv_freq"]
        if self.config.tie_word_embeddings:
            dropped.append("lm_head.")
        return {k: v for k, v in weights.items() if not any(d in k for d in dropped)}
