"""The attention entry points the models call; picks a backend per device and variant.

On a Metal device the paged-attention kernels serve every call they support (dtype, head
dim; float or int8/int4 quantized pools); on MLX's CPU backend a numpy implementation over
views of the pools does (fp32/fp16 pools); anything else goes to the pure-MLX reference. The
kernels are judged per `Variant` (element dtype, KV bits, head dim, block size, heads,
whether the layer has a window / a soft-cap / attention sinks, whether the step's image rows
see each other): the first call of a variant
builds its kernels and checks them against the reference on a small step with the layer's
options. A variant that fails that check, or whose kernels raise later (a launch that first
compiles when evaluated included), falls back (one warning naming it and the reason); every
other variant stays on the kernels. The state machine is kernels_metal/dispatch.py's, shared
with the gated delta kernel.

K/V are written by `write_kv`, an in-place MLX scatter: `mx.fast.metal_kernel` outputs are
always fresh allocations, so a kernel cannot update the pool in place.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from kernels_metal.cases import Case, check
from kernels_metal.cpu import attention as cpu_attention
from kernels_metal.cpu.math import on_cpu
from kernels_metal.dispatch import CheckedDispatch, describe
from kernels_metal.kv_quant import QuantizedPool, queries_for
from kernels_metal.metadata import AttentionMetadata
from kernels_metal.paged import (
    PagedAttentionKernels,
    PreparedAttention,
    kernel_dtype,
    latent_unsupported_reason,
    unsupported_reason,
)
from kernels_metal.reference import paged_attention_reference, write_kv

__all__ = ["AttentionMetadata", "Variant", "check_variant", "first_use_case",
           "kernel_fallbacks", "kernels_disabled_reason", "latent_attention", "latent_reference",
           "numpy_serves", "paged_attention", "use_kernels", "variant_of", "write_and_attend",
           "write_kv"]

log = logging.getLogger(__name__)

CHECK_SOFTCAP = 50.0  # the first-use check's cap when the layer's own is not known (doctor)


class Variant(NamedTuple):
    """What the kernels are specialised on, checked once, and fall back on."""

    dtype: mx.Dtype  # the kernels' element type (`paged.kernel_dtype`)
    head_dim: int
    block_size: int
    num_heads: int
    kv_heads: int
    windowed: bool = False
    softcapped: bool = False
    with_sinks: bool = False
    kv_bits: int | None = None  # of quantized pools; None: float pools
    value_dim: int | None = None  # MLA's latent rows: their first value_dim are the values
    last_keys: bool = False  # rows that see past their own position (AttentionMetadata)

    @property
    def name(self) -> str:
        dtype = str(self.dtype).removeprefix("mlx.core.")
        kv = f"-kv{self.kv_bits}" if self.kv_bits else ""
        dv = f"-dv{self.value_dim}" if self.value_dim else ""
        options = ("-window" * self.windowed + "-softcap" * self.softcapped
                   + "-sinks" * self.with_sinks + "-lastkeys" * self.last_keys)
        return (f"{dtype}{kv}-d{self.head_dim}{dv}-bs{self.block_size}"
                f"-h{self.num_heads}kv{self.kv_heads}{options}")


def variant_of(q: mx.array, k_pool: mx.array | QuantizedPool, window: int | None = None,
               softcap: float | None = None, sinks: mx.array | None = None,
               value_dim: int | None = None, last_keys: bool = False) -> Variant:
    _, block_size, kv_heads, head_dim = k_pool.shape
    bits = k_pool.bits if isinstance(k_pool, QuantizedPool) else None
    return Variant(kernel_dtype(q, k_pool), head_dim, block_size, q.shape[1], kv_heads,
                   window is not None, softcap is not None, sinks is not None, bits, value_dim,
                   last_keys)


class _Dispatch(CheckedDispatch[PagedAttentionKernels, Variant]):
    def __init__(self) -> None:
        # Names looked up per call, so that tests can swap the kernels or the check.
        super().__init__("attention", lambda factory: PagedAttentionKernels(metal_kernel=factory),
                         lambda *args: check_variant(*args), log)


_state = _Dispatch()


def paged_attention(
    q: mx.array, k_pool: mx.array | QuantizedPool, v_pool: mx.array | QuantizedPool,
    meta: AttentionMetadata, scale: float, window: int | None = None,
    softcap: float | None = None, sinks: mx.array | None = None,
    without_kernels: Callable | None = None,
) -> mx.array:
    """Packed varlen causal attention: `q [total_q, H, D]` -> `[total_q, H, D]`.

    `k_pool`/`v_pool` are `[num_blocks, block_size, kv_heads, head_dim]` (float arrays, or
    both `QuantizedPool`s of that logical shape); query heads
    `h` use KV head `h // (H // kv_heads)` (GQA). A layer's `window` (None: global) limits a
    row at position p to keys `p - window + 1 .. p`; `softcap` maps scores s (after `scale`)
    to `softcap * tanh(s / softcap)` before the softmax. `sinks [H]` (GPT-OSS) joins one
    logit per head to every row's softmax, as is (no scale, no cap), with no value: the
    probability it takes is dropped; -inf is the same as no sink.

    `without_kernels` serves what the kernels do not, with the reference's arguments: the
    caller's backend's own (`Ops.attention_without_kernels`); None: the device's (numpy on
    MLX's CPU backend where it can, else the reference).
    """
    if isinstance(q, np.ndarray):  # the host forward's (float pools only: `numpy_serves`)
        _check_sinks(sinks, q.shape[1])
        return cpu_attention.paged_attention_cpu(q, k_pool, v_pool, meta, scale, window,
                                                 softcap, sinks)
    # Layers of one kind make the same launches: the route and the launches are resolved by
    # the first of them in a step and looked up by the rest.
    kind = (q.dtype, q.shape[1], k_pool.shape, _pool_kind(k_pool), scale, window, softcap,
            sinks is None, without_kernels)
    served = meta.backend_plans.get(("attention", _state.generation, kind))
    if served is not None:
        return served(q, k_pool, v_pool, sinks)
    out, served = _resolve(q, k_pool, v_pool, meta, scale, window, softcap, sinks,
                           without_kernels or _device_without_kernels(), kind)
    meta.backend_plans["attention", _state.generation, kind] = served
    return out


def _pool_kind(pool: mx.array | QuantizedPool) -> tuple | mx.Dtype:
    """What of a pool besides its shape decides the variant: a float pool's dtype, or a
    quantized pool's bits and turn."""
    return (pool.bits, pool.rotated) if isinstance(pool, QuantizedPool) else pool.dtype


