"""The gated delta rule's Metal kernel, run by the MSL emulator, against the pure-MLX reference;
and the dispatcher the Gated DeltaNet layer calls.

Each case packs several requests into one step (decode rows, short runs and prefill chunks of
64, 65 and 130 rows, an idle request) from non-zero initial states, and is checked per element
against the recurrent reference in fp32 on the same rounded inputs (kernels_metal.gated_delta:
output (atol, rtol) fp32 (1e-5, 1e-5), fp16 (1e-4, 1e-3), bf16 (1e-3, 8e-3); the float32
state (1e-5, 1e-5) in every dtype).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from markers import requires_emulator

from kernels_metal import emulator
from kernels_metal import gated_delta as gd
from kernels_metal.gated_delta import GatedDeltaKernel, Variant, random_problem, worst_error
from metal_engine.models import gated_delta_rule as reference
from metal_engine.models.gated_delta import GatedDeltaNet, GatedDeltaNetConfig

pytestmark = requires_emulator

F32, F16, BF16 = mx.float32, mx.float16, mx.bfloat16
MIXED = (1, 3, 64, 1, 65, 130, 0)  # decodes, a short run, chunks at and across 64 rows, idle
SHORT = (1, 3, 1, 9, 0, 2)
DECODE = (1,) * 8

# (variant, rows per request). Head dims 128 take Hv = 2 on long steps: the emulator runs
# the 1024 threads of a head one at a time, row after row.
CASES = [
    *((Variant(dtype, 32, 32, 2, 4, True), MIXED) for dtype in (F32, F16, BF16)),
    *((Variant(dtype, 64, 64, 1, 3, True), MIXED) for dtype in (F32, F16, BF16)),
    *((Variant(dtype, 128, 128, 2, 4, True), SHORT) for dtype in (F32, F16, BF16)),
    (Variant(F32, 128, 128, 1, 2, True), (1, 3, 65, 1)),
    (Variant(BF16, 128, 128, 1, 2, True), MIXED),
    (Variant(BF16, 128, 128, 2, 4, True), DECODE),
    (Variant(F16, 64, 64, 4, 4, True), DECODE),
    (Variant(F32, 16, 24, 1, 3, True), MIXED),  # 24 columns: a partial simdgroup
    (Variant(F16, 96, 64, 2, 2, True), SHORT),  # Dk not a power of two
    (Variant(BF16, 64, 128, 2, 4, True), SHORT),
    (Variant(F32, 128, 64, 1, 4, True), SHORT),
    (Variant(F32, 256, 256, 1, 1, True), (1, 3, 2)),
    (Variant(F32, 64, 64, 2, 4, False), SHORT),  # q, k normalized by the caller
    (Variant(BF16, 128, 128, 2, 2, False), SHORT),
]


def _name(case) -> str:
    variant, lens = case
    return f"{variant.name}-[{'+'.join(map(str, lens))}]"


@pytest.fixture(scope="module")
def kernel() -> GatedDeltaKernel:
    return GatedDeltaKernel(emulator.metal_kernel)


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_kernel_matches_reference(kernel, case):
    variant, lens = case
    problem = random_problem(variant, lens, seed=len(lens))
    worst = worst_error(kernel(*problem, variant.normalize_qk), problem, variant.normalize_qk)
    assert worst <= 1.0, f"{_name(case)}: {worst:.3g}x the tolerance"


def test_grid_covers_the_required_shapes():
    variants = [v for v, _ in CASES]
    assert {v.dtype for v in variants} == {F32, F16, BF16}
    assert {v.key_dim for v in variants} >= {32, 64, 128}
    assert {v.value_heads // v.key_heads for v in variants} >= {1, 2, 3, 4}
    rows = {n for _, lens in CASES for n in lens}
    assert rows >= {0, 1, 3, 64, 65, 130}
    assert any(not v.normalize_qk for v in variants)


def test_kernel_matches_the_chunked_form_the_model_used(kernel):
    """Against the reference dispatcher itself (chunked for runs, across 64-row chunks)."""
    variant = Variant(F32, 64, 64, 1, 2, True)
    problem = random_problem(variant, MIXED, seed=1)
    got = kernel(*problem)
    want = reference.gated_delta_rule(*problem)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4, rtol=1e-4)


MUTANTS = {
    "no-decay": ("s[i] *= decay;", ""),
    "no-beta": (" * beta[gh]", ""),
    "wrong-key-head": ("hv / (HV / HK)", "hv % HK"),
    "no-l2-norm": ("q_norm = metal::precise::rsqrt(qq + EPS);", ""),
    "state-not-written": ("state_out[s_base + long(d) * DV] = s[i];",
                          "state_out[s_base + long(d) * DV] = state_in[s_base + long(d) * DV];"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_broken_kernel_fails_the_comparison(mutant):
    old, new = MUTANTS[mutant]
    assert old in gd.SCAN_SOURCE
    broken = GatedDeltaKernel(emulator.metal_kernel, gd.SCAN_SOURCE.replace(old, new))
    variant = Variant(F32, 32, 32, 2, 4, True)
    problem = random_problem(variant, SHORT)
    assert worst_error(broken(*problem), problem) > 10.0


# ---- dispatch ----

class Spy:
    """A kernel that counts its calls."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, 0

    def __call__(self, *args):
        self.calls += 1
        return self.kernel(*args)


