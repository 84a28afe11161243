"""The CPU fast paths of exp, softmax, gated activations, soft-capping and linear agree with
MLX's own ops."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx import nn

from kernels_metal.cpu import math as cpu_math


def test_exp_relative_error_is_below_1e_6_over_the_normal_float_range():
    x = mx.array(np.linspace(-86, 88, 100_001, dtype=np.float32))
    got, want = np.array(cpu_math.exp(x)), np.exp(np.array(x, dtype=np.float64))
    assert np.max(np.abs(got - want) / want) < 1e-6


def test_exp_flushes_denormal_results_to_zero_and_overflows_like_mlx():
    got = np.array(cpu_math.exp(mx.array([-90.0, -1e4, -mx.inf, 1e4], dtype=mx.float32)))
    assert list(got[:3]) == [0.0, 0.0, 0.0] and got[3] == np.inf


def test_softmax_and_silu_mul_match_mlx():
    rng = np.random.default_rng(0)
    x = mx.array(rng.normal(size=(7, 3, 130)).astype(np.float32) * 10)
    x = mx.where(mx.array(rng.random((7, 3, 130)) < 0.3), -mx.inf, x)  # masked entries
    np.testing.assert_allclose(cpu_math.softmax(x), mx.softmax(x, axis=-1), atol=1e-6)
    gate, up = (mx.array(rng.normal(size=(5, 64)).astype(np.float32) * 6) for _ in range(2))
    np.testing.assert_allclose(cpu_math.silu_mul(gate, up), nn.silu(gate) * up, rtol=1e-5,
                               atol=1e-6)


def test_masked_softmax_gives_masked_entries_exactly_zero():
    rng = np.random.default_rng(1)
    x = mx.array(rng.normal(size=(4, 2, 50)).astype(np.float32) * 5)
    mask = mx.array(rng.random((4, 1, 50)) < 0.6)
    got = np.array(cpu_math.masked_softmax(x, mask))
    want = np.array(mx.softmax(mx.where(mask, x, -mx.inf), axis=-1))
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert (got[np.broadcast_to(~np.array(mask), got.shape)] == 0).all()


def test_linear_matches_mlx_for_one_row_few_and_many_with_and_without_bias():
    rng = np.random.default_rng(2)
    weight, bias = mx.array(rng.normal(size=(48, 32)).astype(np.float32)), mx.arange(48.0)
    for rows in (1, 2, 5, 72):
        x = mx.array(rng.normal(size=(rows, 32)).astype(np.float32))
        np.testing.assert_allclose(cpu_math.linear(x, weight), x @ weight.T, rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_allclose(cpu_math.linear(x, weight, bias), x @ weight.T + bias,
                                   rtol=1e-5, atol=1e-5)


def test_gelu_tanh_mul_and_softcap_match_mlx():
    rng = np.random.default_rng(3)
    gate, up = (mx.array(rng.normal(size=(5, 64)).astype(np.float32) * 4) for _ in range(2))
    np.testing.assert_allclose(cpu_math.gelu_tanh_mul(gate, up), nn.gelu_approx(gate) * up,
                               rtol=1e-5, atol=1e-6)
    x = mx.array(rng.normal(size=(3, 70)).astype(np.float32) * 80)
    got = np.array(cpu_math.tanh_softcap(x, 30.0))
    np.testing.assert_allclose(got, np.array(mx.tanh(x / 30.0) * 30.0), rtol=1e-5, atol=1e-5)
    assert np.abs(got).max() < 30.0
