"""Batched sampler: greedy rows, filters, seeds independent of batch composition, distribution,
penalties, min-p, min_tokens, grammar bitmasks and logprobs against numpy references."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metal_engine.sampling.logprobs import compute_logprobs
from metal_engine.sampling.sampler import SamplingBatch, process_logits, sample
from metal_engine.sampling.sampling_row import SamplingRow
from scheduler import SamplingParams


def run(logits: np.ndarray, params: list[SamplingParams], outputs=None) -> list[int]:
    rows = [SamplingRow(p, n) for p, n in zip(params, outputs or [0] * len(params), strict=True)]
    return run_rows(logits, rows)


def run_rows(logits: np.ndarray, rows: list[SamplingRow]) -> list[int]:
    return sample(mx.array(logits, dtype=mx.float32), SamplingBatch.build(rows)).tolist()


def processed(logits: np.ndarray, rows: list[SamplingRow]) -> np.ndarray:
    return np.array(process_logits(mx.array(logits), SamplingBatch.build(rows)))


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


@pytest.mark.parametrize("top_k", [2**31, 2**63, 10**30])
def test_a_top_k_past_int32_is_no_filter_and_no_error(top_k):
    """It was an OverflowError on the engine thread: every request of the step failed."""
    logits = np.random.default_rng(2).normal(size=(3, 50)).astype(np.float32)
    huge = SamplingParams(temperature=1.0, top_k=top_k, seed=5)
    off = SamplingParams(temperature=1.0, top_k=0, seed=5)
    greedy = SamplingParams(temperature=0.0)
    assert run(logits, [huge, greedy, huge]) == run(logits, [off, greedy, off])


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


def penalized_reference(logits: np.ndarray, row: SamplingRow) -> np.ndarray:
    """One row's logits penalized token by token, as vLLM / OpenAI define it."""
    p, out = row.params, logits.astype(np.float64)
    outputs = list(row.output_token_ids)
    for t in set(row.prompt_token_ids) | set(outputs):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(outputs):
        out[t] -= p.frequency_penalty * outputs.count(t) + p.presence_penalty
    return out


@pytest.mark.parametrize("penalty", [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=-0.7),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.5, presence_penalty=-2.0, frequency_penalty=2.0),
])
def test_penalties_match_a_numpy_reference(penalty):
    logits = np.random.default_rng(3).normal(size=(3, 12)).astype(np.float32)
    history = dict(prompt_token_ids=[1, 4, 4, 9], output_token_ids=[4, 7, 7, 7, 2])
    rows = [
        SamplingRow(SamplingParams(temperature=0.0), 5, **history),  # no penalty: untouched
        SamplingRow(SamplingParams(**penalty), 5, **history),
        SamplingRow(SamplingParams(**penalty), 2, prompt_token_ids=[3, 3],
                    output_token_ids=[5, 0]),
    ]
    got = processed(logits, rows)
    np.testing.assert_array_equal(got[0], logits[0])
    for i in (1, 2):
        np.testing.assert_allclose(got[i], penalized_reference(logits[i], rows[i]),
                                   rtol=1e-6, atol=1e-6)
        assert not np.allclose(got[i], logits[i])


def test_greedy_rows_choose_from_the_penalized_logits():
    logits = np.array([[0.0, 3.0, 2.5, 0.0]], np.float32)
    row = SamplingRow(SamplingParams(temperature=0.0, presence_penalty=1.0), 1,
                      output_token_ids=[1])
    assert run_rows(logits, [row]) == [2]


def test_min_p_never_samples_below_its_share_of_the_top_probability():
    logits = np.tile(np.log(np.array([0.5, 0.3, 0.15, 0.05])), (2000, 1)).astype(np.float32)
    assert set(run(logits, [SamplingParams(min_p=0.35)] * 2000)) == {0, 1}
    # min-p judges the tempered distribution: at T=2 the probabilities relative to the top
    # are sqrt(p / 0.5) = 1, .77, .55, .32.
    assert set(run(logits, [SamplingParams(min_p=0.5, temperature=2.0)] * 2000)) == {0, 1, 2}


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    logits = np.zeros((1, 10), np.float32)
    logits[0, [2, 5, 7]] = [9.0, 8.0, 7.0]  # 2 is EOS, 5 a stop token id

    def greedy(params: SamplingParams, num_outputs: int) -> int:
        row = SamplingRow(params, num_outputs, eos_token_ids=(2,))
        return run_rows(logits, [row])[0]

    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(5,))
    assert [greedy(params, n) for n in range(4)] == [7, 7, 7, 2]
    ignoring_eos = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True,
                                  stop_token_ids=(5,))
    assert greedy(ignoring_eos, 0) == 2  # EOS does not stop it, so it is not held back


def bitmask(allowed: list[int], num_words: int) -> np.ndarray:
    words = np.zeros(num_words, np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


def test_grammar_bitmask_limits_only_its_row():
    logits = np.random.default_rng(4).normal(size=(2, 64)).astype(np.float32)
    allowed = [3, 40, 63]  # 63: the sign bit of its word
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0, allowed_tokens=bitmask(allowed, 2)),
            SamplingRow(SamplingParams(temperature=0.0), 0)]
    got = processed(logits, rows)
    assert np.flatnonzero(np.isfinite(got[0])).tolist() == allowed
    np.testing.assert_array_equal(got[1], logits[1])
    draws = run_rows(np.zeros((300, 64), np.float32),
                     [SamplingRow(SamplingParams(seed=i), 0, allowed_tokens=bitmask(allowed, 2))
                      for i in range(300)])
    assert set(draws) == set(allowed)


