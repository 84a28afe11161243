"""Qwen3.5 (text), Qwen3.5-MoE and Qwen3-Next: Gated DeltaNet layers (linear attention with a
per-request recurrent state, see gated_delta.py) interleaved with gated full-attention layers:
q and a per-feature output gate come from one projection, q and k are RMS-normed per head, a
quarter of each head rotates, and the output is scaled by sigmoid(gate). Every norm scales by
`1 + w`. The MoE variants' MLPs are experts plus a shared expert scaled by its own sigmoid
gate (Qwen3-Next may keep dense MLPs in some layers). Parameters and children are read as
items per call (models/layers.py says why)."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from kernels_metal.metadata import AttentionMetadata
from metal_engine.cache.kv_cache import KVCache
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.gated_delta import GatedDeltaNet
from metal_engine.models.layers import MLP, Linear, OffsetRMSNorm, PackedLinears
from metal_engine.models.moe import SwitchGLU, route
from metal_engine.models.mtp_head import OneLayerHead
from metal_engine.models.ops_user import OpsUser
from metal_engine.models.rope import RotaryEmbedding


@partial(mx.compile, shapeless=True)
def _sigmoid_gated(out: mx.array, gate: mx.array) -> mx.array:
    return out * mx.sigmoid(gate)


class GatedAttention(nn.Module, OpsUser):
    """q, k, v as one product where the backend packs them (q and its gate are one output)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, bias = cfg.head_dim, cfg.attention_bias
        hidden, q_out = cfg.hidden_size, self.num_heads * self.head_dim
        self.q_proj = Linear(hidden, 2 * q_out, bias=bias)  # q and the gate, per head
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(q_out, hidden, bias=bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self._qkv = PackedLinears(self, "q_proj", "k_proj", "v_proj")

    def __call__(self, x: mx.array, rope, meta: AttentionMetadata, cache: KVCache,
                 pool: int) -> mx.array:
        total = x.shape[0]
        q, k, v = self.ops.linears(x, self._qkv)
        q, gate = mx.split(q.reshape(total, self.num_heads, 2 * self.head_dim), 2, axis=-1)
        q = self.ops.rope(self["q_norm"](q), rope)
        k_pool, v_pool = self._write(k, v, rope, meta, cache, pool)
        out = self.ops.paged_attention(q, k_pool, v_pool, meta, self.head_dim**-0.5)
        return self["o_proj"](_sigmoid_gated(out, gate).reshape(total, -1))

    def write_kv(self, x: mx.array, rope, meta: AttentionMetadata, cache: KVCache,
                 pool: int) -> tuple[mx.array, mx.array]:
        """Write the rows' K and V into pool `pool`; return the pool pair."""
        return self._write(self.k_proj(x), self.v_proj(x), rope, meta, cache, pool)

    def _write(self, k: mx.array, v: mx.array, rope, meta: AttentionMetadata, cache: KVCache,
               pool: int) -> tuple[mx.array, mx.array]:
        total = k.shape[0]
        k = self["k_norm"](k.reshape(total, self.num_kv_heads, self.head_dim))
        k = self.ops.rope(k, rope)
        v = v.reshape(total, self.num_kv_heads, self.head_dim)
        k_pool, v_pool = cache.take(pool)
        k_pool, v_pool = self.ops.write_kv(k_pool, k, meta), self.ops.write_kv(v_pool, v, meta)
        cache.put(pool, k_pool, v_pool)
        return k_pool, v_pool


def linear_attention(net: GatedDeltaNet, x: mx.array, meta: AttentionMetadata, cache: KVCache,
                     index: int) -> mx.array:
    """`net` over the step's rows, its states read from and written back to the requests'
    slots of state pool `index` (see metal_engine.cache.recurrent_states)."""
    states = cache.states
    conv, recurrent = states.take(index)
    slots, keep = states.step_slots, states.step_keep
    conv_in, recurrent_in = conv[slots], recurrent[slots]
    if _fresh_requests(meta):  # a request fed from position 0 starts from zeros
        conv_in = conv_in * keep[:, None, None]
        recurrent_in = recurrent_in * keep[:, None, None, None]
    step = net(x, meta.cu_seqlens_q, conv_in, recurrent_in)
    conv[slots] = step.conv_state.astype(conv.dtype)
    recurrent[slots] = step.recurrent_state
    states.put(index, conv, recurrent)
    return step.out


def _fresh_requests(meta: AttentionMetadata) -> bool:
    """Whether a request of the step is fed from position 0 (host metadata, no sync; asked
    once per step)."""
    fresh = meta.backend_plans.get("fresh requests")
    if fresh is None:  # all its keys are its rows: in plain ints, cheaper than numpy's ops
        cu = meta.cu_seqlens_q.tolist()
        fresh = meta.backend_plans["fresh requests"] = any(
            seq_len == end - start
            for seq_len, start, end in zip(meta.seq_lens.tolist(), cu[:-1], cu[1:], strict=True))
    return fresh


class GatedSharedMoe(nn.Module):
    """Experts (softmax top-k, renormalized) plus a shared expert scaled by
    sigmoid(shared_expert_gate(x)), under Qwen's names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe, hidden = cfg.moe, cfg.hidden_size
        self.gate = Linear(hidden, moe.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(hidden, moe.expert_intermediate_size, moe.num_experts,
                                    cfg.hidden_act)
        self.shared_expert = MLP(cfg, inner=moe.shared_intermediate_size)
        self.shared_expert_gate = Linear(hidden, 1, bias=False)
        self._moe = moe

    def __call__(self, x: mx.array) -> mx.array:
        weights, experts = route(self["gate"](x), self._moe)
        shared = mx.sigmoid(self["shared_expert_gate"](x)) * self["shared_expert"](x)
        return self["switch_mlp"].mix(x, weights, experts) + shared


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: bool, moe: bool) -> None:
        """`linear`: Gated DeltaNet in place of attention; `moe`: experts in place of an MLP."""
        super().__init__()
        if linear:
            self.linear_attn = GatedDeltaNet(cfg.linear_attention)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = GatedSharedMoe(cfg) if moe else MLP(cfg)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x, rope, meta, cache, pool):
        h = self["input_layernorm"](x)
        if "linear_attn" in self:
            h = linear_attention(self["linear_attn"], h, meta, cache, pool)
        else:
            h = self["self_attn"](h, rope, meta, cache, pool)
        h = x + h
        return h + self["mlp"](self["post_attention_layernorm"](h))


class MultiTokenPredictor(OneLayerHead):
    """The checkpoint's multi-token-prediction head (`mtp.*`, as vLLM's Qwen3.5 and Qwen3-Next
    MTP models read it): from the final hidden state h at position p and the embedding e of
    the token at p + 1, one full-attention decoder layer predicts the token at p + 2 through
    the model's own head:

        norm(layer(fc([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)])))

    Its K/V are a pool of their own (see metal_engine.drafting.mtp)."""

    def __init__(self, cfg: ModelConfig, moe: bool) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = OffsetRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(hidden, eps)
        self.layers = [DecoderLayer(cfg, linear=False, moe=moe)]
        self.norm = OffsetRMSNorm(hidden, eps)
        self._rope = RotaryEmbedding(cfg.rope_for("full_attention"), cfg.head_dim,
                                     cfg.max_position_embeddings)

    def pool_shape(self) -> tuple[int, int]:
        attention = self.layers[0].self_attn
        return attention.num_kv_heads, attention.head_dim

    def _input(self, embeds: mx.array, hidden: mx.array) -> mx.array:
        return self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeds),
                                       self.pre_fc_norm_hidden(hidden)], axis=-1))


class Model(CausalLM):
    mtp_class = MultiTokenPredictor

    def __init__(self, cfg: ModelConfig) -> None:
        layers = [DecoderLayer(cfg, cfg.layer_type(i) == "linear_attention",
                               cfg.moe is not None and cfg.moe.is_moe_layer(i))
                  for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers, norm=OffsetRMSNorm)
