"""Layers the model families share: linear, RMS and layer norms, gated MLP, paged
self-attention.

Parameter names are Hugging Face's, so checkpoints load without renaming. Every layer computes
through `self.ops`, the backend its model was built with (models/ops_user.py). A class marked
`OPS_ONLY` does nothing to its inputs but through its ops and its `OPS_ONLY` children, so it
runs on whatever arrays its backend hands it (the CPU backend's host forward: numpy ones).

Code that runs per layer and step reads a module's parameters and children as items
(`self["weight"]`), as mlx's own layers do: an attribute of an `nn.Module` is found only
after normal lookup fails, ~1.3 us each, a few hundred times a step.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kernels_metal.metadata import AttentionMetadata
from metal_engine.cache.kv_cache import KVCache
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.ops_user import OpsUser


class Linear(nn.Linear, OpsUser):
    """nn.Linear (same parameters), computed by the model's ops; plus each row's LoRA delta
    where adapters are loaded on it and the step has adapter rows (metal_engine.lora)."""

    OPS_ONLY = True
    lora = None  # its metal_engine.lora.slots.LoraWeights, once an adapter targets it

    def __call__(self, x: mx.array) -> mx.array:
        y = self.ops.linear(x, self)
        return y if self.lora is None else self.lora.added(self.ops, x, y)

    def to_quantized(self, group_size: int | None = None, bits: int | None = None,
                     mode: str = "affine", **_: object) -> QuantizedLinear:
        return QuantizedLinear.from_linear(self, group_size, bits, mode)


class QuantizedLinear(nn.QuantizedLinear, OpsUser):
    """nn.QuantizedLinear (same parameters, MLX's quantized product) plus each row's LoRA
    delta, as `Linear` adds it."""

    lora = None

    def __call__(self, x: mx.array) -> mx.array:
        y = super().__call__(x)
        return y if self.lora is None else self.lora.added(self.ops, x, y)


class PackedLinears:
    """Linears of one input (a layer's q/k/v, gate/up) that a backend may run as one product.

    At their first packed use their weights (and biases) are packed into one buffer and become
    views of it, so packing costs no memory; they are packed again if a weight was replaced
    since. Only plain float `Linear`s of one dtype pack (`packable`): quantized ones run apart.
    """

    def __init__(self, owner: nn.Module, *names: str) -> None:
        self._owner, self._names = owner, names
        self._views: tuple[tuple[str, str, mx.array], ...] = ()  # (linear, key, packed view)
        self._weights: tuple[mx.array, mx.array | None] | None = None  # packed weight, bias
        self.columns: list[slice] = []  # each linear's columns of the packed product
        self._apart: list[nn.Module] = []  # the linears last found not to pack
        self._ends: list[int] = []  # where each linear's columns end, the last one's aside

    def linears(self) -> list[nn.Module]:
        return [self._owner[name] for name in self._names]

    def packable(self) -> bool:
        linears = self.linears()
        return (all(type(m) is Linear for m in linears)
                and len({m.weight.dtype for m in linears}) == 1
                and len({"bias" in m for m in linears}) == 1)

    def packed(self, adapters_apart: bool = True) -> tuple[mx.array, mx.array | None] | None:
        """The packed weight and bias (None if they have none), packed first if need be; None
        if the linears do not pack, or (`adapters_apart`) if one adds adapter rows' deltas
        this step: each linear then runs apart and adds its own."""
        # Current while each linear holds the view it was given; checked inline in one pass
        # (a step asks ~60 times), which also sees whether any linear carries an adapter.
        owner, current, plain = self._owner, bool(self._views), True
        for name, key, view in self._views:
            linear = owner[name]
            if linear.get(key) is not view:
                current = False
                break
            plain = plain and linear.lora is None
        if current and (plain or not adapters_apart):
            return self._weights
        if adapters_apart and self._adapted():
            return None
        if not current:
            linears = self.linears()
            apart = len(self._apart) == len(linears) and all(
                a is b for a, b in zip(self._apart, linears, strict=True))
            if apart or not self.packable():
                self._apart = linears  # asked again only once a linear was replaced
                return None
            self._pack(linears)
        return self._weights

    def _adapted(self) -> bool:
        return any(self._owner[name].lora is not None and self._owner[name].lora.active
                   for name in self._names)

    def get(self, key: str) -> mx.array | None:
        """The packed "weight" or "bias", as a `Linear` has them (the linears must pack); the
        caller adds any adapter deltas (the CPU's host layer steps do)."""
        weight, bias = self.packed(adapters_apart=False)
        return weight if key == "weight" else bias

    def split(self, y: mx.array) -> list[mx.array]:
        """The packed product `y [rows, sum of outputs]` as each linear's output."""
        return mx.split(y, self._ends, axis=-1)

    def _pack(self, linears: list[nn.Module]) -> None:
        sizes = [m.weight.shape[0] for m in linears]
        ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        packed = {}
        for key in ("weight", "bias"):
            if key in linears[0]:
                packed[key] = mx.concatenate([m[key] for m in linears])
                for m, end, size in zip(linears, ends, sizes, strict=True):
                    m[key] = packed[key][end - size : end]
        self._views = tuple((name, key, m[key]) for key in ("weight", "bias")
                            for name, m in zip(self._names, linears, strict=True) if key in m)
        mx.eval(packed, [view for _, _, view in self._views])
        self._weights = packed["weight"], packed.get("bias")
        self.columns = [slice(end - size, end) for end, size in zip(ends, sizes, strict=True)]
        self._ends = ends[:-1]


class RMSNorm(nn.RMSNorm, OpsUser):
    OPS_ONLY = True

    def __call__(self, x: mx.array) -> mx.array:
        return self.ops.rms_norm(x, self["weight"], self.eps)


class LayerNorm(nn.LayerNorm, OpsUser):
    """nn.LayerNorm (same parameters), computed by the model's ops (MLX arrays only)."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.ops.layer_norm(x, self.get("weight"), self.get("bias"), self.eps)


class UnitRMSNorm(nn.Module, OpsUser):
    """RMSNorm without a learned scale (Muse Glimmer's q/k norms): it has no parameters."""

    OPS_ONLY = True

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return self.ops.rms_norm(x, None, self.eps)


class FromWeight:
    """`derive(weight)`, made again only when the weight is replaced: derived per call, it
    is a kernel per layer per step. A plain object, so a module holding it gains no
    parameter."""

    def __init__(self, derive) -> None:
        self._derive = derive
        self._weight: mx.array | None = None
        self._value = None

    def __call__(self, weight: mx.array):
        if weight is not self._weight:
            self._weight, self._value = weight, self._derive(weight)
        return self._value


def offset_scale(weight: mx.array) -> mx.array:
    """`1 + w` of an offset norm's weight, in the weight's dtype: in float32, rounded once
    (`1 + w` in bfloat16 would round w first)."""
    return (1.0 + weight.astype(mx.float32)).astype(weight.dtype)


class OffsetRMSNorm(nn.Module, OpsUser):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (it scales by `1 + w`)."""

    OPS_ONLY = True

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps
        self._scale = FromWeight(offset_scale)

    def __call__(self, x: mx.array) -> mx.array:
        return self.ops.rms_norm(x, self._scale(self["weight"]), self.eps)


class MLP(nn.Module, OpsUser):
    """`down(act(gate(x)) * up(x))`; Phi-3 stores gate and up as one `gate_up_proj`. `inner`:
    the width when not the config's intermediate_size (a MoE's shared expert)."""

    OPS_ONLY = True

    def __init__(self, cfg: ModelConfig, bias: bool = False, fused: bool = False,
                 inner: int | None = None) -> None:
        super().__init__()
        hidden, inner = cfg.hidden_size, inner or cfg.intermediate_size
        if fused:
            self.gate_up_proj = Linear(hidden, 2 * inner, bias=bias)
        else:
            self.gate_proj = Linear(hidden, inner, bias=bias)
            self.up_proj = Linear(hidden, inner, bias=bias)
            self._gate_up = PackedLinears(self, "gate_proj", "up_proj")
        self.down_proj = Linear(inner, hidden, bias=bias)
        self.act = cfg.hidden_act

    def __call__(self, x: mx.array) -> mx.array:
        return self["down_proj"](self.ops.gated(x, self.gate_up(), self.act))

    def gate_up(self) -> Linear | PackedLinears:
        """Gate and up: the fused linear, or the two as packed linears."""
        fused = self.get("gate_up_proj")  # Phi-3's one linear; an MLP with it has no `_gate_up`
        return fused if fused is not None else self._gate_up


class Attention(nn.Module, OpsUser):
    """Self-attention of packed rows over the paged KV cache.

    Options by family: biases on q/k/v and on o, a per-head norm of q and k before rope
    (`qk_norm`: the norm class), one fused `qkv_proj` (Phi-3), a learned sink logit per head
    (`sinks`, GPT-OSS), q scaled after its norm (`query_scale`, folded into the softmax scale)
    and no rope (`rotary` false: a NoPE layer; Muse Glimmer). Window, soft-capping, scale and
    the layer's query heads come from the config.
    """

    OPS_ONLY = True

    def __init__(self, cfg: ModelConfig, layer: int, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm: type[nn.Module] | None = None,
                 fused_qkv: bool = False, sinks: bool = False, query_scale: float = 1.0,
                 rotary: bool = True) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.attention_heads(layer), cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5 * query_scale
        self.rotary = rotary
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
            self._qkv = PackedLinears(self, "q_proj", "k_proj", "v_proj")
        self.o_proj = Linear(q_out, hidden, bias=o_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, eps=cfg.rms_norm_eps)
            self.k_norm = qk_norm(self.head_dim, eps=cfg.rms_norm_eps)
        if sinks:
            self.sinks = mx.zeros((self.num_heads,))

    def qkv(self) -> Linear | PackedLinears:
        """q, k and v: the fused linear, or the three as packed linears."""
        return self.qkv_proj if "qkv_proj" in self else self._qkv

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The rows' q, k and v projections, `[total, heads x head_dim]` each."""
        if "qkv_proj" in self:  # head counts read per call: a tensor-parallel rank has fewer
            q_end = self.num_heads * self.head_dim
            k_end = q_end + self.num_kv_heads * self.head_dim
            y = self.qkv_proj(x)
            return y[..., :q_end], y[..., q_end:k_end], y[..., k_end:]
        q, k, v = self.ops.linears(x, self._qkv)
        return q, k, v

    def __call__(self, x: mx.array, rope, meta: AttentionMetadata, cache: KVCache,
                 pool: int) -> mx.array:
        """`rope`: the step's rope of this layer's kind (`Ops.rope_step`); `pool`: the KV
        pool this layer writes and attends over (ModelConfig.kv_pool)."""
        out = self.heads_out(x, rope, meta, cache, pool)
        return self["o_proj"](out.reshape(x.shape[0], self.num_heads * self.head_dim))

    def heads_out(self, x: mx.array, rope, meta: AttentionMetadata, cache: KVCache,
                  pool: int) -> mx.array:
        """Each head's output `[total, heads, head_dim]`, before o_proj."""
        q, k, v = self.heads(x)
        if self.rotary:
            q, k = self.ops.rope(q, rope), self.ops.rope(k, rope)
        return self.attend(q, k, v, meta, cache, pool)

    def heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The rows' q, k and v split into heads (`[total, heads, head_dim]`), q and k normed
        per head where the layer has q/k norms."""
        total = x.shape[0]
        q, k, v = self.project(x)
        q = q.reshape(total, self.num_heads, self.head_dim)
        k = k.reshape(total, self.num_kv_heads, self.head_dim)
        v = v.reshape(total, self.num_kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self["q_norm"](q), self["k_norm"](k)
        return q, k, v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, meta: AttentionMetadata,
               cache: KVCache, pool: int) -> mx.array:
        """`[total, heads, head_dim]` rows of q, k, v (turned by rope): k and v written into
        the layer's pool, q's rows attended over it."""
        meta = meta.for_window(self.window)  # a windowed pool's blocks may be its own
        sinks = self.get("sinks")
        k_pool, v_pool = cache.take(pool)
        try:
            out, k_pool, v_pool = self.ops.write_and_attend(
                q, k, v, k_pool, v_pool, meta, self.scale, window=self.window,
                softcap=self.softcap, sinks=None if sinks is None else sinks.astype(mx.float32))
        finally:
            cache.put(pool, k_pool, v_pool)
        return out


class PreNormDecoderLayer(nn.Module):
    """`h = x + attn(norm(x)); h + mlp(norm(h))` (Llama, Mistral, Qwen, Phi-3)."""

    OPS_ONLY = True

    def __init__(self, cfg: ModelConfig, attention: Attention, mlp: MLP) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, rope, meta, cache, pool):
        h = x + self["self_attn"](self["input_layernorm"](x), rope, meta, cache, pool)
        return h + self["mlp"](self["post_attention_layernorm"](h))

    def is_plain(self) -> bool:
        """This class exactly, a plain `Attention` (rotary, its q/k norms RMSNorms if any) and
        a SwiGLU `MLP`: a layer a backend may run as one fused step (the CPU host loops do)."""
        attention, mlp = self.self_attn, self.mlp
        return (type(self) is PreNormDecoderLayer and type(attention) is Attention
                and attention.rotary and type(mlp) is MLP and mlp.act == "silu"
                and ("q_norm" not in attention or type(attention.q_norm) is RMSNorm))