def _device_without_kernels() -> Callable:
    return cpu_attention.attention_or_reference if on_cpu() else paged_attention_reference


def _resolve(q, k_pool, v_pool, meta, scale, window, softcap, sinks, fallback: Callable,
             kind: tuple) -> tuple[mx.array, Any]:
    """The first call of a kind of layer in a step: its output, and how its kind is served.

    A kind the kernels served in an earlier step, whose launches this step makes the same
    way (`PlanLaunch.launches`), runs on them without the route: its variant passed, and
    those launches were evaluated then. Rows that see past their own position (an image's
    tokens in a Gemma prefill) are another variant (`variant_of`), so part of the key."""
    _check_sinks(sinks, q.shape[1])
    args = (q, k_pool, v_pool, sinks)
    key = (kind, meta.last_keys is not None)
    kept = _state.proven(key)
    if kept is not None:
        served = _prepared(kept, q, k_pool, meta, scale, window, softcap)
        if _state.proven((key, getattr(served, "launches", None))) is kept:
            return served(*args), served

    def without_kernels(q, k_pool, v_pool, sinks) -> mx.array:
        q = queries_for(q, k_pool)  # a quantized K pool holds turned keys (kv_quant.rotation)
        return fallback(q, k_pool, v_pool, meta, scale, window, softcap, sinks)

    used = []

    def prepare(kernels: PagedAttentionKernels) -> PreparedAttention | _TurnedQueries:
        used.append(kernels)
        return _prepared(kernels, q, k_pool, meta, scale, window, softcap)

    if not _state.on_kernels() or unsupported_reason(q, k_pool) is not None:
        return without_kernels(*args), without_kernels
    variant = variant_of(q, k_pool, window, softcap, sinks, last_keys=meta.last_keys is not None)
    out, served = _state.serve(variant, prepare, without_kernels, args, (window, softcap))
    launches = getattr(served, "launches", None)  # None: kernels whose launches are not told
    if served is not without_kernels and launches is not None:
        _state.keep(key, used[0])
        _state.keep((key, launches), used[0])
    return out, served


