"""The tiled kernel's variant whose rows see up to a key of their own (`last_keys`: an image's
tokens seeing each other in a Gemma prefill), run by the MSL emulator against the pure-MLX
reference: how a step's rows are planned onto it, mutants of it that the comparison must
catch, and the dispatcher serving such steps with it. The grid of cases (fp16/bf16/fp32,
windows, soft-caps, sinks) runs in test_kernels.py (`cases.image_cases`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from markers import requires_emulator

from kernels_metal import attention, emulator, prefill
from kernels_metal.cases import DTYPES, Case, check, image_cases, make_inputs
from kernels_metal.paged import PagedAttentionKernels
from kernels_metal.plan import PlanOptions, build_plan
from kernels_metal.reference import paged_attention_reference

pytestmark = requires_emulator

# A decode row; a 40-row chunk on a cached prefix with an image across its query tiles and
# key tiles and one more near its end; a chunk that starts inside an image; a 3-row run
# whose first two rows are an image's.
REQUESTS = ((49, 1), (21, 40), (29, 20), (16, 3))
IMAGES = ((1, 6, 17), (1, 30, 9), (2, 0, 11), (3, 0, 2))


def emulated(case: Case, factory=emulator.metal_kernel) -> PagedAttentionKernels:
    return PagedAttentionKernels(factory, PlanOptions(partition_size=case.partition_size))


def test_the_grid_has_image_rows_in_every_dtype_with_every_option():
    cases = image_cases()
    assert {c.dtype for c in cases} == set(DTYPES)
    assert all(c.images for c in cases)
    assert any(c.window for c in cases) and any(c.softcap for c in cases)
    assert any(c.sinks for c in cases)


def test_requests_with_image_rows_go_to_the_tiled_kernel_with_their_last_keys():
    case = Case(mx.float32, 64, 16, 8, 2, REQUESTS, images=IMAGES)
    _, _, _, meta, _ = make_inputs(case)
    plan = build_plan(meta, 8, 2, PlanOptions())
    rows = np.array(plan.decode.rows)[: plan.decode.num_rows]
    np.testing.assert_array_equal(rows[:, 0], [0])  # the 3-row run left the per-token kernel
    tiles = np.array(plan.prefill.tiles)
    assert sorted(r for t in tiles for r in range(t[1], t[1] + t[3])) == list(range(1, 64))
    # A tile's keys reach its rows' last visible one, past its last row's position where an
    # image goes on: request 1's rows 0..15 (positions 21..36) see its first image to 43,
    # rows 16..31 its second image to 59.
    assert plan.prefill.block_q == 16
    keys = {int(t[1]): (int(t[5]), int(t[4] + t[3])) for t in tiles}
    assert keys[1] == (44, 37) and keys[17] == (60, 53) and keys[61] == (19, 19)
    assert np.array(plan.prefill.last_keys)[: len(meta.last_keys)].tolist() == (
        meta.last_keys.tolist())
    causal = build_plan(meta.causal, 8, 2, PlanOptions())
    assert causal.prefill.last_keys is None and causal.decode.num_rows == 4


def test_a_step_whose_rows_see_no_further_keeps_the_causal_kernel():
    case = Case(mx.float16, 64, 16, 8, 2, REQUESTS)
    q, k, v, meta, scale = make_inputs(case)
    plain = meta.with_last_keys(meta.positions.copy())  # last keys that add nothing
    kernels = emulated(case)
    plan = kernels.plan(plain, 8, 2)
    assert plan.prefill.last_keys is None
    assert kernels.prefill_kernel_for(plan) is kernels.prefill_kernel
    np.testing.assert_array_equal(np.array(kernels(q, k, v, plain, scale)),
                                  np.array(kernels(q, k, v, meta, scale)))


def mutated(old: str, new: str):
    """An emulator `metal_kernel` whose last-keys prefill kernel carries `new` for `old`."""
    assert old in prefill.LAST_KEYS_LIMITS

    def factory(**spec):
        if spec["name"] == "paged_attention_prefill_last_keys":
            spec["source"] = spec["source"].replace(old, new)
        return emulator.metal_kernel(**spec)
    return factory


MUTANTS = {  # what breaks: (old, new)
    "rows-see-their-own-position": ("? last_keys[q_start + r0 + fr] :", "? row_pos :"),
    "tile-loads-to-its-last-row": ("n_keys = info[5]", "n_keys = pos0 + nq"),
    "simdgroup-skips-by-position": ("sg_sees_to = simd_max(row_valid ? row_sees_to : -1)",
                                    "sg_sees_to = sg_last"),
    "tile-left-unmasked": ("simd_min(row_valid ? row_sees_to : (1 << 30))",
                           "simd_max(row_valid ? row_sees_to : -1)"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_broken_last_keys_kernel_fails_the_comparison(mutant):
    case = Case(mx.float32, 64, 16, 8, 2, REQUESTS, images=IMAGES)
    assert check(emulated(case), case).passed
    result = check(emulated(case, mutated(*MUTANTS[mutant])), case)
    assert not result.worst <= 10.0, f"{mutant}: only {result.worst:.2f}x the tolerance"


@pytest.fixture
def fresh_dispatch(monkeypatch):
    monkeypatch.setattr(attention, "_state", attention._Dispatch())
    return attention._state


def test_the_dispatcher_serves_image_rows_with_a_checked_variant_of_their_own(fresh_dispatch):
    case = Case(mx.bfloat16, 128, 16, 8, 2, REQUESTS, window=24, images=IMAGES)
    q, k, v, meta, scale = make_inputs(case)
    with attention.use_kernels(PagedAttentionKernels(emulator.metal_kernel), True):
        out = attention.paged_attention(q, k, v, meta, scale, window=24)
        attention.paged_attention(q, k, v, meta.causal, scale, window=24)
        passed = set(fresh_dispatch.active_verdicts.passed)
    assert {v.last_keys for v in passed} == {True, False}
    assert {v.name.endswith("-window-lastkeys") for v in passed} == {True, False}
    f32 = [x.astype(mx.float32) for x in (q, k, v)]
    expected = np.array(paged_attention_reference(*f32, meta, scale, 24))
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), expected, atol=8e-3, rtol=2e-2)
