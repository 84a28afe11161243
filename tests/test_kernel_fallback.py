"""Fallback per variant: the emulated kernels through the dispatcher, as on a Mac.

A failure planted in one variant's kernel (wrong values, MLX refusing a threadgroup above the
pipeline's limit, a launch that raises after the first-use check) sends that variant alone to
the reference, with one warning naming it; every other variant stays on the kernels.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from markers import requires_emulator

from kernels_metal import attention, emulator
from kernels_metal.attention import Variant, variant_of
from kernels_metal.cases import (
    DTYPES,
    HEAD_DIMS,
    KV_BITS,
    TOLERANCE,
    Case,
    case_sinks,
    float_pool,
    make_inputs,
)
from kernels_metal.kv_quant import QuantizedPool
from kernels_metal.paged import PagedAttentionKernels
from kernels_metal.reference import paged_attention_reference

pytestmark = requires_emulator

PREFILL, DECODE = "paged_attention_prefill", "paged_attention_decode"
REDUCE = "paged_attention_reduce"
MLX_THREAD_LIMIT = ("Thread group size ({}) is greater than  the maximum allowed threads per "
                    "threadgroup ({}).")  # MLX's custom_kernel.cpp, word for word


def planted(kernel_name: str, when, effect):
    """An emulator `metal_kernel` whose `kernel_name` launches selected by `when` misbehave."""
    def factory(**spec):
        kernel = emulator.metal_kernel(**spec)
        if spec["name"] != kernel_name:
            return kernel

        def launch(**call):
            if when(dict(call.get("template") or ()), call):
                return effect(kernel, call)
            return kernel(**call)
        return launch
    return factory


def scaled_output(kernel, call):
    return [out * 1.05 for out in kernel(**call)]


def refused_by_thread_limit(kernel, call):
    threads = int(np.prod(call["threadgroup"]))
    raise ValueError(MLX_THREAD_LIMIT.format(threads, threads - 32))


def raising(message: str):
    def effect(kernel, call):
        raise RuntimeError(message)
    return effect


def without_sinks(kernel, call):
    """Launch with every sink at -FLT_MAX: a kernel that ignores the layer's sinks."""
    inputs = call["inputs"]
    ignored = mx.full(inputs[-1].shape, -np.finfo(np.float32).max)
    return kernel(**{**call, "inputs": [*inputs[:-1], ignored]})


def without_param(index: int):
    """Launch with params[index] zeroed: a kernel that ignores the window (10) / soft-cap (11)."""
    def effect(kernel, call):
        inputs = list(call["inputs"])
        at = kernel.input_names.index("params")
        params = np.array(inputs[at])
        params[index] = 0
        inputs[at] = mx.array(params)
        return kernel(**{**call, "inputs": inputs})
    return effect


class RecordingKernels(PagedAttentionKernels):
    """Emulated kernels that remember which variant served which step (by its metadata)."""

    def __init__(self, metal_kernel):
        super().__init__(metal_kernel)
        self.served: list[tuple[Variant, object]] = []

    def prepare(self, q, k_pool, meta, scale, window=None, softcap=None, value_dim=None):
        launch = super().prepare(q, k_pool, meta, scale, window, softcap, value_dim)

        def served(*args):
            out = launch(*args)  # recorded once it launched
            self.served.append((variant_of(q, k_pool, window, softcap), meta))
            return out
        return served


@pytest.fixture
def dispatch(monkeypatch):
    """A fresh dispatcher on a Mac's default device (the fallback is the MLX reference), and
    the variants the reference served, by step metadata."""
    monkeypatch.setattr(attention, "_state", attention._Dispatch())
    monkeypatch.setattr(attention, "on_cpu", lambda: False)
    served: list[tuple[Variant, object]] = []

    def recording_reference(q, k_pool, v_pool, meta, scale, window=None, softcap=None,
                            sinks=None):
        served.append((variant_of(q, k_pool, window, softcap, sinks), meta))
        if isinstance(k_pool, QuantizedPool):  # dequantized here until reference.py takes them
            k_pool, v_pool = float_pool(k_pool, q.dtype), float_pool(v_pool, q.dtype)
        return paged_attention_reference(q, k_pool, v_pool, meta, scale, window, softcap, sinks)

    monkeypatch.setattr(attention, "paged_attention_reference", recording_reference)
    return served


def mixed_step(dtype, head_dim, heads=8, kv=2, window=None, softcap=None, bs=16,
               sinks=False, kv_bits=None) -> Case:
    requests = ((5 * bs + 3, 1), (bs - 1, 1), (bs + 5, 19), (0, 11))
    return Case(dtype, head_dim, bs, heads, kv, requests, window=window, softcap=softcap,
                sinks=sinks, kv_bits=kv_bits)


def run_step(case: Case, seed: int = 1):
    """Serve the case through the dispatcher; check it against the fp32 reference."""
    q, k, v, meta, scale = make_inputs(case, seed)
    sinks = case_sinks(case, seed)
    out = attention.paged_attention(q, k, v, meta, scale, case.window, case.softcap, sinks)
    f32 = [q.astype(mx.float32), float_pool(k, q.dtype), float_pool(v, q.dtype)]
    expected = np.array(paged_attention_reference(*f32, meta, scale, case.window, case.softcap,
                                                  sinks))
    atol, rtol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), expected, atol=atol, rtol=rtol)
    return meta, variant_of(q, k, case.window, case.softcap, sinks)