def _prepared(kernels: PagedAttentionKernels, q, k_pool, meta, scale, window,
              softcap) -> PreparedAttention | _TurnedQueries:
    launch = kernels.prepare(queries_for(q, k_pool), k_pool, meta, scale, window, softcap)
    turned = isinstance(k_pool, QuantizedPool) and k_pool.rotated
    return _TurnedQueries(launch) if turned else launch


class _TurnedQueries:
    """A turned K pool's launches (kv_quant.rotation): each layer's queries turned first."""

    def __init__(self, launch: PreparedAttention) -> None:
        self.launch = launch
        self.launches = getattr(launch, "launches", None)

    def __call__(self, q, k_pool, v_pool, sinks) -> mx.array:
        return self.launch(queries_for(q, k_pool), k_pool, v_pool, sinks)


def latent_attention(q: mx.array, pool: mx.array | QuantizedPool, value_dim: int,
                     meta: AttentionMetadata, scale: float) -> mx.array:
    """Multi-head latent attention in its absorbed form (metal_engine/models/mla.py):
    `q [total_q, H, W]` over latent rows `[num_blocks, block_size, 1, W]` whose first
    `value_dim` elements are the values; `[total_q, H, value_dim]` out.

    On a Metal device the decode kernel serves every row, chunks' rows too (template VK:
    the values read from the staged keys), checked and falling back per variant as
    `paged_attention` is; elsewhere, and where it does not serve, `latent_reference`.
    """
    kind = ("latent", q.dtype, q.shape[1], pool.shape, scale, value_dim)
    served = meta.backend_plans.get(("attention", _state.generation, kind))
    if served is not None:
        return served(q, pool)

    def without_kernels(q, pool) -> mx.array:
        return latent_reference(q, pool, value_dim, meta, scale)

    def prepare(kernels: PagedAttentionKernels):
        launch = kernels.prepare(q, pool, meta, scale, value_dim=value_dim)
        return lambda q, pool: launch(q, pool, pool)

    if not _state.on_kernels() or latent_unsupported_reason(q, pool, value_dim) is not None:
        out, served = without_kernels(q, pool), without_kernels
    else:
        out, served = _state.serve(variant_of(q, pool, value_dim=value_dim), prepare,
                                   without_kernels, (q, pool))
    meta.backend_plans["attention", _state.generation, kind] = served
    return out


def latent_reference(q: mx.array, pool: mx.array | QuantizedPool, value_dim: int,
                     meta: AttentionMetadata, scale: float) -> mx.array:
    """`latent_attention` by the pure-MLX reference: the keys' rows as the values, of which
    the first `value_dim` of the output are kept (a quantized pool, never turned, is
    dequantized as it is gathered)."""
    return paged_attention_reference(q, pool, pool, meta, scale)[..., :value_dim]


