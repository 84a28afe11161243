"""Rotary embedding of packed rows with `mx.fast.rope`: one kernel per tensor on Metal.

The rows `[total_q, heads, head_dim]` are viewed as `[total_q, heads, 1, head_dim]`, a batch
of one-token sequences, so `offset` (one position per batch entry) gives every row its own
position: one call per layer turns q (and one k) of all requests, with no tables. The rope
kind lives in `freqs` (periods, `1 / inv_freq`; 0 frequencies as infinite periods); a cos/sin
scale (YaRN's and LongRoPE's attention factor) scales the rotated features first, which is the
same since rotation is linear. LongRoPE switches frequency sets at the pretraining length:
a step whose requests sit on both sides turns with both sets and picks per row. Dynamic NTK
has a base per context length, and 3-D (multimodal) positions turn each frequency by its
own axis: those steps keep the float32 tables (`RotaryTables`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kernels_metal.metadata import AttentionMetadata
from kernels_metal.reference import apply_rope


class FastRope:
    """One step's rope of one kind, for every layer of that kind (q and k alike)."""

    def __init__(self, rope, positions: mx.array, meta: AttentionMetadata) -> None:
        """`rope`: a `metal_engine.models.rope.RotaryEmbedding`."""
        self.dims, self.scale = rope.rotary_dim, rope.scale
        self.positions = positions.astype(mx.int32)
        self.periods = rope.periods(long=False)
        self.long_rows = None  # [total_q, 1, 1, 1] bool: rows on the long frequencies
        if rope.switches_at_length:
            long = np.repeat(meta.seq_lens > rope.switch_length, np.diff(meta.cu_seqlens_q))
            if long.all():
                self.periods = rope.periods(long=True)
            elif long.any():
                self.long_periods = rope.periods(long=True)
                self.long_rows = mx.array(long[:, None, None, None])
        self._scales: dict[tuple, mx.array] = {}

    def __call__(self, x: mx.array) -> mx.array:
        total, heads, dim = x.shape
        if self.scale != 1.0:
            x = x * self._scale_of(dim, x.dtype)
        rows = x.reshape(total, heads, 1, dim)
        out = self._turn(rows, self.periods)
        if self.long_rows is not None:
            out = mx.where(self.long_rows, self._turn(rows, self.long_periods), out)
        return out.reshape(total, heads, dim)

    def _turn(self, rows: mx.array, periods: mx.array) -> mx.array:
        return mx.fast.rope(rows, self.dims, traditional=False, base=None, scale=1.0,
                            offset=self.positions, freqs=periods)

    def _scale_of(self, dim: int, dtype: mx.Dtype) -> mx.array:
        """The cos/sin scale on the rotated features, 1 on the rest."""
        key = (dim, dtype)
        if key not in self._scales:
            scale = np.ones(dim, np.float32)
            scale[: self.dims] = self.scale
            self._scales[key] = mx.array(scale).astype(dtype)
        return self._scales[key]


class RotaryTables:
    """A step's rope as float32 cos/sin tables (the reference's form)."""

    def __init__(self, rope, positions: mx.array, meta: AttentionMetadata) -> None:
        self.cos, self.sin = rope.tables(positions, meta)

    def __call__(self, x: mx.array) -> mx.array:
        return apply_rope(x, self.cos, self.sin)


def rope_step(rope, positions: mx.array, meta: AttentionMetadata) -> FastRope | RotaryTables:
    """The step's rope of `rope`'s kind on Metal."""
    if rope.base_per_length or positions.ndim == 2:
        return RotaryTables(rope, positions, meta)
    return FastRope(rope, positions, meta)
