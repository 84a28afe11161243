"""Batched sampler: greedy rows, filters, seeds independent of batch composition, distribution."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from metal_engine.sampler import SamplingBatch, sample
from scheduler import SamplingParams


def run(logits: np.ndarray, params: list[SamplingParams], outputs=None) -> list[int]:
    batch = SamplingBatch.build(params, outputs or [0] * len(params))
    return sample(mx.array(logits, dtype=mx.float32), batch).tolist()


def test_greedy_rows_take_argmax_next_to_sampled_rows():
    logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)] * 2
    got = run(logits, params)
    assert got[0] == logits[0].argmax() and got[2] == logits[2].argmax()


def test_top_k_one_is_greedy():
    logits = np.random.default_rng(1).normal(size=(8, 50)).astype(np.float32)
    got = run(logits, [SamplingParams(temperature=2.0, top_k=1)] * 8)
    assert got == logits.argmax(axis=-1).tolist()


def test_top_p_never_samples_outside_the_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.tile(np.log(probs), (2000, 1)).astype(np.float32)
    got = run(logits, [SamplingParams(top_p=0.7)] * 2000)
    assert set(got) == {0, 1}  # 0.5 + 0.3 reaches 0.7; 2 and 3 are cut


def test_top_k_never_samples_outside_the_top():
    logits = np.tile(np.log(np.array([0.4, 0.3, 0.2, 0.1])), (2000, 1)).astype(np.float32)
    got = run(logits, [SamplingParams(top_k=2)] * 2000)
    assert set(got) == {0, 1}


def test_temperature_sampling_follows_the_softmax():
    probs = np.array([0.6, 0.3, 0.1])
    n = 6000
    got = run(np.tile(np.log(probs) * 2, (n, 1)).astype(np.float32),
              [SamplingParams(temperature=2.0)] * n)
    freq = np.bincount(got, minlength=3) / n
    np.testing.assert_allclose(freq, probs, atol=0.03)


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    rng = np.random.default_rng(2)
    row = rng.normal(size=(1, 1000)).astype(np.float32)
    others = rng.normal(size=(5, 1000)).astype(np.float32)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [run(row, [seeded], [n])[0] for n in range(6)]
    batched = [
        run(np.concatenate([others[:2], row, others[2:]]),
            [SamplingParams()] * 2 + [seeded] + [SamplingParams()] * 3, [0, 0, n, 0, 0, 0])[2]
        for n in range(6)
    ]
    assert alone == batched
    assert len(set(alone)) > 1  # the output index moves the stream on


def test_logit_bias_applies_to_greedy_and_sampled_rows():
    logits = np.zeros((2, 10), np.float32)
    logits[:, 3] = 5.0
    params = [
        SamplingParams(temperature=0.0, logit_bias=((3, -100.0), (7, 2.0))),
        SamplingParams(temperature=1.0, seed=0, logit_bias=((3, -100.0), (9, 100.0))),
    ]
    assert run(logits, params) == [7, 9]
