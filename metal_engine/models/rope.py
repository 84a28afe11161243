"""Rotary position embedding over packed rows, from cos/sin tables built once per step.

Every row carries its own position, so the tables are `[total_q, 1, head_dim / 2]` and all
layers (and both q and k) share them. Rotation is the non-interleaved ("rotate half") form.
"""

from __future__ import annotations

import mlx.core as mx


def inv_frequencies(head_dim: int, theta: float) -> mx.array:
    return 1.0 / (theta ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim))


def rope_tables(positions: mx.array, inv_freq: mx.array) -> tuple[mx.array, mx.array]:
    angles = positions.astype(mx.float32)[:, None] * inv_freq[None, :]
    return mx.cos(angles)[:, None, :], mx.sin(angles)[:, None, :]


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate `x [total_q, heads, head_dim]` by its row's angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
