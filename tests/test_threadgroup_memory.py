"""Threadgroup memory of every kernel variant the dispatchers can pick: read from the kernel
sources at each launch's template, and held strictly below the 32 KB Apple GPUs allow."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest

from kernels_metal import decode, prefill
from kernels_metal.decode import THREADGROUP_MEMORY, THREADGROUP_MEMORY_BUDGET
from kernels_metal.threadgroup_memory import (
    KernelVariant,
    dispatchable_variants,
    threadgroup_bytes,
)


@pytest.fixture(scope="module")
def variants() -> list[KernelVariant]:
    return dispatchable_variants()


def test_every_dispatchable_variant_stays_under_the_budget(variants):
    assert THREADGROUP_MEMORY_BUDGET < THREADGROUP_MEMORY == 32768
    sizes = {v: threadgroup_bytes(v) for v in variants}
    unread = [v.name for v, size in sizes.items() if size is None]
    assert not unread, f"declarations the reader cannot size: {unread[:5]}"
    over = [(v.name, size) for v, size in sizes.items() if size > THREADGROUP_MEMORY_BUDGET]
    assert not over, f"over the {THREADGROUP_MEMORY_BUDGET}-byte budget: {over[:5]}"
    assert max(sizes.values()) == THREADGROUP_MEMORY_BUDGET  # fp16 D=216: see below


def test_the_variants_are_what_the_dispatchers_take(variants):
    latent = {v for v in variants if v.kernel == "paged_attention_decode" and v.value_dim}
    # MLA's latent rows: DeepSeek's 576 and a rank of 256's 320 among them, in every dtype.
    assert {(t, d) for t in (mx.float16, mx.bfloat16, mx.float32) for d in (320, 576)} <= {
        (v.dtype, v.head_dim) for v in latent}
    variants = [v for v in variants if v not in latent]
    kinds = Counter((v.kernel, v.kv_bits) for v in variants)
    # fp16, bf16 and fp32 at head dims 8..256 in steps of 8 (int4: of 16), nothing else.
    assert kinds[("paged_attention_decode", None)] == 3 * 32
    assert kinds[("paged_attention_prefill", 8)] == 3 * 32
    assert kinds[("paged_attention_reduce", 4)] == 3 * 16
    attention = {(v.dtype, v.head_dim) for v in variants if v.kernel.startswith("paged")}
    assert attention == {(t, d) for t in (mx.float16, mx.bfloat16, mx.float32)
                         for d in range(8, 257, 8)}
    scan = {(v.dtype, v.head_dim) for v in variants if v.kernel == "gated_delta_scan"}
    assert scan == {(t, d) for t in (mx.float16, mx.bfloat16, mx.float32) for d in range(1, 257)}


# Those whose two K/V tiles (rows padded as the kernel stages them) filled exactly the 32 KB
# before the budget: (kernel, dtype, head dim, keys per tile then, now).
AT_THE_LIMIT = [("paged_attention_decode", mx.float16, 256, 32, 16),
                ("paged_attention_decode", mx.bfloat16, 248, 32, 16),
                ("paged_attention_decode", mx.float32, 128, 32, 16),
                ("paged_attention_decode", mx.float32, 256, 16, 8),
                ("paged_attention_prefill", mx.float16, 248, 32, 16)]


@pytest.mark.parametrize(("kernel", "dtype", "head_dim", "before", "tile"), AT_THE_LIMIT)
def test_variants_once_at_exactly_32_kb_take_the_next_smaller_tile(kernel, dtype, head_dim,
                                                                     before, tile):
    if kernel == "paged_attention_decode":
        row = decode.decode_layout(dtype.size, head_dim)[2]
        assert decode.decode_layout(dtype.size, head_dim)[3] == tile
    else:
        row = head_dim + 16 // dtype.size
        assert prefill.prefill_tile(dtype.size, head_dim) == tile
    assert 2 * before * row * dtype.size == THREADGROUP_MEMORY and tile == before // 2
    assert threadgroup_bytes(KernelVariant(kernel, dtype, head_dim)) == 2 * tile * row * dtype.size


def test_variants_up_to_the_budget_keep_32_key_tiles():
    for dtype, head_dim in ((mx.float16, 216), (mx.bfloat16, 208), (mx.float32, 104)):
        assert decode.decode_layout(dtype.size, head_dim)[3] == 32
        assert prefill.prefill_tile(dtype.size, head_dim) == 32
    for kernel in ("paged_attention_decode", "paged_attention_prefill"):
        assert threadgroup_bytes(KernelVariant(kernel, mx.float16, 216)) == \
            THREADGROUP_MEMORY_BUDGET  # 2 x 32 keys x (216 + 8 padding) x 2 bytes


def test_a_kernel_source_over_the_budget_is_seen(monkeypatch):
    grown = decode.DECODE_SOURCE.replace("threadgroup uint4 v_raw[(1 - VK) * TILE * VLD + VK];",
                                         "threadgroup uint4 v_raw[TILE * VLD + 256];")
    monkeypatch.setattr("kernels_metal.threadgroup_memory.DECODE_SOURCE", grown)
    variant = KernelVariant("paged_attention_decode", mx.float16, 216)
    assert threadgroup_bytes(variant) == THREADGROUP_MEMORY_BUDGET + 256 * 16
