"""The pure-MLX paged reference against dense per-request attention written in numpy, and its
attention sinks against transformers' GPT-OSS eager attention."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss

from kernels_metal.cases import Case, make_inputs
from kernels_metal.reference import paged_attention_reference

CASE = Case(mx.float32, 16, 8, 6, 2, ((0, 1), (30, 1), (0, 19), (11, 14), (40, 2)))
SINKS = mx.array([-1.5, 0.0, 2.0, 4.0, -30.0, 1.0])  # one per query head of CASE


def request_kv(k_pool, v_pool, meta, r: int) -> tuple[np.ndarray, np.ndarray]:
    """Request r's keys and values in position order: `[seq_len, kv_heads, d]` each."""
    slots = [(meta.block_tables[r, p // meta.block_size], p % meta.block_size)
             for p in range(int(meta.seq_lens[r]))]
    return (np.stack([k_pool[b, o] for b, o in slots]),
            np.stack([v_pool[b, o] for b, o in slots]))


def dense_attention(q, k_pool, v_pool, meta, scale, window, softcap, sinks=None) -> np.ndarray:
    """Row by row: gather the request's keys in position order, mask, softmax (the sink's
    weight joins the sum and nothing else)."""
    q, k_pool, v_pool = (np.array(a, np.float64) for a in (q, k_pool, v_pool))
    heads, kv_heads = q.shape[1], k_pool.shape[2]
    out = np.zeros_like(q)
    for r in range(meta.num_requests):
        seq_len = int(meta.seq_lens[r])
        keys, values = request_kv(k_pool, v_pool, meta, r)
        start, end = meta.cu_seqlens_q[r], meta.cu_seqlens_q[r + 1]
        for row in range(start, end):
            pos = seq_len - (end - row)
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                scores = keys[lo:pos + 1, kvh] @ q[row, h] * scale
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                top = scores.max() if sinks is None else max(scores.max(), float(sinks[h]))
                probs = np.exp(scores - top)
                total = probs.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - top))
                out[row, h] = probs / total @ values[lo:pos + 1, kvh]
    return out


@pytest.mark.parametrize(("window", "softcap", "sinks"), [
    (None, None, None), (5, None, None), (1, None, None), (None, 10.0, None), (9, 30.0, None),
    (None, None, SINKS), (5, None, SINKS), (1, None, SINKS), (9, 30.0, SINKS)])
def test_reference_matches_dense_attention(window, softcap, sinks):
    q, k_pool, v_pool, meta, scale = make_inputs(CASE, seed=4)
    got = np.array(paged_attention_reference(q, k_pool, v_pool, meta, scale, window, softcap,
                                             sinks))
    expected = dense_attention(q, k_pool, v_pool, meta, scale, window, softcap, sinks)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def eager_with_sinks(query, key, value, mask, scaling, sinks):
    """transformers' GPT-OSS `eager_attention_forward`, transcribed: `query [1, H, n, d]`,
    `key`/`value` `[1, kvh, L, d]`, `mask [n, L]` additive."""
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling + mask
    sink_column = sinks.reshape(1, -1, 1, 1).expand(1, -1, query.shape[2], 1)
    logits = torch.cat([weights, sink_column], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs, value).transpose(1, 2)  # [1, n, H, d]


def request_tensors(q, k_pool, v_pool, meta, r: int, window: int | None):
    """Request r as transformers sees it: query, key, value, additive mask (its min value)."""
    keys, values = request_kv(np.array(k_pool), np.array(v_pool), meta, r)
    start, end = int(meta.cu_seqlens_q[r]), int(meta.cu_seqlens_q[r + 1])
    seq_len = int(meta.seq_lens[r])
    q_pos = np.arange(seq_len - (end - start), seq_len)[:, None]
    k_pos = np.arange(seq_len)[None, :]
    visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    mask = np.where(visible, 0.0, np.finfo(np.float32).min).astype(np.float32)
    query = torch.from_numpy(np.array(q[start:end])).permute(1, 0, 2)[None]
    key, value = (torch.from_numpy(a).permute(1, 0, 2)[None] for a in (keys, values))
    return query, key, value, torch.from_numpy(mask), slice(start, end)


@pytest.mark.parametrize("window", [None, 6])
def test_reference_sinks_match_transformers_eager_attention(window):
    q, k_pool, v_pool, meta, scale = make_inputs(CASE, seed=7)
    got = np.array(paged_attention_reference(q, k_pool, v_pool, meta, scale, window,
                                             sinks=SINKS))
    sinks = torch.from_numpy(np.array(SINKS))
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=CASE.num_heads // CASE.kv_heads,
                             training=False)
    for r in range(meta.num_requests):
        query, key, value, mask, rows = request_tensors(q, k_pool, v_pool, meta, r, window)
        expected = eager_with_sinks(query, key, value, mask, scale, sinks)[0].numpy()
        np.testing.assert_allclose(got[rows], expected, atol=1e-5, rtol=1e-5)
        # The transcription is transformers' own function, on the same inputs.
        theirs, _ = modeling_gpt_oss.eager_attention_forward(module, query, key, value,
                                                             mask, scale)
        np.testing.assert_allclose(theirs[0].numpy(), expected, atol=1e-6, rtol=1e-6)


def test_sinks_change_the_result_and_a_sink_of_minus_infinity_is_none():
    q, k_pool, v_pool, meta, scale = make_inputs(CASE, seed=2)
    plain = np.array(paged_attention_reference(q, k_pool, v_pool, meta, scale, 5))
    minus_inf = mx.full((CASE.num_heads,), -mx.inf)
    np.testing.assert_array_equal(
        np.array(paged_attention_reference(q, k_pool, v_pool, meta, scale, 5, sinks=minus_inf)),
        plain)
    with_sinks = np.array(paged_attention_reference(q, k_pool, v_pool, meta, scale, 5,
                                                    sinks=SINKS))
    # A sink only takes mass away: each head's output shrinks, the more the larger its sink.
    ratio = np.abs(with_sinks).sum(axis=(0, 2)) / np.abs(plain).sum(axis=(0, 2))
    assert ratio.max() <= 1 and ratio.min() < 0.2
    np.testing.assert_array_equal(np.argsort(ratio), np.argsort(-np.array(SINKS)))
