"""The kernel plan's launch choices: prefill configurations per head dim, and what they run."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from markers import requires_emulator

from kernels_metal import emulator
from kernels_metal.cases import Case, check, make_inputs
from kernels_metal.paged import PagedAttentionKernels
from kernels_metal.plan import PlanOptions, build_plan, prefill_config


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
