"""The one attention entry point the models call; picks a backend per device.

On a Metal device the paged-attention kernels serve every call they support (dtype, head
dim); on MLX's CPU backend a numpy implementation over views of the pools does (fp32/fp16
pools); anything else goes to the pure-MLX reference. The first call of each kernel variant
on a Mac builds and checks it on a small problem against the reference: if that fails (a
kernel that does not compile on this macOS, a wrong result), one warning is logged and the
reference serves every call from then on.

K/V are written by `write_kv`, an in-place MLX scatter: `mx.fast.metal_kernel` outputs are
always fresh allocations, so a kernel cannot update the pool in place.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import mlx.core as mx

from kernels_metal import cpu_attention
from kernels_metal.cases import Case, check
from kernels_metal.cpu_math import on_cpu
from kernels_metal.metadata import AttentionMetadata
from kernels_metal.paged import PagedAttentionKernels, unsupported_reason
from kernels_metal.reference import paged_attention_reference, write_kv

__all__ = ["AttentionMetadata", "kernels_disabled_reason", "paged_attention",
           "use_kernels", "write_kv"]

log = logging.getLogger(__name__)


class _Dispatch:
    def __init__(self) -> None:
        self.kernels: PagedAttentionKernels | None = None
        self.override: PagedAttentionKernels | None = None
        self.disabled: str | None = None  # why the kernels are off for this process
        self.checked: set[tuple] = set()
        self.metal: bool | None = None  # mx.metal.is_available(), asked once


_state = _Dispatch()


def paged_attention(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, meta: AttentionMetadata, scale: float,
    window: int | None = None, softcap: float | None = None,
) -> mx.array:
    """Packed varlen causal attention: `q [total_q, H, D]` -> `[total_q, H, D]`.

    `k_pool`/`v_pool` are `[num_blocks, block_size, kv_heads, head_dim]`; query heads
    `h` use KV head `h // (H // kv_heads)` (GQA). A layer's `window` (None: global) limits a
    row at position p to keys `p - window + 1 .. p`; `softcap` maps scores s (after `scale`)
    to `softcap * tanh(s / softcap)` before the softmax.
    """
    kernels = _kernels_for(q, k_pool)
    if kernels is not None:
        return kernels(q, k_pool, v_pool, meta, scale, window, softcap)
    if on_cpu() and cpu_attention.supports(q, k_pool):
        return cpu_attention.paged_attention_cpu(q, k_pool, v_pool, meta, scale, window, softcap)
    return paged_attention_reference(q, k_pool, v_pool, meta, scale, window, softcap)


@contextlib.contextmanager
def use_kernels(kernels: PagedAttentionKernels) -> Iterator[None]:
    """Serve every supported call with `kernels` (e.g. built on the emulator in tests)."""
    previous, _state.override = _state.override, kernels
    try:
        yield
    finally:
        _state.override = previous


def kernels_disabled_reason() -> str | None:
    """Why this process fell back to the reference for good, or None."""
    return _state.disabled


def _kernels_for(q: mx.array, k_pool: mx.array) -> PagedAttentionKernels | None:
    if _state.override is None:
        if _state.metal is None:
            _state.metal = mx.metal.is_available()
        if _state.disabled is not None or not _state.metal:
            return None
    if unsupported_reason(q, k_pool) is not None:
        return None
    if _state.override is not None:
        return _state.override
    if _state.kernels is None:
        _state.kernels = PagedAttentionKernels()
    variant = (k_pool.dtype, q.dtype, k_pool.shape[1:], q.shape[1])
    if variant not in _state.checked:
        reason = _first_use_check(_state.kernels, q, k_pool)
        if reason is not None:
            _state.disabled = reason
            log.warning("Metal attention kernels disabled, using the MLX reference: %s", reason)
            return None
        _state.checked.add(variant)
    return _state.kernels


def _first_use_check(kernels, q: mx.array, k_pool: mx.array) -> str | None:
    """Build every kernel of this variant and compare it with the reference on a small step."""
    _, block_size, kv_heads, head_dim = k_pool.shape
    case = Case(k_pool.dtype, head_dim, block_size, q.shape[1], kv_heads,
                requests=((2 * block_size + 3, 1), (0, 1), (block_size - 1, 9)))
    try:
        result = check(kernels, case)
        split = PagedAttentionKernels(options=kernels.options.with_partition(block_size))
        split_result = check(split, case)
    except Exception as exc:  # a compile error surfaces here, at the first evaluation
        return f"{type(exc).__name__}: {exc}"
    for r in (result, split_result):
        if not r.passed:
            return f"wrong result on {case.name}: max error {r.max_error:g}"
    return None
