"""Gemma 4 (text): Gemma's sandwich norms and scaled embeddings, with

- attention at scale 1 over RMS-normed q, k and (unscaled) v; full-attention layers may have
  their own head size and KV heads, and attend over their keys as values (`values_are_keys`);
- the last `kv_shared_layers` layers computing no K/V: each reads the pool of the last
  earlier layer of its type;
- per-layer embeddings (PLE): every layer adds a gated projection of its slice of a second,
  per-layer embedding of the token mixed with a projection of the first;
- optionally a MoE block beside each dense MLP, routed from the layer's input;
- each layer's output scaled by a learned `layer_scalar`.

A step's image rows replace embeddings after the scale; their per-layer embeddings take the
pad token's (metal_engine.vision.gemma_text_side).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kernels_metal.metadata import AttentionMetadata
from metal_engine.cache.kv_cache import KVCache
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM, DecoderModel
from metal_engine.models.layers import MLP, Linear
from metal_engine.models.moe import SwitchGLU, route
from metal_engine.models.ops_user import OpsUser
from metal_engine.models.step_images import StepImages

PER_LAYER_INPUT_MIX = 2.0**-0.5  # (projection + embedding) of the per-layer inputs, averaged


def _unit_rms(x: mx.array, eps: float) -> mx.array:
    """RMS norm without a learned scale (Gemma 4's v norm and router norm)."""
    return mx.fast.rms_norm(x, None, eps)


class Gemma4Attention(nn.Module, OpsUser):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads, self.head_dim = cfg.kv_shape(layer)
        self.window = cfg.window(layer)
        self.eps = cfg.rms_norm_eps
        self.reads_shared_kv = cfg.kv_pool(layer) != layer
        self.values_are_keys = (cfg.gemma4.values_are_keys
                                and cfg.layer_type(layer) == "full_attention")
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(hidden, q_out, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        if not self.reads_shared_kv:
            self.k_proj = Linear(hidden, kv_out, bias=bias)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
            if not self.values_are_keys:
                self.v_proj = Linear(hidden, kv_out, bias=bias)
        self.o_proj = Linear(q_out, hidden, bias=bias)

    def __call__(self, x: mx.array, rope, meta: AttentionMetadata, cache: KVCache,
                 pool: int) -> mx.array:
        total = x.shape[0]
        q = self.q_norm(self.q_proj(x).reshape(total, self.num_heads, self.head_dim))
        q = self.ops.rope(q, rope)
        # A windowed pool's blocks may be its own; only sliding layers let an image's tokens
        # see each other (`use_bidirectional_attention: vision`), full ones stay causal.
        meta = meta.for_window(self.window) if self.window is not None else meta.causal
        if self.reads_shared_kv:
            k_pool, v_pool = cache.peek(pool)
        else:
            k = self.k_proj(x).reshape(total, self.num_kv_heads, self.head_dim)
            v = k if self.values_are_keys else self.v_proj(x).reshape(k.shape)
            k, v = self.ops.rope(self.k_norm(k), rope), _unit_rms(v, self.eps)
            k_pool, v_pool = cache.take(pool)
            k_pool, v_pool = self.ops.write_kv(k_pool, k, meta), self.ops.write_kv(v_pool, v, meta)
            cache.put(pool, k_pool, v_pool)
        out = self.ops.paged_attention(q, k_pool, v_pool, meta, 1.0, window=self.window)
        return self.o_proj(out.reshape(total, -1))


class Gemma4Router(nn.Module):
    """Scores experts from the unit-normed, per-feature scaled input; the renormalized top-k
    weights are scaled per expert."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.proj = Linear(cfg.hidden_size, cfg.moe.num_experts, bias=False)
        self.scale = mx.ones((cfg.hidden_size,))
        self.per_expert_scale = mx.ones((cfg.moe.num_experts,))
        self._moe, self._eps = cfg.moe, cfg.rms_norm_eps
        self._root = cfg.hidden_size**-0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        h = _unit_rms(x, self._eps) * self.scale * self._root
        weights, experts = route(self.proj(h), self._moe)
        return weights * self.per_expert_scale[experts].astype(mx.float32), experts


class Gemma4DecoderLayer(nn.Module, OpsUser):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        options = cfg.gemma4
        self.self_attn = Gemma4Attention(cfg, layer)
        wide = options.double_wide_mlp and self.self_attn.reads_shared_kv
        self.mlp = MLP(cfg, inner=cfg.intermediate_size * (2 if wide else 1))
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, nn.RMSNorm(hidden, eps=eps))
        if cfg.moe is not None:
            self.router = Gemma4Router(cfg)
            self.experts = SwitchGLU(hidden, cfg.moe.expert_intermediate_size,
                                     cfg.moe.num_experts, cfg.hidden_act)
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                         "pre_feedforward_layernorm_2"):
                setattr(self, name, nn.RMSNorm(hidden, eps=eps))
        if options.per_layer_input_size:
            size = options.per_layer_input_size
            self.per_layer_input_gate = Linear(hidden, size, bias=False)
            self.per_layer_projection = Linear(size, hidden, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(hidden, eps=eps)
            self.act = cfg.hidden_act
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x, rope, meta, cache, pool, per_layer_input=None):
        attn = self.self_attn(self.input_layernorm(x), rope, meta, cache, pool)
        h = x + self.post_attention_layernorm(attn)
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if "router" in self:
            weights, experts = self.router(h)
            moe = self.experts.mix(self.pre_feedforward_layernorm_2(h), weights, experts)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(moe)
        h = h + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            # act(gate) * input, with a gated activation's (gate, up) form
            gated = self.ops.activation(self.act, self.per_layer_input_gate(h), per_layer_input)
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar.astype(h.dtype)


class Gemma4Decoder(DecoderModel):
    """DecoderModel plus the per-layer inputs each layer adds."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], norm: type[nn.Module],
                 embed_scale: float | None) -> None:
        super().__init__(cfg, layers, norm, embed_scale)
        size, layers_n = cfg.gemma4.per_layer_input_size, cfg.num_hidden_layers
        self._per_layer = size
        self._pad_token_id = cfg.gemma4.pad_token_id
        if size:
            self.embed_tokens_per_layer = nn.Embedding(cfg.gemma4.per_layer_vocab_size,
                                                       layers_n * size)
            self.per_layer_model_projection = Linear(cfg.hidden_size, layers_n * size,
                                                     bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(size, eps=cfg.rms_norm_eps)

    def __call__(self, input_ids: mx.array, positions: mx.array, meta: AttentionMetadata,
                 cache: KVCache, images: StepImages | None = None) -> mx.array:
        h = self.embed(input_ids)
        if images is not None:  # the tower's rows after the embedding scale
            h = images.placed(h)
            input_ids = self._image_rows_padded(input_ids, images)
        per_layer = self._per_layer_inputs(input_ids, h)
        ropes = self.ops.layer_ropes(self.ropes, positions, meta)
        for i, (layer, rope, pool) in enumerate(zip(self.layers, ropes, self.pools,
                                                    strict=True)):
            h = layer(h, rope, meta, cache, pool,
                      None if per_layer is None else per_layer[:, i])
        return self.norm(h)

    def _image_rows_padded(self, input_ids: mx.array, images: StepImages) -> mx.array:
        """The ids the per-layer embeddings look up: the pad token at image rows (their
        projection part reads the image rows themselves)."""
        if not self._per_layer:
            return input_ids
        ids = mx.array(input_ids)  # the caller's ids stay as they are
        ids[images.rows] = self._pad_token_id
        return ids

    def _per_layer_inputs(self, input_ids: mx.array, h: mx.array) -> mx.array | None:
        """`[rows, layers, size]`: a projection of the embedding, normed, mixed with the token's
        per-layer embedding."""
        if not self._per_layer:
            return None
        rows, size = input_ids.shape[0], self._per_layer
        own = self.embed_tokens_per_layer(input_ids)
        own = (own * mx.array(size**0.5, dtype=own.dtype)).reshape(rows, -1, size)
        projected = self.per_layer_model_projection(h) * (h.shape[-1] ** -0.5)
        projected = self.per_layer_projection_norm(projected.reshape(rows, -1, size))
        return (projected + own) * PER_LAYER_INPUT_MIX


class Model(CausalLM):
    decoder_class = Gemma4Decoder

    def __init__(self, cfg: ModelConfig) -> None:
        layers = [Gemma4DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers, norm=nn.RMSNorm, embed_scale=cfg.hidden_size**0.5)
