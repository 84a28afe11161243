"""The kernel plan's launch choices: prefill configurations per head dim, and what they run."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from markers import requires_emulator

from kernels_metal import emulator
from kernels_metal.cases import Case, case_sinks, check, make_inputs
from kernels_metal.paged import PagedAttentionKernels
from kernels_metal.plan import (
    SPLIT_BELOW_THREADGROUPS,
    THREADGROUPS_PER_CORE,
    PlanOptions,
    build_plan,
    gpu_cores,
    params_for,
    prefill_config,
    run_plan,
    split_threshold,
)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("queries_per_kv", [1, 2, 3, 4, 6, 8, 12, 16])
def test_prefill_threadgroups_of_large_head_dims_have_at_most_4_simdgroups(
        head_dim, queries_per_kv):
    nh, chunks, block_q = prefill_config(queries_per_kv, head_dim)
    assert nh * block_q // 8 <= (4 if head_dim >= 192 else 8)
    assert (chunks - 1) * nh < queries_per_kv <= chunks * nh  # every head, no empty chunk
    assert block_q in (8, 16, 32)


def _tiled_rows(work) -> tuple[list[int], list[int]]:
    tiles = np.array(work.tiles)[: work.num_tiles]
    q_rows = sorted(r for t in tiles for r in range(t[1], t[1] + t[3]))
    out_rows = sorted(r for t in tiles for r in range(t[2], t[2] + t[3]))
    return q_rows, out_rows


def test_large_head_dims_tile_the_same_rows_in_smaller_blocks():
    case = Case(mx.float16, 256, 16, 8, 2, ((30, 1), (0, 40), (5, 70)))
    _, _, _, meta, _ = make_inputs(case)
    work = build_plan(meta, 8, 2, PlanOptions()).prefill
    assert work.for_head_dim(128) is work
    large = work.for_head_dim(256)
    assert large is work.for_head_dim(256)  # built once per step
    assert (large.heads_per_group, large.block_q) == (4, 8)
    simdgroups = large.heads_per_group * large.block_q // 8
    assert simdgroups <= 4 < work.heads_per_group * work.block_q // 8
    assert _tiled_rows(large) == _tiled_rows(work)


class RecordingFactory:
    """emulator.metal_kernel, remembering each kernel's threadgroup sizes."""

    def __init__(self):
        self.threadgroups: dict[str, list[int]] = {}

    def __call__(self, name, *args, **kwargs):
        kernel = emulator.metal_kernel(name, *args, **kwargs)
        sizes = self.threadgroups.setdefault(name, [])

        def call(**launch):
            sizes.append(int(np.prod(launch["threadgroup"])))
            return kernel(**launch)

        return call


@requires_emulator
@pytest.mark.parametrize("case", [
    Case(mx.float16, 256, 16, 8, 1, ((20, 12), (0, 1), (3, 30))),  # 2 chunks of 4 heads
    Case(mx.float32, 192, 32, 6, 3, ((40, 17), (9, 1))),
    Case(mx.bfloat16, 256, 32, 2, 2, ((0, 45),)),  # one head per KV head: 32-row blocks
], ids=lambda c: c.name)
def test_large_head_dim_prefill_runs_in_128_threads_and_matches_the_reference(case):
    factory = RecordingFactory()
    kernels = PagedAttentionKernels(factory, PlanOptions())
    result = check(kernels, case)
    assert result.passed, f"{case.name}: max error {result.max_error:g}"
    assert max(factory.threadgroups["paged_attention_prefill"]) <= 128


MERGE_CASES = [
    Case(mx.float16, 64, 16, 8, 2, ((150, 1), (40, 48), (9, 1), (0, 20)), 64),  # split decode
    Case(mx.bfloat16, 128, 32, 12, 1, ((70, 1), (0, 10), (5, 3))),  # two head chunks
    Case(mx.float32, 256, 16, 8, 2, ((30, 1), (12, 13), (45, 2))),  # large head dim config
    Case(mx.float16, 80, 16, 6, 2, ((200, 1), (90, 30)), None, window=24, softcap=30.0),
    Case(mx.float32, 64, 16, 4, 4, ((20, 1), (7, 1))),  # decodes only
    Case(mx.float32, 96, 32, 6, 3, ((0, 40), (16, 9))),  # prefill chunks only
    Case(mx.bfloat16, 64, 16, 8, 1, ((130, 1), (20, 40), (3, 1)), 32, window=48, sinks=True),
]


