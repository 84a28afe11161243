"""The pure-MLX paged reference against dense per-request attention written in numpy."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels_metal.cases import Case, make_inputs
from kernels_metal.reference import paged_attention_reference

CASE = Case(mx.float32, 16, 8, 6, 2, ((0, 1), (30, 1), (0, 19), (11, 14), (40, 2)))


def dense_attention(q, k_pool, v_pool, meta, scale, window, softcap) -> np.ndarray:
    """Row by row: gather the request's keys in position order, mask, softmax."""
    q, k_pool, v_pool = (np.array(a, np.float64) for a in (q, k_pool, v_pool))
    heads, kv_heads = q.shape[1], k_pool.shape[2]
    out = np.zeros_like(q)
    for r in range(meta.num_requests):
        seq_len = int(meta.seq_lens[r])
        slots = [(meta.block_tables[r, p // meta.block_size], p % meta.block_size)
                 for p in range(seq_len)]
        keys = np.stack([k_pool[b, o] for b, o in slots])  # [seq_len, kv_heads, d]
        values = np.stack([v_pool[b, o] for b, o in slots])
        start, end = meta.cu_seqlens_q[r], meta.cu_seqlens_q[r + 1]
        for row in range(start, end):
            pos = seq_len - (end - row)
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                scores = keys[lo:pos + 1, kvh] @ q[row, h] * scale
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                probs = np.exp(scores - scores.max())
                out[row, h] = probs / probs.sum() @ values[lo:pos + 1, kvh]
    return out


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (1, None),
                                                 (None, 10.0), (9, 30.0)])
def test_reference_matches_dense_attention(window, softcap):
    q, k_pool, v_pool, meta, scale = make_inputs(CASE, seed=4)
    got = np.array(paged_attention_reference(q, k_pool, v_pool, meta, scale, window, softcap))
    expected = dense_attention(q, k_pool, v_pool, meta, scale, window, softcap)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
