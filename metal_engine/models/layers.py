"""Layers the model families share: linear, Gemma's norm, gated MLP, paged self-attention.

Parameter names are Hugging Face's, so checkpoints load without renaming.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kernels_metal.attention import AttentionMetadata, paged_attention, write_kv
from kernels_metal.cpu_math import gelu_tanh_mul, linear, silu_mul
from metal_engine.kv_cache import KVCache
from metal_engine.model_config import ModelConfig
from metal_engine.models.rope import apply_rope

# hidden_act -> act(gate) * up
GATED_ACTIVATIONS = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}


class Linear(nn.Linear):
    """nn.Linear (same parameters) with the CPU backend's numpy fast path."""

    def __call__(self, x: mx.array) -> mx.array:
        return linear(x, self.weight, self.get("bias"))


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (it scales by `1 + w`)."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        # In float32 like transformers: `1 + w` in bfloat16 would round w away.
        scale = 1.0 + self.weight.astype(mx.float32)
        return mx.fast.rms_norm(x, scale, self.eps).astype(x.dtype)


class MLP(nn.Module):
    """`down(act(gate(x)) * up(x))`; Phi-3 stores gate and up as one `gate_up_proj`. `inner`:
    the width when not the config's intermediate_size (a MoE's shared expert)."""

    def __init__(self, cfg: ModelConfig, bias: bool = False, fused: bool = False,
                 inner: int | None = None) -> None:
        super().__init__()
        hidden, inner = cfg.hidden_size, inner or cfg.intermediate_size
        if fused:
            self.gate_up_proj = Linear(hidden, 2 * inner, bias=bias)
        else:
            self.gate_proj = Linear(hidden, inner, bias=bias)
            self.up_proj = Linear(hidden, inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)
        self._act = GATED_ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_up_proj" in self:
            gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self._act(gate, up))


class Attention(nn.Module):
    """Self-attention of packed rows over the paged KV cache.

    Options by family: biases on q/k/v and on o, a per-head norm of q and k before rope
    (`qk_norm`: the norm class), one fused `qkv_proj` (Phi-3), and a learned sink logit per
    head (`sinks`, GPT-OSS). Window, soft-capping and scale come from the config.
    """

    def __init__(self, cfg: ModelConfig, layer: int, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm: type[nn.Module] | None = None,
                 fused_qkv: bool = False, sinks: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.window = cfg.window(layer)
        self.softcap = cfg.attn_logit_softcapping
        hidden = cfg.hidden_size
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if fused_qkv:
            self.qkv_proj = Linear(hidden, q_out + 2 * kv_out, bias=qkv_bias)
        else:
            self.q_proj = Linear(hidden, q_out, bias=qkv_bias)
            self.k_proj = Linear(hidden, kv_out, bias=qkv_bias)
            self.v_proj = Linear(hidden, kv_out, bias=qkv_bias)
        self.o_proj = Linear(q_out, hidden, bias=o_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, eps=cfg.rms_norm_eps)
            self.k_norm = qk_norm(self.head_dim, eps=cfg.rms_norm_eps)
        if sinks:
            self.sinks = mx.zeros((self.num_heads,))

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if "qkv_proj" not in self:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        q, k, v = mx.split(self.qkv_proj(x), [q_out, q_out + kv_out], axis=-1)
        return q, k, v

    def __call__(
        self, x: mx.array, rope: tuple[mx.array, mx.array], meta: AttentionMetadata,
        cache: KVCache, pool: int,
    ) -> mx.array:
        """`pool`: the KV pool this layer writes and attends over (ModelConfig.kv_pool)."""
        total = x.shape[0]
        q, k, v = self._project(x)
        q = q.reshape(total, self.num_heads, self.head_dim)
        k = k.reshape(total, self.num_kv_heads, self.head_dim)
        v = v.reshape(total, self.num_kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        meta = meta.for_window(self.window)  # a windowed pool's blocks may be its own
        k_pool, v_pool = cache.take(pool)
        k_pool, v_pool = write_kv(k_pool, k, meta), write_kv(v_pool, v, meta)
        cache.put(pool, k_pool, v_pool)
        sinks = self.get("sinks")
        out = paged_attention(q, k_pool, v_pool, meta, self.scale, window=self.window,
                              softcap=self.softcap,
                              sinks=None if sinks is None else sinks.astype(mx.float32))
        return self.o_proj(out.reshape(total, -1))


class PreNormDecoderLayer(nn.Module):
    """`h = x + attn(norm(x)); h + mlp(norm(h))` (Llama, Mistral, Qwen, Phi-3)."""

    def __init__(self, cfg: ModelConfig, attention: Attention, mlp: MLP) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, rope, meta, cache, pool):
        h = x + self.self_attn(self.input_layernorm(x), rope, meta, cache, pool)
        return h + self.mlp(self.post_attention_layernorm(h))