@requires_emulator
@pytest.mark.parametrize("case", MERGE_CASES, ids=lambda c: c.name)
def test_run_plan_writes_packed_rows_without_a_merge_and_agrees_bit_for_bit(case):
    kernels = PagedAttentionKernels(emulator.metal_kernel,
                                    PlanOptions(partition_size=case.partition_size))
    q, k, v, meta, scale = make_inputs(case, seed=2)
    sinks = case_sinks(case, seed=2)
    merged = kernels.plan(meta, q.shape[1], k.shape[2], case.window)
    params = params_for(merged, q.shape[1], k.shape[2], scale, case.softcap)
    got = run_plan(merged, kernels.decode_kernels, kernels.prefill_kernel, q, k, v, params,
                   sinks)
    expected = kernels(q, k, v, meta, scale, case.window, case.softcap, sinks)
    assert check(kernels, case, seed=2).passed
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)),
                                  np.array(expected.astype(mx.float32)))


@pytest.mark.skipif(not hasattr(mx, "export_function"), reason="needs mx.export_function")
def test_the_merged_launch_is_accepted_by_mlx_metal_kernel(tmp_path):
    """Tracing for export runs MLX's own metal_kernel argument checks without a GPU."""
    case = Case(mx.bfloat16, 256, 16, 8, 2, ((70, 1), (20, 19), (3, 2)))
    q, k, v, meta, scale = make_inputs(case)
    kernels = PagedAttentionKernels(mx.fast.metal_kernel, PlanOptions(partition_size=32))
    plan = kernels.plan(meta, 8, 2)
    params = params_for(plan, 8, 2, scale)
    assert plan.decode.num_parts > 1 and plan.prefill is not None

    def step(q, k, v):
        return run_plan(plan, kernels.decode_kernels, kernels.prefill_kernel, q, k, v, params)

    mx.export_function(str(tmp_path / "merged.mlxfn"), step, q, k, v)
    assert (tmp_path / "merged.mlxfn").stat().st_size > 0


@pytest.mark.parametrize(("info", "cores"), [
    ({"device_name": "Apple M3 Max", "architecture": "applegpu_g15s"}, 32),
    ({"device_name": "Apple M2 Ultra"}, 64),
    ({"device_name": "Apple M4 Pro"}, 16),
    ({"device_name": "Apple M1"}, 10),
    ({"architecture": "applegpu_g14c"}, 32),
    ({"device_name": "Apple M5", "gpu_core_count": 12}, 12),
    ({"device_name": "AMD EPYC", "architecture": "x86_64"}, None),
    ({}, None),
])
def test_gpu_cores_from_device_info(info, cores):
    assert gpu_cores(info) == cores
    assert split_threshold(info) == (SPLIT_BELOW_THREADGROUPS if cores is None else 4 * cores)


def test_the_split_threshold_decides_when_long_decodes_are_partitioned():
    _, _, _, meta, _ = make_inputs(Case(mx.float16, 64, 16, 8, 2, ((1500, 1), (900, 1))))
    parts = {threshold: build_plan(meta, 8, 2, PlanOptions(split_below_threadgroups=threshold))
             .decode.num_parts for threshold in (4, 5, 64)}
    assert parts == {4: 1, 5: 3, 64: 3}  # 2 rows x 2 KV heads = 4 threadgroups unsplit
    assert PlanOptions(split_below_threadgroups=7).with_partition(32).split_below_threadgroups == 7
    if not mx.metal.is_available():  # no device to ask: the constant
        assert split_threshold() == SPLIT_BELOW_THREADGROUPS
    else:  # a Mac's GPU says its name, hence its cores
        assert split_threshold() == THREADGROUPS_PER_CORE * gpu_cores(mx.device_info())
