"""The host forward's compiled loops against numpy formulas in float64: RMSNorm and rotary
embedding on the strided q/k views a packed product hands them, exp over its whole clamped
range, SwiGLU of a packed gate/up product."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels_metal.cpu import loops as cpu_loops
from kernels_metal.cpu.math import rms_norm, silu_mul, silu_mul_halves
from kernels_metal.reference import apply_rope


def _packed_views(rows: int, heads: int, kv_heads: int, head_dim: int):
    """q and k as the column views of one q/k/v product, like the host forward's."""
    rng = np.random.default_rng(0)
    y = rng.standard_normal((rows, (heads + 2 * kv_heads) * head_dim), dtype=np.float32)
    q = y[:, : heads * head_dim].reshape(rows, heads, head_dim)
    k = y[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(rows, kv_heads, head_dim)
    return q, k


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_the_formula_on_strided_rows(with_weight):
    q, _ = _packed_views(5, 4, 2, 32)
    weight = np.linspace(0.5, 1.5, 32, dtype=np.float32) if with_weight else None
    got = rms_norm(q, weight, 1e-6)
    x = q.astype(np.float64)
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    if with_weight:
        want = want * weight
    assert got.shape == q.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rotary_half", [16, 8])  # whole head, and partial rotary
def test_rope_turns_pairs_and_keeps_the_tail(rotary_half):
    q, k = _packed_views(3, 4, 2, 32)
    rng = np.random.default_rng(1)
    angles = rng.uniform(0, 6, (3, 1, rotary_half)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    for x in (q, k):
        got = np.empty(x.shape, np.float32)
        cpu_loops.rope(x, cos[:, 0], sin[:, 0], got)
        x1, x2 = x[..., :rotary_half], x[..., rotary_half : 2 * rotary_half]
        want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin,
                               x[..., 2 * rotary_half :]], axis=-1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # The reference gives the same rotation.
        on_mlx = apply_rope(mx.array(x), mx.array(cos), mx.array(sin))
        np.testing.assert_allclose(got, np.array(on_mlx), rtol=1e-5, atol=1e-5)


def test_exp_is_within_float32_rounding_over_its_range():
    x = np.concatenate([np.linspace(-100, 88, 200_001, dtype=np.float32),
                        np.array([-np.inf, 0.0, -87.0, 88.0], np.float32)])
    got = x.copy()
    cpu_loops.exp(got)
    want = np.exp(np.clip(x.astype(np.float64), -87.0, 88.0))  # floored, as documented
    np.testing.assert_allclose(got, want, rtol=4e-7, atol=0)
    assert got[-4] > 0 and np.isfinite(got).all()


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_silu_mul_of_packed_halves_matches_the_formula(rows):
    rng = np.random.default_rng(rows)
    gate_up = (rng.standard_normal((rows, 2 * 96)) * 12).astype(np.float32)  # saturates too
    got = silu_mul_halves(gate_up)
    gate, up = gate_up[:, :96].astype(np.float64), gate_up[:, 96:].astype(np.float64)
    want = gate * up / (1 + np.exp(-gate))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # The same as the two-argument form the MLX path and other callers use.
    np.testing.assert_allclose(got, silu_mul(gate_up[:, :96], gate_up[:, 96:]), rtol=1e-6,
                               atol=1e-6)
