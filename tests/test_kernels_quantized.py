"""The paged-attention kernels over int8 and int4 K/V pools (kv_quant.py), run by the MSL
emulator: K/V tiles are dequantized to the queries' dtype as they are staged.

Every case is checked against the reference in fp32 over the pools' values dequantized to the
queries' dtype (what the kernels stage), with the float tolerances (`cases.TOLERANCE`);
blocks no request owns carry NaN scales, so a wrong-block read cannot pass. Mutants of the
staging (nibble order, scale group, sign, bias, scale row) must fail by far.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from markers import requires_emulator

from kernels_metal import attention, decode, emulator
from kernels_metal.attention import Variant, first_use_case, variant_of
from kernels_metal.cases import (
    BLOCK_SIZES,
    DTYPES,
    HEAD_DIMS,
    KV_BITS,
    Case,
    case_sinks,
    check,
    make_inputs,
    quantized_grid,
)
from kernels_metal.kv_quant import QuantizedPool, dequantize
from kernels_metal.paged import PagedAttentionKernels, unsupported_reason
from kernels_metal.plan import PlanOptions, build_plan

pytestmark = requires_emulator

CASES = quantized_grid()


def emulated(case: Case, metal_kernel=emulator.metal_kernel) -> PagedAttentionKernels:
    return PagedAttentionKernels(metal_kernel, PlanOptions(partition_size=case.partition_size))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_quantized_kernels_match_reference(case: Case):
    result = check(emulated(case), case)
    assert result.passed, f"{case.name}: max error {result.max_error:g} ({result.worst:.2f}x tol)"


def test_quantized_grid_covers_the_required_shapes():
    assert {(c.kv_bits, c.dtype, c.head_dim) for c in CASES} >= set(
        itertools.product(KV_BITS, DTYPES, HEAD_DIMS))
    assert {(c.kv_bits, c.block_size) for c in CASES} == set(itertools.product(KV_BITS,
                                                                               BLOCK_SIZES))
    assert {c.num_heads // c.kv_heads for c in CASES} >= {1, 3, 4, 8}
    assert {c.kv_bits for c in CASES if c.window} == {c.kv_bits for c in CASES if c.softcap} == {
        c.kv_bits for c in CASES if c.sinks} == set(KV_BITS)
    launches = set()
    for case in CASES:
        _, _, _, meta, _ = make_inputs(case)
        plan = build_plan(meta, case.num_heads, case.kv_heads,
                          PlanOptions(partition_size=case.partition_size), case.window)
        mixed = plan.decode is not None and plan.prefill is not None
        parts = min(plan.decode.num_parts, 2) if plan.decode is not None else 0
        launches.add((case.kv_bits, mixed, parts))
    assert launches >= {(bits, True, parts) for bits in KV_BITS for parts in (1, 2)}
    # Rows of codes that are not a multiple of 16 bytes take 8-byte loads.
    assert {c.kv_bits for c in CASES if c.head_dim * c.kv_bits // 8 % 16} == set(KV_BITS)


@pytest.mark.parametrize("bits", KV_BITS)
def test_blocks_no_request_owns_have_nan_scales(bits):
    case = Case(mx.float16, 64, 16, 8, 2, ((40, 1), (3, 20)), kv_bits=bits)
    _, k_pool, v_pool, meta, _ = make_inputs(case)
    owned = np.zeros(k_pool.shape[0], bool)
    owned[meta.block_tables[meta.block_tables > 0]] = True
    owned[0] = True  # the reference gathers table padding through block 0: finite
    for pool in (k_pool, v_pool):
        assert isinstance(pool, QuantizedPool) and pool.bits == bits
        nan = np.isnan(np.array(pool.scales.astype(mx.float32))).all(axis=(1, 2, 3))
        np.testing.assert_array_equal(nan, ~owned)
        assert nan.any()


@pytest.mark.parametrize(("bits", "dtype"), list(itertools.product(KV_BITS, DTYPES)),
                         ids=lambda v: str(v).removeprefix("mlx.core."))
def test_staging_dequantized_equals_a_float_pool_of_the_same_values_bit_for_bit(bits, dtype):
    """A quantized pool gives the very output of a float pool holding its values rounded to
    the queries' dtype: staging is the only difference, and it rounds as `dequantize` does."""
    case = next(c for c in CASES if (c.kv_bits, c.dtype, c.head_dim) == (bits, dtype, 96))
    q, k_pool, v_pool, meta, scale = make_inputs(case, seed=4)
    floats = [dequantize(p.codes, p.scales, bits, dtype) for p in (k_pool, v_pool)]
    kernels, options = emulated(case), (case.window, case.softcap, case_sinks(case))
    quantized = kernels(q, k_pool, v_pool, meta, scale, *options)
    plain = kernels(q, *floats, meta, scale, *options)
    np.testing.assert_array_equal(np.array(quantized.astype(mx.float32)),
                                  np.array(plain.astype(mx.float32)))