def serve(steps: list[Case], kernels: RecordingKernels, reference_served, caplog):
    """Each step twice through the dispatcher: {variant: 'kernels' | 'reference'}, warnings."""
    backends = {}
    with (caplog.at_level(logging.WARNING, logger="kernels_metal.attention"),
          attention.use_kernels(kernels, first_use_check=True)):
        for case in steps * 2:
            meta, variant = run_step(case)
            on_kernels = any(m is meta for _, m in kernels.served)
            on_reference = any(m is meta for _, m in reference_served)
            assert on_kernels != on_reference, case.name
            assert backends.setdefault(variant, on_kernels) == on_kernels, "route changed"
        fallbacks = attention.kernel_fallbacks()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    return {v: "kernels" if k else "reference" for v, k in backends.items()}, fallbacks, warnings


HEALTHY = [
    mixed_step(mx.float32, 64),
    mixed_step(mx.float16, 256, window=21, softcap=50.0),
    mixed_step(mx.bfloat16, 256, heads=6, kv=2),
    mixed_step(mx.float16, 128, heads=4, kv=4, window=9),
    mixed_step(mx.bfloat16, 64, heads=8, kv=1, window=21, sinks=True),
]


def test_a_wrong_head_dim_256_prefill_kernel_sends_only_its_variant_to_the_reference(
        dispatch, caplog):
    fp32_d256 = planted(PREFILL, lambda t, _: t["D"] == 256 and t["T"] == mx.float32,
                        scaled_output)
    kernels = RecordingKernels(fp32_d256)
    broken = mixed_step(mx.float32, 256)
    backends, fallbacks, warnings = serve([broken, *HEALTHY], kernels, dispatch, caplog)
    broken_variant = Variant(mx.float32, 256, 16, 8, 2)
    assert backends.pop(broken_variant) == "reference"
    assert len(backends) == len(HEALTHY) and set(backends.values()) == {"kernels"}
    assert list(fallbacks) == [broken_variant] and "wrong result" in fallbacks[broken_variant]
    assert len(warnings) == 1 and broken_variant.name in warnings[0]
    assert "wrong result" in warnings[0]
    assert attention.kernels_disabled_reason() is None  # the verdicts ended with the context


def test_a_wrong_int4_kernel_sends_only_the_int4_variant_to_the_reference(dispatch, caplog):
    """The same shape over float, int8 and int4 pools: three variants, judged apart."""
    int4 = planted(DECODE, lambda t, _: t["KV_BITS"] == 4, scaled_output)
    steps = [mixed_step(mx.float16, 128, kv_bits=bits) for bits in (None, *KV_BITS)]
    backends, fallbacks, warnings = serve(steps, RecordingKernels(int4), dispatch, caplog)
    broken = Variant(mx.float16, 128, 16, 8, 2, kv_bits=4)
    assert backends == {Variant(mx.float16, 128, 16, 8, 2): "kernels",
                        Variant(mx.float16, 128, 16, 8, 2, kv_bits=8): "kernels",
                        broken: "reference"}
    assert list(fallbacks) == [broken] and "wrong result" in fallbacks[broken]
    assert len(warnings) == 1 and "float16-kv4-d128-bs16-h8kv2" in warnings[0]


def test_a_pipeline_thread_limit_below_the_threadgroup_falls_back_that_variant(
        dispatch, caplog):
    """MLX refuses a launch above the pipeline's maxTotalThreadsPerThreadgroup."""
    kernels = RecordingKernels(planted(PREFILL, lambda t, _: t["D"] == 256 and
                                       t["T"] == mx.bfloat16, refused_by_thread_limit))
    refused = mixed_step(mx.bfloat16, 256, heads=8, kv=1)
    backends, fallbacks, warnings = serve([refused, *HEALTHY[:2]], kernels, dispatch, caplog)
    variant = Variant(mx.bfloat16, 256, 16, 8, 1)
    assert backends.pop(variant) == "reference"
    assert len(backends) == 2 and set(backends.values()) == {"kernels"}
    assert "maximum allowed threads per threadgroup" in fallbacks[variant]
    assert len(warnings) == 1 and variant.name in warnings[0]


OPTION_VALUES = {"softcap": 30.0, "window": 40, "sinks": True}
VARIANT_FLAGS = {"softcap": "softcapped", "window": "windowed", "sinks": "with_sinks"}


