"""Layers the model families share: linear, RMSNorms, gated MLP, paged self-attention.

Parameter names are Hugging Face's, so checkpoints load without renaming. Each of these takes
MLX arrays, or numpy ones in the CPU backend's host forward (`HOST_ARRAYS`, models/host.py),
and returns the kind it gets.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kernels_metal import cpu_layer
from kernels_metal.attention import AttentionMetadata, write_and_attend
from kernels_metal.cpu_math import (
    TILED_ROWS,
    array_module,
    gelu_tanh_mul,
    host_linear,
    linear,
    rms_norm,
    silu_mul,
    silu_mul_halves,
)
from metal_engine.kv_cache import KVCache
from metal_engine.model_config import ModelConfig
from metal_engine.models.rope import apply_rope

# hidden_act -> act(gate) * up
GATED_ACTIVATIONS = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}
# hidden_act -> the same of a packed [rows, 2 * inner] host product, where there is one
HOST_PACKED_ACTIVATIONS = {"silu": silu_mul_halves}


class HostViews:
    """Numpy views of a module's `weight` and `bias` for the host forward, made again when
    either was replaced: viewing an MLX array costs ~2.5 us, a few hundred times a step."""

    def __init__(self) -> None:
        self._arrays: tuple[mx.array | None, mx.array | None] = (None, None)
        self._views: tuple[np.ndarray | None, np.ndarray | None] = (None, None)

    def __call__(self, owner: nn.Module) -> tuple[np.ndarray, np.ndarray | None]:
        weight, bias = owner.get("weight"), owner.get("bias")
        if weight is not self._arrays[0] or bias is not self._arrays[1]:
            self._arrays = weight, bias
            self._views = tuple(None if a is None else np.asarray(a) for a in self._arrays)
        return self._views


class Linear(nn.Linear):
    """nn.Linear (same parameters) with the CPU backend's numpy fast path."""

    HOST_ARRAYS = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._host = HostViews()

    def __call__(self, x: mx.array) -> mx.array:
        if isinstance(x, np.ndarray):
            return host_linear(x, *self.host_arrays())
        return linear(x, self.weight, self.get("bias"))

    def host_arrays(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Numpy views of the weight and bias (None if it has none)."""
        return self._host(self)


class PackedLinears:
    """Linears of one input as one product on the host (a layer's q/k/v, gate/up).

    At their first product their weights (and biases) are packed into one buffer and become
    views of it, so packing costs no memory; one product streams the weights faster than a
    product each (each BLAS call costs ~25 us of thread hand-offs at one row). They are
    packed again if a weight was replaced since.
    """

    def __init__(self, *names: str) -> None:
        self._names = names
        self._views: tuple[tuple[str, str, mx.array], ...] = ()  # (linear, key, packed view)
        self._weight = self._bias = None
        self._columns: list[slice] = []

    def __call__(self, owner: nn.Module, x: np.ndarray) -> list[np.ndarray]:
        y = self.product(owner, x)
        return [y[:, columns] for columns in self._columns]

    def product(self, owner: nn.Module, x: np.ndarray) -> np.ndarray:
        """The packed product `[rows, sum of the linears' outputs]`, in their order."""
        return host_linear(x, *self.arrays(owner))

    def arrays(self, owner: nn.Module) -> tuple[np.ndarray, np.ndarray | None]:
        """The packed weight and bias (None if they have none), packed first if need be."""
        # Packed again if a linear no longer holds the view it was given; checked inline, a
        # step asks ~60 times.
        current = bool(self._views)
        for name, key, view in self._views:
            if owner[name].get(key) is not view:
                current = False
                break
        if not current:
            self._pack([owner[name] for name in self._names])
        return self._weight, self._bias

    def _parameters(self, linears: list[Linear]) -> list[tuple[str, str, mx.array]]:
        return [(name, key, m[key]) for key in ("weight", "bias")
                for name, m in zip(self._names, linears, strict=True) if key in m]

    def _pack(self, linears: list[Linear]) -> None:
        sizes = [m.weight.shape[0] for m in linears]
        ends = np.cumsum(sizes).tolist()
        packed = {}
        for key in ("weight", "bias"):
            if key in linears[0]:
                packed[key] = mx.concatenate([m[key] for m in linears])
                for m, end, size in zip(linears, ends, sizes, strict=True):
                    m[key] = packed[key][end - size : end]
        self._views = tuple(self._parameters(linears))
        mx.eval(packed, [view for _, _, view in self._views])
        self._weight = np.asarray(packed["weight"])
        self._bias = np.asarray(packed["bias"]) if "bias" in packed else None
        self._columns = [slice(end - size, end) for end, size in zip(ends, sizes, strict=True)]


class RMSNorm(nn.RMSNorm):
    HOST_ARRAYS = True

    def __init__(self, dims: int, eps: float = 1e-5) -> None:
        super().__init__(dims, eps)
        self._host = HostViews()

    def __call__(self, x: mx.array) -> mx.array:
        if isinstance(x, np.ndarray):
            return rms_norm(x, self.host_weight(), self.eps)
        return rms_norm(x, self.weight, self.eps)

    def host_weight(self) -> np.ndarray:
        return self._host(self)[0]


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (it scales by `1 + w`)."""

    HOST_ARRAYS = True

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        # In float32 like transformers: `1 + w` in bfloat16 would round w away.
        scale = 1.0 + self.weight.astype(mx.float32)
        return rms_norm(x, scale, self.eps).astype(x.dtype)


class MLP(nn.Module):
    """`down(act(gate(x)) * up(x))`; Phi-3 stores gate and up as one `gate_up_proj`. `inner`:
    the width when not the config's intermediate_size (a MoE's shared expert)."""

    HOST_ARRAYS = True

    def __init__(self, cfg: ModelConfig, bias: bool = False, fused: bool = False,
                 inner: int | None = None) -> None:
        super().__init__()
        hidden, inner = cfg.hidden_size, inner or cfg.intermediate_size
        if fused:
            self.gate_up_proj = Linear(hidden, 2 * inner, bias=bias)
        else:
            self.gate_proj = Linear(hidden, inner, bias=bias)
            self.up_proj = Linear(hidden, inner, bias=bias)
            self._gate_up = PackedLinears("gate_proj", "up_proj")
        self.down_proj = Linear(inner, hidden, bias=bias)
        self._act = GATED_ACTIVATIONS[cfg.hidden_act]
        self._act_halves = HOST_PACKED_ACTIVATIONS.get(cfg.hidden_act)
        self.silu_gated = cfg.hidden_act == "silu"

    def __call__(self, x: mx.array) -> mx.array:
        fused = "gate_up_proj" in self
        if isinstance(x, np.ndarray) and self._act_halves is not None:
            # gate and up of host rows as one packed product [rows, 2 * inner]
            gate_up = self.gate_up_proj(x) if fused else self._gate_up.product(self, x)
            return self.down_proj(self._act_halves(gate_up))
        if fused:
            gate, up = array_module(x).split(self.gate_up_proj(x), 2, axis=-1)
        elif isinstance(x, np.ndarray):
            gate, up = self._gate_up(self, x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self._act(gate, up))

    def host_gate_up(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The gate and up weights packed as one (gate first), and their bias."""
        if "gate_up_proj" in self:
            return self.gate_up_proj.host_arrays()
        return self._gate_up.arrays(self)


class Attention(nn.Module):
    """Self-attention of packed rows over the paged KV cache.

    Options by family: biases on q/k/v and on o, a per-head norm of q and k before rope
    (`qk_norm`: the norm class), one fused `qkv_proj` (Phi-3), and a learned sink logit per
    head (`sinks`, GPT-OSS). Window, soft-capping and scale come from the config.
    """

    HOST_ARRAYS = True

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
            self._qkv = PackedLinears("q_proj", "k_proj", "v_proj")
        self.o_proj = Linear(q_out, hidden, bias=o_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, eps=cfg.rms_norm_eps)
            self.k_norm = qk_norm(self.head_dim, eps=cfg.rms_norm_eps)
        if sinks:
            self.sinks = mx.zeros((self.num_heads,))

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if "qkv_proj" not in self:
            if isinstance(x, np.ndarray):
                q, k, v = self._qkv(self, x)
                return q, k, v
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        q, k, v = array_module(x).split(self.qkv_proj(x), [q_out, q_out + kv_out], axis=-1)
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
        out = self.attend(q, k, v, meta, cache, pool)
        return self.o_proj(out.reshape(total, self.num_heads * self.head_dim))

    def attend(self, q: mx.array, k: mx.array, v: mx.array, meta: AttentionMetadata,
               cache: KVCache, pool: int) -> mx.array:
        """`[total, heads, head_dim]` rows of q, k, v (turned by rope): k and v written into
        the layer's pool, q's rows attended over it."""
        meta = meta.for_window(self.window)  # a windowed pool's blocks may be its own
        sinks = self.get("sinks")
        k_pool, v_pool = cache.take(pool)
        try:
            out, k_pool, v_pool = write_and_attend(
                q, k, v, k_pool, v_pool, meta, self.scale, window=self.window,
                softcap=self.softcap, sinks=None if sinks is None else sinks.astype(mx.float32))
        finally:
            cache.put(pool, k_pool, v_pool)
        return out

    def host_qkv(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The q, k and v weights packed as one (in that order), and their bias."""
        if "qkv_proj" in self:
            return self.qkv_proj.host_arrays()
        return self._qkv.arrays(self)


class PreNormDecoderLayer(nn.Module):
    """`h = x + attn(norm(x)); h + mlp(norm(h))` (Llama, Mistral, Qwen, Phi-3)."""

    HOST_ARRAYS = True

    def __init__(self, cfg: ModelConfig, attention: Attention, mlp: MLP) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self._host_arrays = HostStepArrays()

    def __call__(self, x, rope, meta, cache, pool):
        if isinstance(x, np.ndarray) and len(x) < TILED_ROWS and self._host_steps():
            return self._host_step(x, rope, meta, cache, pool)
        h = x + self.self_attn(self.input_layernorm(x), rope, meta, cache, pool)
        return h + self.mlp(self.post_attention_layernorm(h))

    def _host_steps(self) -> bool:
        """Whether host rows take `_host_step`: a plain attention (its q/k norms, if any,
        RMSNorms) and a SwiGLU MLP."""
        attention, mlp = self.self_attn, self.mlp
        return (type(attention) is Attention and type(mlp) is MLP and mlp.silu_gated
                and ("q_norm" not in attention or type(attention.q_norm) is RMSNorm))

    def _host_step(self, x, rope, meta, cache, pool):
        """The layer in two compiled calls around its attention (kernels_metal/cpu_layer)."""
        arrays = self._host_arrays(self)
        cos, sin = rope
        half = cos.shape[-1]
        q, k, v = cpu_layer.attention_inputs(x, arrays, (cos.reshape(-1, half),
                                                         sin.reshape(-1, half)))
        out = self.self_attn.attend(q, k, v, meta, cache, pool)
        return cpu_layer.after_attention(x, out.reshape(len(x), -1), arrays)

    def host_arrays(self) -> cpu_layer.LayerArrays | None:
        """What its compiled host steps take (None: it has none): numpy views of its
        parameters, gathered again once one changed."""
        return self._host_arrays(self) if self._host_steps() else None

    def gather_host_arrays(self) -> cpu_layer.LayerArrays:
        attention, mlp = self.self_attn, self.mlp
        qk_norms = None
        if "q_norm" in attention:
            qk_norms = (attention.q_norm.host_weight(), attention.k_norm.host_weight(),
                        attention.q_norm.eps)
        return cpu_layer.LayerArrays(
            input_norm=(self.input_layernorm.host_weight(), self.input_layernorm.eps),
            qkv=attention.host_qkv(), qk_norms=qk_norms,
            shape=(attention.num_heads, attention.num_kv_heads, attention.head_dim),
            o=attention.o_proj.host_arrays(),
            post_norm=(self.post_attention_layernorm.host_weight(),
                       self.post_attention_layernorm.eps),
            gate_up=mlp.host_gate_up(), down=mlp.down_proj.host_arrays(),
            attention=(attention.scale, attention.softcap, attention.window,
                       "sinks" in attention))


class HostStepArrays:
    """A layer's cpu_layer.LayerArrays, gathered again when a parameter or module in it was replaced
    (new weights, q/k/v packed anew, a new linear): gathering them cost ~35 us a layer at
    every step, checking them ~3."""

    def __init__(self) -> None:
        self._sources: tuple[tuple[nn.Module, str, mx.array | nn.Module], ...] = ()
        self._arrays: cpu_layer.LayerArrays | None = None

    def __call__(self, layer: PreNormDecoderLayer) -> cpu_layer.LayerArrays:
        for module, key, held in self._sources:
            if module.get(key) is not held:
                break
        else:
            if self._arrays is not None:
                return self._arrays
        self._arrays = layer.gather_host_arrays()  # packs first: q/k/v become views
        self._sources = tuple((module, key, value) for module in layer.modules()
                              for key, value in module.items()
                              if isinstance(value, (mx.array, nn.Module)))
        return self._arrays