MIXED = ((70, 1), (9, 1), (21, 19), (0, 11))
MUTANTS = {  # (what breaks, old, new, the KV bits it breaks)
    "nibble-order": ("(word >> (4 * k))", "(word >> (4 * (k ^ 1)))", 4),
    "int4-bias": ("float((word >> (4 * k)) & 0xFu) - 7.5f", "float((word >> (4 * k)) & 0xFu)", 4),
    "int8-unsigned": ("as_type<char4>(word)", "as_type<uchar4>(word)", 8),
    "first-group-only": ("row_scales[u * WPL * CPW / KV_GROUP]", "row_scales[0]", 8),
    "neighbour-row-scales": ("scales + row * (D / KV_GROUP)", "scales + (row ^ 1) * (D / KV_GROUP)",
                             4),
    "v-with-k-scales": ("(const device uchar*)v_pool, v_scales", "(const device uchar*)v_pool, "
                        "k_scales", 8),
}


def mutated(old: str, new: str):
    """An emulator `metal_kernel` whose attention kernels carry `new` for `old` (in the
    staging header or the kernel body)."""
    assert old in decode.QUANTIZED_STAGING_HEADER + decode.DECODE_SOURCE

    def factory(**spec):
        for part in ("header", "source"):
            spec[part] = spec.get(part, "").replace(old, new)
        return emulator.metal_kernel(**spec)
    return factory


@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_broken_staging_fails_the_comparison(mutant):
    old, new, bits = MUTANTS[mutant]
    case = Case(mx.float32, 128, 16, 8, 2, MIXED, 32, kv_bits=bits)
    assert check(emulated(case), case).passed
    result = check(emulated(case, mutated(old, new)), case)
    assert not result.worst <= 10.0, f"{mutant}: only {result.worst:.2f}x the tolerance"


def test_a_quantized_variant_is_the_queries_dtype_and_the_pools_bits(monkeypatch):
    case = Case(mx.float16, 64, 16, 8, 2, ((20, 1), (0, 12)), kv_bits=4)
    q, k_pool, v_pool, meta, scale = make_inputs(case)
    variant = variant_of(q.astype(mx.bfloat16), k_pool, window=8)
    assert variant == Variant(mx.bfloat16, 64, 16, 8, 2, windowed=True, kv_bits=4)
    assert variant.name == "bfloat16-kv4-d64-bs16-h8kv2-window"
    assert first_use_case(variant).name.startswith("bfloat16-kv4-d64-bs16-h8kv2-")
    monkeypatch.setattr(attention, "_state", attention._Dispatch())
    kernels = emulated(case)
    with attention.use_kernels(kernels):
        out = attention.paged_attention(q, k_pool, v_pool, meta, scale)
    np.testing.assert_array_equal(np.array(out), np.array(kernels(q, k_pool, v_pool, meta,
                                                                  scale)))


@pytest.mark.parametrize(("bits", "head_dim", "supported"), [
    (8, 40, True),  # 8-byte loads of codes
    (4, 48, True),
    (4, 40, False),  # 20 bytes of codes a row: no 8-byte loads
    (4, 264, False),  # past the kernels' largest head dim
])
def test_quantized_head_dims_the_kernels_take(bits, head_dim, supported):
    case = Case(mx.float16, head_dim, 16, 4, 2, ((5, 1),), kv_bits=bits)
    q, k_pool, _, _, _ = make_inputs(case)
    reason = unsupported_reason(q, k_pool)
    assert (reason is None) == supported, reason
    if bits == 4 and head_dim == 40:
        assert "multiple of 16" in reason


@pytest.mark.skipif(not hasattr(mx, "export_function"), reason="needs mx.export_function")
@pytest.mark.parametrize("bits", KV_BITS)
def test_quantized_launches_are_accepted_by_mlx_metal_kernel(tmp_path, bits):
    """Tracing for export runs MLX's own metal_kernel argument checks without a GPU."""
    case = Case(mx.bfloat16, 80, 16, 8, 2, ((70, 1), (20, 19), (3, 2)), kv_bits=bits)
    q, k_pool, v_pool, meta, scale = make_inputs(case)
    kernels = PagedAttentionKernels(mx.fast.metal_kernel, PlanOptions(partition_size=32))
    assert kernels.plan(meta, 8, 2).decode.num_parts > 1  # decode, reduce and prefill all run

    def step(q, k_codes, k_scales, v_codes, v_scales):
        return kernels(q, QuantizedPool(k_codes, k_scales, bits),
                       QuantizedPool(v_codes, v_scales, bits), meta, scale)

    mx.export_function(str(tmp_path / "attention.mlxfn"), step, q, *k_pool.arrays(),
                       *v_pool.arrays())
    assert (tmp_path / "attention.mlxfn").stat().st_size > 0