def _layer(seed: int = 0) -> tuple[GatedDeltaNet, tuple]:
    cfg = GatedDeltaNetConfig(hidden_size=48, num_key_heads=1, num_value_heads=2,
                              key_head_dim=32, value_head_dim=16)
    mx.random.seed(seed)
    net = GatedDeltaNet(cfg)
    lens = np.array([1, 6, 2])
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    conv, state = net.zero_states(len(lens))
    x = mx.random.normal((int(cu[-1]), cfg.hidden_size))
    return net, (x, cu, conv, state + 0.5)


def test_the_layer_runs_on_the_kernel(kernel):
    net, inputs = _layer()
    expected = net(*inputs)  # off Metal: the reference
    spy = Spy(kernel)
    with gd.use_kernel(spy, first_use_check=True):
        got = net(*inputs)
    assert spy.calls >= 2 and not gd.kernel_fallbacks()  # the check, then the layer's call
    np.testing.assert_allclose(np.array(got.out), np.array(expected.out), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(got.recurrent_state),
                               np.array(expected.recurrent_state), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(mx.metal.is_available(), reason="on Metal the kernel serves "
                    "(test_on_metal_the_dispatcher_serves_the_kernel)")
def test_off_metal_the_dispatcher_is_the_reference():
    problem = random_problem(Variant(F16, 32, 32, 1, 2, True), SHORT)
    got, want = gd.gated_delta_rule(*problem), reference.gated_delta_rule(*problem)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Apple Silicon's Metal GPU")
def test_on_metal_the_dispatcher_serves_the_kernel(monkeypatch):
    monkeypatch.setattr(gd, "_state", gd._Dispatch())
    variant = Variant(F16, 128, 128, 2, 4, True)
    problem = random_problem(variant, MIXED)
    assert worst_error(gd.gated_delta_rule(*problem), problem) <= 1.0
    assert gd._state.kernel is not None and gd._state.passed == {variant}
    assert not gd.kernel_fallbacks()


def test_a_failing_variant_falls_back_alone(caplog):
    """A kernel that mixes up key heads fails on GQA variants only; those fall back to the
    reference with one warning, the variant without GQA stays on the kernel."""
    broken = Spy(GatedDeltaKernel(emulator.metal_kernel,
                                  gd.SCAN_SOURCE.replace("hv / (HV / HK)", "hv % HK")))
    gqa, plain = Variant(F32, 32, 32, 2, 4, True), Variant(F32, 32, 32, 2, 2, True)
    with gd.use_kernel(broken, first_use_check=True), caplog.at_level(logging.WARNING):
        for _ in range(2):
            problem = random_problem(gqa, SHORT)
            assert worst_error(gd.gated_delta_rule(*problem), problem) <= 1.0
        calls = broken.calls
        problem = random_problem(plain, SHORT)
        assert worst_error(gd.gated_delta_rule(*problem), problem) <= 1.0
        assert broken.calls == calls + 2  # its check, then the call itself
        assert list(gd.kernel_fallbacks()) == [gqa]
        assert "wrong result" in gd.kernel_fallbacks()[gqa]
    assert calls == 1  # the failed check; the second GQA call did not retry
    warnings = [r.message for r in caplog.records if r.name == gd.log.name]
    assert len(warnings) == 1 and gqa.name in warnings[0]
    assert not gd.kernel_fallbacks()  # verdicts of the override end with it


def test_a_kernel_that_raises_falls_back_or_propagates_when_unchecked():
    def raising(*args):
        raise RuntimeError("Unable to build the pipeline")

    variant = Variant(BF16, 32, 32, 1, 2, True)
    problem = random_problem(variant, SHORT)
    with gd.use_kernel(raising, first_use_check=True):
        assert worst_error(gd.gated_delta_rule(*problem), problem) <= 1.0
        assert "Unable to build" in gd.kernel_fallbacks()[variant]
    with gd.use_kernel(raising), pytest.raises(RuntimeError, match="Unable to build"):
        gd.gated_delta_rule(*problem)


def test_unsupported_calls_go_to_the_reference(kernel):
    spy = Spy(kernel)
    mixed_dtypes = random_problem(Variant(F16, 32, 32, 1, 2, True), SHORT)
    mixed_dtypes = (mixed_dtypes[0].astype(F32), *mixed_dtypes[1:])
    wide_keys = random_problem(Variant(F16, 264, 8, 1, 2, True), SHORT)
    with gd.use_kernel(spy):
        for problem in (mixed_dtypes, wide_keys):
            assert gd.unsupported_reason(*problem[:3]) is not None
            assert worst_error(gd.gated_delta_rule(*problem), problem) <= 1.0
    assert spy.calls == 0


@pytest.mark.skipif(not hasattr(mx, "export_function"), reason="needs mx.export_function")
def test_launches_are_accepted_by_mlx_metal_kernel(tmp_path):
    """Tracing for export runs MLX's own metal_kernel argument checks without a GPU."""
    kernel = GatedDeltaKernel(mx.fast.metal_kernel)
    q, k, v, g, beta, cu, state = random_problem(Variant(BF16, 128, 128, 2, 4, True), SHORT)
    path = str(tmp_path / "gated_delta.mlxfn")
    mx.export_function(path, lambda *a: tuple(kernel(*a[:5], cu, a[5])), q, k, v, g, beta, state)
    assert (tmp_path / "gated_delta.mlxfn").stat().st_size > 0
