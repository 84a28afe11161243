"""The Metal kernels behind `paged_attention`, built with any `metal_kernel` factory.

`mx.fast.metal_kernel` on a Mac; `kernels_metal.emulator.metal_kernel` in tests. Outputs of a
`metal_kernel` are always fresh allocations, so the kernels only read the K/V pools; new K/V
reach the pools through `write_kv`, an MLX scatter that the runner orders so that it is done
in place (README.md, KV writes).
"""

from __future__ import annotations

import mlx.core as mx

from kernels_metal.decode import decode_layout, make_decode_kernels
from kernels_metal.kv_quant import QuantizedPool
from kernels_metal.metadata import AttentionMetadata
from kernels_metal.plan import (
    KernelPlan,
    PlanLaunch,
    PlanOptions,
    build_plan,
    params_for,
    sink_input,
)
from kernels_metal.prefill import make_prefill_kernel

SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
MAX_HEAD_DIM = 256


def kernel_dtype(q: mx.array, k_pool: mx.array | QuantizedPool) -> mx.Dtype:
    """The kernels' element type T: a float pool's dtype (queries are cast to it), or the
    queries' dtype over a quantized pool (K/V are dequantized to it as they are staged)."""
    return q.dtype if isinstance(k_pool, QuantizedPool) else k_pool.dtype


def latent_unsupported_reason(q: mx.array, pool: mx.array | QuantizedPool,
                              value_dim: int) -> str | None:
    """Why the decode kernel cannot take this MLA call (its latent rows: one KV head, the
    values the first `value_dim` of each), or None."""
    width = pool.shape[3]
    if isinstance(pool, QuantizedPool) and pool.rotated:
        return "a latent pool of turned rows (its values would be turned too)"
    if kernel_dtype(q, pool) not in SUPPORTED_DTYPES:
        return f"latent rows as {kernel_dtype(q, pool)}"
    if pool.shape[2] != 1 or not 0 < value_dim <= width:
        return f"latent rows of {pool.shape[2]} heads x {width} with {value_dim} values"
    if width % 8:
        return f"latent width {width} (the kernel takes multiples of 8)"
    if isinstance(pool, QuantizedPool) and pool.bits == 4 and width % 16:
        return f"int4 latent rows of width {width} (the kernel needs a multiple of 16)"
    try:
        decode_layout(kernel_dtype(q, pool).size, width, values_in_keys=True)
    except ValueError as exc:
        return str(exc)
    return None


def unsupported_reason(q: mx.array, k_pool: mx.array | QuantizedPool) -> str | None:
    """Why the kernels cannot take this call (the reference then serves it), or None."""
    head_dim, kv_heads = k_pool.shape[3], k_pool.shape[2]
    quantized = isinstance(k_pool, QuantizedPool)
    if kernel_dtype(q, k_pool) not in SUPPORTED_DTYPES:
        return (f"query dtype {q.dtype} over an int{k_pool.bits} KV pool" if quantized
                else f"KV dtype {k_pool.dtype}")
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} (kernels take multiples of 8 up to {MAX_HEAD_DIM})"
    if quantized and k_pool.bits == 4 and head_dim % 16:
        return (f"int4 KV at head_dim {head_dim} (the kernels load a row's codes 8 bytes or "
                "more at a time: int4 needs a multiple of 16)")
    if q.shape[1] % kv_heads:
        return f"{q.shape[1]} query heads over {kv_heads} KV heads"
    return None


class PagedAttentionKernels:
    """Decode rows -> per-token split-K kernel (+ reduce); prefill chunks -> tiled kernel
    (its variant with a last key per row for a step whose image rows see each other)."""

    def __init__(self, metal_kernel=None, options: PlanOptions | None = None) -> None:
        factory = metal_kernel or mx.fast.metal_kernel
        self.decode_kernels = make_decode_kernels(factory)
        self.prefill_kernel = make_prefill_kernel(factory)
        self.prefill_last_keys_kernel = make_prefill_kernel(factory, last_keys=True)
        self.options = options or PlanOptions()

    def plan(self, meta: AttentionMetadata, num_heads: int, kv_heads: int,
             window: int | None = None, every_row_apart: bool = False) -> KernelPlan:
        options = self.options.every_row_apart() if every_row_apart else self.options
        key = ("metal-kernels", num_heads, kv_heads, options, window)
        if key not in meta.backend_plans:
            meta.backend_plans[key] = build_plan(meta, num_heads, kv_heads, options, window)
        return meta.backend_plans[key]

    def prefill_kernel_for(self, plan: KernelPlan):
        """The tiled kernel `plan`'s rows need: the one that reads each row's last key where
        some see past their own position (an image's), else the causal one."""
        if plan.prefill is not None and plan.prefill.last_keys is not None:
            return self.prefill_last_keys_kernel
        return self.prefill_kernel

    def prepare(self, q: mx.array, k_pool: mx.array | QuantizedPool, meta: AttentionMetadata,
                scale: float, window: int | None = None, softcap: float | None = None,
                value_dim: int | None = None) -> PreparedAttention:
        """The step's launches for layers of this kind (`q`'s dtype and heads, the pool's
        shape and kind, `scale`, `window`, `softcap`, MLA's `value_dim`): made once, run by
        every such layer. With a `value_dim` the values are the first `value_dim` elements
        of each key row and every row goes to the decode kernel."""
        num_heads, kv_heads = q.shape[1], k_pool.shape[2]
        plan = self.plan(meta, num_heads, kv_heads, window, value_dim is not None)
        params = params_for(plan, num_heads, kv_heads, scale, softcap)
        dtype = kernel_dtype(q, k_pool)
        launch = PlanLaunch(plan, self.decode_kernels, self.prefill_kernel_for(plan), dtype,
                            num_heads, k_pool, params, value_dim)
        return PreparedAttention(launch, dtype, num_heads)

    def __call__(self, q: mx.array, k_pool: mx.array | QuantizedPool,
                 v_pool: mx.array | QuantizedPool, meta: AttentionMetadata, scale: float,
                 window: int | None = None, softcap: float | None = None,
                 sinks: mx.array | None = None, value_dim: int | None = None) -> mx.array:
        """Same contract as `paged_attention_reference` (with `value_dim`, MLA's: the values
        are the keys' first `value_dim` elements, `v_pool` is not read); the pools are float
        arrays or `QuantizedPool`s (both of one kind)."""
        return self.prepare(q, k_pool, meta, scale, window, softcap, value_dim)(
            q, k_pool, v_pool, sinks)


class PreparedAttention:
    """`PagedAttentionKernels` of one step for one kind of layer: `(q, k_pool, v_pool, sinks)`
    of a layer -> its output, as the kernels' call."""

    def __init__(self, launch: PlanLaunch, dtype: mx.Dtype, num_heads: int) -> None:
        self.launch, self.dtype, self.num_heads = launch, dtype, num_heads
        self.launches = launch.launches

    def __call__(self, q: mx.array, k_pool: mx.array | QuantizedPool,
                 v_pool: mx.array | QuantizedPool, sinks: mx.array | None = None) -> mx.array:
        queries = q.astype(self.dtype) if q.dtype != self.dtype else q
        out = self.launch(queries, k_pool, v_pool, sink_input(sinks, self.num_heads))
        return out.astype(q.dtype) if out.dtype != q.dtype else out
