"""The attention dispatcher: numpy path on the CPU backend, reference for what it does not
take, kernels when told, one warning on failure."""

from __future__ import annotations

import logging
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from kernels_metal import attention
from kernels_metal.cases import Case, check, make_inputs
from kernels_metal.cpu.attention import paged_attention_cpu
from kernels_metal.paged import PagedAttentionKernels
from kernels_metal.reference import paged_attention_reference

CASE = Case(mx.float32, 64, 16, 6, 2, ((20, 1), (0, 12)))


@pytest.fixture
def fresh_dispatch(monkeypatch):
    monkeypatch.setattr(attention, "_state", attention._Dispatch())
    return attention._state


class RecordingKernels:
    """Kernels (their `prepare` interface) that are the reference, counting layer calls."""

    def __init__(self):
        self.calls = 0

    def prepare(self, q, k_pool, meta, scale, window=None, softcap=None, value_dim=None):
        def launch(q, k_pool, v_pool, sinks=None):
            self.calls += 1
            self.sinks = sinks
            return paged_attention_reference(q, k_pool, v_pool, meta, scale, window, softcap,
                                             sinks)
        return launch


@pytest.mark.skipif(mx.metal.is_available(), reason="on Metal the kernels serve these calls "
                    "(test_on_metal_the_kernels_serve_every_dtype)")
def test_off_metal_the_cpu_path_serves_and_the_reference_takes_bfloat16(fresh_dispatch):
    q, k, v, meta, scale = make_inputs(CASE)
    np.testing.assert_array_equal(np.array(attention.paged_attention(q, k, v, meta, scale)),
                                  np.array(paged_attention_cpu(q, k, v, meta, scale)))
    q, k, v, meta, scale = make_inputs(Case(mx.bfloat16, 64, 16, 6, 2, ((20, 1),)))
    np.testing.assert_array_equal(
        np.array(attention.paged_attention(q, k, v, meta, scale).astype(mx.float32)),
        np.array(paged_attention_reference(q, k, v, meta, scale).astype(mx.float32)))
    assert fresh_dispatch.kernels is None


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Apple Silicon's Metal GPU")
def test_on_metal_the_kernels_serve_every_dtype(fresh_dispatch):
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        case = Case(dtype, 64, 16, 6, 2, ((20, 1), (0, 12)))
        assert check(attention.paged_attention, case).passed
    assert fresh_dispatch.kernels is not None and not attention.kernel_fallbacks()
    assert {v.dtype for v in fresh_dispatch.verdicts.passed} == {mx.float32, mx.float16,
                                                                 mx.bfloat16}


def test_sinks_reach_every_backend_and_must_be_one_per_query_head(fresh_dispatch):
    q, k, v, meta, scale = make_inputs(CASE)
    sinks = mx.array([0.5, 3.0, -1.0, 2.0, 0.0, 6.0])
    expected = np.array(paged_attention_reference(q, k, v, meta, scale, 7, sinks=sinks))
    np.testing.assert_allclose(np.array(attention.paged_attention(q, k, v, meta, scale, 7,
                                                                  sinks=sinks)),
                               expected, atol=1e-5, rtol=1e-5)  # the CPU path
    kernels = RecordingKernels()
    with attention.use_kernels(kernels):
        out = attention.paged_attention(q, k, v, meta, scale, window=7, sinks=sinks)
    assert kernels.sinks is sinks
    np.testing.assert_array_equal(np.array(out), expected)
    with pytest.raises(ValueError, match=r"one logit per query head: \(6,\)"):
        attention.paged_attention(q, k, v, meta, scale, sinks=mx.zeros((2,)))


def test_use_kernels_routes_supported_calls_only(fresh_dispatch):
    kernels = RecordingKernels()
    q, k, v, meta, scale = make_inputs(CASE)
    with attention.use_kernels(kernels):
        attention.paged_attention(q, k, v, meta, scale)
        odd = Case(mx.float32, 12, 16, 6, 2, ((20, 1),))  # head_dim 12: not a multiple of 8
        attention.paged_attention(*make_inputs(odd))
    attention.paged_attention(q, k, v, meta, scale)
    assert kernels.calls == 1


def test_a_step_whose_image_rows_see_ahead_goes_to_the_kernels(fresh_dispatch):
    """`meta.last_keys` (an image's tokens seeing each other) reaches the kernels, which
    read it (test_kernels_last_keys.py); the same rows without it too."""
    kernels = RecordingKernels()
    q, k, v, meta, scale = make_inputs(CASE)
    last_keys = meta.positions.copy()
    last_keys[3:7] = last_keys[6]  # rows 3..6 of the 12-token chunk: one image
    extended = meta.with_last_keys(last_keys)
    with attention.use_kernels(kernels):
        out = attention.paged_attention(q, k, v, extended, scale)
        assert kernels.calls == 1
        attention.paged_attention(q, k, v, extended.causal, scale)
        assert kernels.calls == 2
    np.testing.assert_allclose(np.array(out),
                               np.array(paged_attention_reference(q, k, v, extended, scale)),
                               atol=1e-5, rtol=1e-5)


def test_a_kernel_that_fails_on_first_use_warns_once_then_reference(
        fresh_dispatch, monkeypatch, caplog):
    def broken_metal_kernel(**_):
        def launch(**__):
            raise RuntimeError("Unable to build metal library from source")
        return launch

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(attention, "on_cpu", lambda: False)  # a Mac's default device: the GPU
    monkeypatch.setattr(attention, "PagedAttentionKernels",
                        lambda metal_kernel=None, options=None:
                        PagedAttentionKernels(broken_metal_kernel, options))
    q, k, v, meta, scale = make_inputs(CASE)
    expected = np.array(paged_attention_reference(q, k, v, meta, scale))
    with caplog.at_level(logging.WARNING, logger="kernels_metal.attention"):
        for _ in range(3):
            out = attention.paged_attention(q, k, v, meta, scale)
            np.testing.assert_array_equal(np.array(out), expected)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Unable to build metal library" in warnings[0].getMessage()
    assert "Unable to build" in attention.kernels_disabled_reason()


def test_importing_kernels_needs_no_compiler():
    code = ("import sys, kernels_metal.attention, kernels_metal.paged; "
            "assert not any(m.startswith('kernels_metal.emulator') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