@pytest.mark.parametrize(("kernel", "effect", "option"), [
    (DECODE, without_param(11), "softcap"),  # the decode kernel drops the soft-cap
    (PREFILL, without_param(10), "window"),  # the tiled kernel drops the window
    (DECODE, without_sinks, "sinks"),  # the decode kernel drops the sinks
    (PREFILL, without_sinks, "sinks"),  # the tiled kernel drops them
    (REDUCE, without_sinks, "sinks"),  # the reduce drops them (split rows only)
])
def test_the_first_use_check_covers_windows_softcap_and_sinks(dispatch, caplog, kernel, effect,
                                                              option):
    """A kernel that ignores an option fails only the variants that use it."""
    kernels = RecordingKernels(planted(kernel, lambda *_: True, effect))
    plain = mixed_step(mx.float32, 96)
    with_option = mixed_step(mx.float32, 96, **{option: OPTION_VALUES[option]})
    backends, fallbacks, warnings = serve([plain, with_option], kernels, dispatch, caplog)
    plain_variant, option_variant = list(backends)
    assert getattr(option_variant, VARIANT_FLAGS[option])
    assert backends == {plain_variant: "kernels", option_variant: "reference"}
    assert list(fallbacks) == [option_variant] and len(warnings) == 1


def test_a_launch_that_raises_after_the_check_falls_back_on_that_call(dispatch, caplog):
    """The first-use step is small; a larger step's launch raises: that call and the variant's
    later ones go to the reference, one warning."""
    many_rows = planted(PREFILL, lambda _, call: call["inputs"][0].shape[0] > 64,
                        raising("[metal] launch failed"))
    kernels = RecordingKernels(many_rows)
    small, large = mixed_step(mx.float16, 64), Case(mx.float16, 64, 16, 8, 2, ((10, 80),))
    with (caplog.at_level(logging.WARNING, logger="kernels_metal.attention"),
          attention.use_kernels(kernels, first_use_check=True)):
        steps = [run_step(small)[0], run_step(large)[0], run_step(small, seed=2)[0]]
        variant = variant_of(*make_inputs(small)[:2])
        reason = attention.kernels_disabled_reason(variant)
    on_kernels = [i for i, meta in enumerate(steps) if any(m is meta for _, m in kernels.served)]
    on_reference = [i for i, meta in enumerate(steps) if any(m is meta for _, m in dispatch)]
    assert on_kernels == [0] and on_reference == [1, 2]
    assert reason == "RuntimeError: [metal] launch failed"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and variant.name in warnings[0].getMessage()


def test_unchecked_kernels_raise_instead_of_falling_back(dispatch):
    """`use_kernels` without the check is how tests prove the kernels: errors must surface."""
    fail_all = planted(PREFILL, lambda *_: True, raising("planted"))
    with attention.use_kernels(RecordingKernels(fail_all)), pytest.raises(RuntimeError):
        run_step(mixed_step(mx.float32, 64))
    assert not dispatch


VARIANTS = [
    Variant(dtype, d, bs, heads, kv, windowed, softcapped, i % 2 == 0)
    for i, (dtype, d) in enumerate((dt, d) for dt in DTYPES for d in HEAD_DIMS)
    for bs, (heads, kv) in [((16, 32)[i % 2], ((8, 2), (6, 2), (4, 4), (8, 1))[i % 4])]
    for windowed, softcapped in [(i % 3 == 1, i % 3 == 2)] + [(True, True)] * (d == 256)
] + [Variant(dtype, 64, 16, 16, 2, windowed=True, with_sinks=True) for dtype in DTYPES] + [
    Variant(mx.float16, 80, 16, 8, 2, kv_bits=8),
    Variant(mx.bfloat16, 128, 32, 6, 2, windowed=True, kv_bits=8),
    Variant(mx.float32, 256, 16, 8, 1, softcapped=True, with_sinks=True, kv_bits=8),
    Variant(mx.float16, 80, 32, 8, 2, with_sinks=True, kv_bits=4),  # 8-byte loads of codes
    Variant(mx.bfloat16, 128, 16, 6, 2, windowed=True, softcapped=True, kv_bits=4),
    Variant(mx.float32, 256, 32, 8, 1, windowed=True, kv_bits=4),
] + [Variant(dtype, 256, 16, 8, 4, windowed=i == 0, kv_bits=(None, 8)[i // 2], last_keys=True)
     for i, dtype in enumerate(DTYPES)]  # Gemma 3's image prefill


def test_the_variant_list_covers_head_dim_256_with_window_and_softcap_and_sinks():
    assert {(v.dtype, v.head_dim) for v in VARIANTS} == {(t, d) for t in DTYPES for d in HEAD_DIMS}
    assert {(v.kv_bits, v.dtype) for v in VARIANTS if v.kv_bits} == {
        (b, t) for b in KV_BITS for t in DTYPES}
    assert {v.dtype for v in VARIANTS if v.head_dim == 256 and v.windowed and v.softcapped} == set(
        DTYPES)
    assert {v.dtype for v in VARIANTS if v.windowed and v.with_sinks} == set(DTYPES)
    assert {v.dtype for v in VARIANTS if v.with_sinks and not v.windowed} == set(DTYPES)
    assert {v.dtype for v in VARIANTS if v.last_keys} == set(DTYPES)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_every_variant_passes_its_first_use_check_on_the_emulator(variant):
    kernels = PagedAttentionKernels(emulator.metal_kernel)
    assert attention.check_variant(kernels, variant) is None
