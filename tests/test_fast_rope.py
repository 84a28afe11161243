"""The Metal path's rope (`mx.fast.rope` with one position per packed row, the kind in its
periods) against the reference's float32 tables, for every rope kind and a step whose
requests sit on both sides of LongRoPE's switch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels_metal.fast_rope import FastRope, RotaryTables, rope_step
from kernels_metal.metadata import AttentionMetadata
from metal_engine.models.rope import RotaryEmbedding
from metal_engine.models.rope_parameters import RopeParameters

HEAD_DIM, MAX_POSITIONS = 32, 64
KINDS = {
    "default": RopeParameters(),
    "linear": RopeParameters("linear", factor=4.0),
    "llama3": RopeParameters("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16),
    "yarn": RopeParameters("yarn", factor=4.0, original_max_position_embeddings=16),
    "partial": RopeParameters(partial_rotary_factor=0.5),
    "longrope-partial": RopeParameters(
        "longrope", factor=2.0, partial_rotary_factor=0.5, original_max_position_embeddings=32,
        short_factor=(1.0, 1.2, 1.5, 2.0, 2.2, 2.5, 3.0, 3.5),
        long_factor=(1.5, 2.0, 3.0, 5.0, 8.0, 9.0, 12.0, 16.0)),
    "proportional": RopeParameters("proportional", rope_theta=1e6, partial_rotary_factor=0.25),
    "dynamic": RopeParameters("dynamic", factor=3.0),
}


def step(seq_lens: list[int], q_lens: list[int]) -> tuple[mx.array, AttentionMetadata]:
    """Positions and metadata of requests with `q_lens` rows each, ending at `seq_lens`."""
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens, q_lens,
                                                                   strict=True)])
    meta = AttentionMetadata(cu, np.array(seq_lens, np.int32), np.zeros((len(q_lens), 1),
                             np.int32), np.zeros(int(cu[-1]), np.int64), 16)
    return mx.array(positions.astype(np.int32)), meta


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("requests", [([40, 9], [3, 1]), ([200, 5], [1, 5]), ([3], [3])],
                         ids=["short", "both-sides", "one"])
def test_fast_rope_turns_as_the_tables_do(kind, requests):
    rope = RotaryEmbedding(KINDS[kind], HEAD_DIM, MAX_POSITIONS)
    positions, meta = step(*requests)
    x = mx.random.normal((positions.shape[0], 3, HEAD_DIM), key=mx.random.key(1))
    got = rope_step(rope, positions, meta)(x)
    want = RotaryTables(rope, positions, meta)(x)
    # Periods are float32 inverses of float32 frequencies: angles of ~200 radians differ in
    # their last bits.
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)


def test_one_rope_call_per_tensor_where_rows_share_frequencies():
    """Dynamic NTK keeps the tables; LongRoPE turns twice only when the step straddles."""
    positions, meta = step([40, 9], [3, 1])
    assert isinstance(rope_step(RotaryEmbedding(KINDS["dynamic"], HEAD_DIM, MAX_POSITIONS),
                                positions, meta), RotaryTables)
    longrope = RotaryEmbedding(KINDS["longrope-partial"], HEAD_DIM, MAX_POSITIONS)
    assert FastRope(longrope, *step([20, 9], [3, 1])).long_rows is None  # both short
    assert FastRope(longrope, *step([200, 50], [1, 5])).long_rows is None  # both long
    assert FastRope(longrope, *step([200, 5], [1, 5])).long_rows is not None


def test_half_precision_rows_keep_their_dtype():
    rope = RotaryEmbedding(KINDS["yarn"], HEAD_DIM, MAX_POSITIONS)
    positions, meta = step([40], [4])
    x = mx.random.normal((4, 2, HEAD_DIM)).astype(mx.float16)
    got = rope_step(rope, positions, meta)(x)
    want = RotaryTables(rope, positions, meta)(x.astype(mx.float32))
    assert got.dtype == mx.float16
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), atol=1e-2)
