"""The paged-attention Metal kernels, run by the MSL emulator, against the pure-MLX reference.

Every case packs several requests into one step (decode rows, short multi-row runs, prefill
chunks on a cached prefix, fresh prompts) and is checked per element with a per-dtype
tolerance (kernels_metal.cases.TOLERANCE: (atol, rtol) = fp32 (1e-5, 1e-5), fp16 (1e-3, 4e-3),
bf16 (8e-3, 2e-2) against the reference in fp32 on the same rounded inputs).
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from markers import requires_emulator

from kernels_metal import emulator
from kernels_metal.cases import (
    BLOCK_SIZES,
    DTYPES,
    HEAD_DIMS,
    Case,
    case_sinks,
    check,
    grid,
    make_inputs,
)
from kernels_metal.paged import PagedAttentionKernels
from kernels_metal.plan import PlanOptions, build_plan
from kernels_metal.reference import paged_attention_reference

pytestmark = requires_emulator

CASES = grid()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernels_match_reference(case: Case):
    options = PlanOptions(partition_size=case.partition_size)
    kernels = PagedAttentionKernels(emulator.metal_kernel, options)
    result = check(kernels, case)
    assert result.passed, f"{case.name}: max error {result.max_error:g} ({result.worst:.2f}x tol)"


def test_grid_covers_the_required_shapes():
    assert len(CASES) >= 50
    assert {c.dtype for c in CASES} == set(DTYPES)
    assert {(c.head_dim, c.block_size) for c in CASES} >= set(
        itertools.product(HEAD_DIMS, BLOCK_SIZES))
    assert {c.num_heads // c.kv_heads for c in CASES} >= {1, 3, 4, 8}
    assert any(c.window for c in CASES) and any(c.softcap for c in CASES)


def test_grid_runs_sinks_through_every_launch_kind():
    """Sinks in decode rows (one partition and split), prefill tiles and mixed steps, with
    and without windows, and with more than 8 query heads per KV head (two chunks)."""
    launches, chunked = set(), False
    for case in (c for c in CASES if c.sinks):
        _, _, _, meta, _ = make_inputs(case)
        options = PlanOptions(partition_size=case.partition_size)
        plan = build_plan(meta, case.num_heads, case.kv_heads, options, case.window)
        windowed = case.window is not None
        if plan.decode is not None:
            launches.add((f"decode-{min(plan.decode.num_parts, 2)}-parts", windowed))
            chunked |= plan.decode.chunks > 1
        if plan.prefill is not None:
            launches.add(("prefill", windowed))
    kinds = ("decode-1-parts", "decode-2-parts", "prefill")
    assert launches == {(kind, windowed) for kind in kinds for windowed in (False, True)}
    assert chunked and any(c.softcap for c in CASES if c.sinks)


def test_decode_rows_are_unchanged_by_a_co_scheduled_prefill():
    """Decode rows get the same kernel and partitions whether or not a chunk joins the step."""
    decodes = ((150, 1), (9, 1), (70, 1))
    alone = Case(mx.float16, 64, 16, 8, 2, decodes)
    mixed = Case(mx.float16, 64, 16, 8, 2, decodes + ((40, 48),))
    kernels = PagedAttentionKernels(emulator.metal_kernel, PlanOptions(partition_size=64))
    q, k, v, meta, scale = make_inputs(mixed, seed=3)
    out_mixed = np.array(kernels(q, k, v, meta, scale))
    q_alone = q[: len(decodes)]
    meta_alone = type(meta)(meta.cu_seqlens_q[: len(decodes) + 1], meta.seq_lens[:3],
                            meta.block_tables[:3], meta.slot_mapping[:3], meta.block_size)
    out_alone = np.array(kernels(q_alone, k, v, meta_alone, scale))
    assert check(kernels, alone).passed
    np.testing.assert_array_equal(out_mixed[: len(decodes)], out_alone)


def test_plan_sends_short_requests_to_the_decode_kernel_and_chunks_to_tiles():
    case = Case(mx.float32, 64, 16, 8, 2, ((30, 1), (0, 20), (5, 3), (12, 9)))
    _, _, _, meta, _ = make_inputs(case)
    plan = build_plan(meta, 8, 2, PlanOptions(partition_size=16))
    assert plan.decode is not None and plan.prefill is not None
    rows = np.array(plan.decode.rows)[: plan.decode.num_rows]
    np.testing.assert_array_equal(rows[:, 0], [0, 21, 22, 23])  # packed rows of requests 0, 2
    np.testing.assert_array_equal(rows[:, 2], [31, 6, 7, 8])  # keys each row sees
    assert plan.decode.num_parts == 2  # 31 keys in partitions of 16
    tiles = np.array(plan.prefill.tiles)
    covered = sorted(r for t in tiles for r in range(t[1], t[1] + t[3]))
    assert covered == list(range(1, 21)) + list(range(24, 33))
    assert sorted([*rows[:, 0], *covered]) == list(range(33))  # every packed row, once


@pytest.mark.parametrize("sinks", [False, True])
def test_split_and_single_partition_decode_agree(sinks):
    """A split row's sink is counted once: in the reduce, not in each partition."""
    case = Case(mx.float32, 128, 16, 4, 2, ((250, 1), (31, 1)), sinks=sinks)
    q, k, v, meta, scale = make_inputs(case, seed=5)
    sink_logits = case_sinks(case, seed=5)
    outs = [np.array(PagedAttentionKernels(emulator.metal_kernel, PlanOptions(partition_size=p))(
        q, k, v, meta, scale, sinks=sink_logits)) for p in (None, 32, 100)]
    expected = np.array(paged_attention_reference(q, k, v, meta, scale, sinks=sink_logits))
    for out in outs:
        np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "partition"), [(None, None), (None, 32), (20, 16)])
def test_a_sink_of_minus_infinity_changes_no_bit_of_the_kernels_output(window, partition):
    case = Case(mx.float16, 64, 16, 8, 2, ((90, 1), (3, 1), (30, 40), (10, 2)), partition,
                window=window)
    q, k, v, meta, scale = make_inputs(case, seed=6)
    kernels = PagedAttentionKernels(emulator.metal_kernel, PlanOptions(partition_size=partition))
    plain = np.array(kernels(q, k, v, meta, scale, window))
    none = np.array(kernels(q, k, v, meta, scale, window, sinks=mx.full((8,), -mx.inf)))
    np.testing.assert_array_equal(none, plain)
    some = np.array(kernels(q, k, v, meta, scale, window, sinks=mx.full((8,), 2.0)))
    assert (np.abs(some) < np.abs(plain)).mean() > 0.9  # a real sink takes mass away


@pytest.mark.skipif(not hasattr(mx, "export_function"), reason="needs mx.export_function")
def test_launches_are_accepted_by_mlx_metal_kernel(tmp_path):
    """Tracing for export runs MLX's own metal_kernel argument checks without a GPU."""
    case = Case(mx.bfloat16, 128, 16, 8, 2, ((70, 1), (20, 19), (3, 2)))
    q, k, v, meta, scale = make_inputs(case)
    kernels = PagedAttentionKernels(mx.fast.metal_kernel, PlanOptions(partition_size=32))
    assert kernels.plan(meta, 8, 2).decode.num_parts > 1  # decode, reduce and prefill all run
    mx.export_function(str(tmp_path / "attention.mlxfn"),
                       lambda *a: kernels(*a, meta, scale), q, k, v)
    assert (tmp_path / "attention.mlxfn").stat().st_size > 0