def write_and_attend(
    q: mx.array, k: mx.array, v: mx.array, k_pool: mx.array | QuantizedPool,
    v_pool: mx.array | QuantizedPool, meta: AttentionMetadata, scale: float,
    window: int | None = None, softcap: float | None = None, sinks: mx.array | None = None,
    without_kernels: Callable | None = None,
) -> tuple[mx.array, mx.array | QuantizedPool, mx.array | QuantizedPool]:
    """A layer's attention step: `write_kv` of its new `k`, `v` rows into the pools it took,
    then `paged_attention` of `q` over them. Returns the output and the pools to put back.
    The host forward's numpy rows take one call into the CPU backend."""
    if isinstance(q, np.ndarray):
        if sinks is not None:
            _check_sinks(sinks, q.shape[1])
        out = cpu_attention.write_and_attend(q, k, v, k_pool, v_pool, meta, scale, window,
                                             softcap, sinks)
        return out, k_pool, v_pool
    k_pool, v_pool = write_kv(k_pool, k, meta), write_kv(v_pool, v, meta)
    out = paged_attention(q, k_pool, v_pool, meta, scale, window, softcap, sinks,
                          without_kernels)
    return out, k_pool, v_pool


def numpy_serves() -> bool:
    """Whether attention runs in numpy here (on MLX's CPU backend, no kernels forced by
    `use_kernels`): then a layer may hand it numpy queries."""
    return _state.override is None and on_cpu()


def _check_sinks(sinks: mx.array | None, num_heads: int) -> None:
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"sinks has shape {sinks.shape}; it needs one logit per query head: "
                         f"({num_heads},)")


def use_kernels(kernels: PagedAttentionKernels,
                first_use_check: bool = False) -> contextlib.AbstractContextManager[None]:
    """Serve every supported call with `kernels` (e.g. built on the emulator in tests).

    With `first_use_check` each variant is checked and falls back as on a Mac, with verdicts
    of its own for the duration; without, every supported call goes to `kernels` and their
    errors propagate. Kernels built on `_state.recorded(factory)` also have each new launch
    configuration evaluated inside the call (kernels_metal/dispatch.py).
    """
    return _state.use(kernels, first_use_check)


def kernel_fallbacks() -> dict[Variant, str]:
    """The variants served without the kernels because theirs failed, with the reason each."""
    return dict(_state.active_verdicts.fallbacks)


def kernels_disabled_reason(variant: Variant | None = None) -> str | None:
    """Why `variant` fell back (None: it did not); without one, every fallback, or None."""
    fallbacks = _state.active_verdicts.fallbacks
    if variant is not None:
        return fallbacks.get(variant)
    return "; ".join(f"{v.name}: {why}" for v, why in fallbacks.items()) or None


def first_use_case(variant: Variant, window: int | None = None,
                   softcap: float | None = None) -> Case:
    """The small mixed step a variant is checked on, with the layer's window and soft-cap
    (and random sinks if it has them; if it reads last keys, images whose rows see each
    other: one across the chunk's 32-row tiles, one in a 3-row run).

    A window is shortened so that it cuts into the step's contexts (starts mid-block).
    """
    bs = variant.block_size
    requests = ((2 * bs + 3, 1), (0, 1), (bs - 1, 33))  # decodes; a chunk over 32-row tiles
    images = ()
    if variant.last_keys:
        requests, images = (*requests, (bs, 3)), ((2, 24, 9), (3, 0, 2))
    return Case(variant.dtype, variant.head_dim, bs, variant.num_heads, variant.kv_heads,
                requests, window=min(window or bs + 3, bs + 3) if variant.windowed else None,
                softcap=(softcap or CHECK_SOFTCAP) if variant.softcapped else None,
                sinks=variant.with_sinks, kv_bits=variant.kv_bits, value_dim=variant.value_dim,
                images=images)


def check_variant(kernels: PagedAttentionKernels, variant: Variant, window: int | None = None,
                  softcap: float | None = None) -> str | None:
    """Build and run every kernel of `variant` (one and several partitions) on a small step
    against the reference: None if they agree, else why not."""
    case = first_use_case(variant, window, softcap)
    split = copy.copy(kernels)  # the same built kernels, with a partition per block
    split.options = kernels.options.with_partition(variant.block_size)
    try:
        results = [check(kernels, case), check(split, case)]
    except Exception as exc:  # a compile error surfaces here, at the first evaluation
        return describe(exc)
    for r in results:
        if not r.passed:
            return f"wrong result on {case.name}: max error {r.max_error:g}"
    return None