def test_logits_beyond_the_grammar_vocabulary_are_masked_in_constrained_rows_only():
    logits = np.random.default_rng(5).normal(size=(2, 70)).astype(np.float32)
    everything = np.full(2, -1, np.int32)  # a 64-token tokenizer; the model has 70 logits
    got = processed(logits, [SamplingRow(SamplingParams(), 0, allowed_tokens=everything),
                             SamplingRow(SamplingParams(), 0)])
    assert np.isfinite(got[0]).sum() == 64 and np.isneginf(got[0, 64:]).all()
    np.testing.assert_array_equal(got[1], logits[1])


def test_logprobs_are_the_log_softmax_with_the_top_k_in_order():
    logits = (3 * np.random.default_rng(6).normal(size=(4, 50))).astype(np.float32)
    tokens = [5, 17, 0, 49]
    arrays = compute_logprobs(mx.array(logits), mx.array(tokens), [3, None, 0, 20])
    got = arrays.to_host(tokens)
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    reference = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    assert sorted(got) == [0, 2, 3]
    for row, k in ((0, 3), (2, 0), (3, 20)):
        assert got[row].token_id == tokens[row]
        assert got[row].logprob == pytest.approx(reference[row, tokens[row]], abs=1e-5)
        best = np.argsort(-reference[row])[:k]
        assert [t for t, _ in got[row].top] == best.tolist()
        np.testing.assert_allclose([v for _, v in got[row].top], reference[row, best],
                                   atol=1e-5)


def test_no_row_asks_for_logprobs():
    assert compute_logprobs(mx.zeros((2, 8)), mx.array([0, 1]), [None, None]) is None


# ---- values at float32's edges (each was once token 0 for every row that had it) -----------


@pytest.mark.parametrize("fields", [
    dict(temperature=1e-40, top_p=0.9),
    dict(temperature=1e-40, min_p=0.1),
    dict(temperature=5e-324, top_k=3, top_p=0.5, min_p=0.5),
    dict(temperature=1e-6),
    dict(temperature=1.0, top_p=1e-300),
    dict(temperature=3.0, top_p=5e-324, min_p=1e-300),
    dict(temperature=1.0, min_p=1.0),
])
def test_tiny_temperatures_and_nuclei_sample_the_top_token(fields):
    logits = (3 * np.random.default_rng(7).normal(size=(16, 50))).astype(np.float32)
    params = [SamplingParams(seed=i, **fields) for i in range(16)]
    assert run(logits, params) == logits.argmax(axis=-1).tolist()


def test_a_huge_temperature_is_near_uniform_and_never_picks_a_masked_token():
    logits = np.tile(np.linspace(-3, 3, 40, dtype=np.float32), (3000, 1))
    for temperature in (1e30, 1e39, float("inf")):
        rows = [SamplingRow(SamplingParams(temperature=temperature, seed=i, min_tokens=1), 0,
                            eos_token_ids=(39,), allowed_tokens=bitmask(list(range(1, 40)), 2))
                for i in range(3000)]
        got = np.bincount(run_rows(logits, rows), minlength=40)
        assert got[0] == 0 and got[39] == 0  # outside the grammar; held back by min_tokens
        assert got[1:39].min() > 30  # about 79 each


def test_ids_past_the_vocabulary_in_logit_bias_and_stop_tokens_are_ignored():
    logits = np.random.default_rng(8).normal(size=(2, 50)).astype(np.float32)
    odd = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(-1, 50, 2**31, 10**30),
                         logit_bias=((50, 100.0), (2**31 - 1, 100.0), (2**40, -100.0)))
    plain = SamplingParams(temperature=0.0)
    np.testing.assert_array_equal(processed(logits, [SamplingRow(odd, 0),
                                                     SamplingRow(plain, 0)]), logits)
    assert run(logits, [odd, plain]) == logits.argmax(axis=-1).tolist()


def test_a_vanishing_repetition_penalty_stays_finite():
    logits = np.array([[2.0, -1.0, 0.5, 0.0]], np.float32)
    row = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=5e-324), 1,
                      prompt_token_ids=[0, 1, 3], output_token_ids=[2])
    got = processed(logits, [row])[0]
    np.testing.assert_allclose(got, [200.0, -0.01, 50.0, 0.0])  # as the bound 1/100 would
    assert run_rows(logits, [row]) == [0]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from server_helpers import running_server
    from tiny_server import tiny_engine

    with running_server(tiny_engine(tmp_path_factory.mktemp("tiny-llama"))) as url:
        yield url


@pytest.mark.parametrize("fields", [
    dict(temperature=1e-40, top_p=0.5),
    dict(temperature=1e-40, min_p=0.2),
    dict(top_p=1e-300),
    dict(temperature=1e-40, top_p=1e-300, min_p=1e-300, top_k=4),
])
def test_a_served_request_at_float32_edges_writes_what_greedy_writes(tiny_server, fields):
    import httpx

    def text(**sampling) -> str:
        body = {"prompt": "w5 w9 w12", "max_tokens": 12, "seed": 3, **sampling}
        response = httpx.post(f"{tiny_server}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    greedy = text(temperature=0)
    assert greedy.split() and set(greedy.split()) != {"w0"}  # token 0 was the broken answer
    assert text(**fields) == greedy
