"""Whatever one request's sampling parameters, the rest of its batch samples as if it were not
there: every SamplingParams field fuzzed through its range (and past it, where it must be a
ValueError), with the other rows' tokens and logprobs compared bit for bit with a batch of
their own."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from metal_engine.outputs import TokenLogprobs
from metal_engine.sampling.logprobs import compute_logprobs
from metal_engine.sampling.sampler import SamplingBatch, process_logits, sample
from metal_engine.sampling.sampling_row import SamplingRow
from scheduler.sampling_params import (
    GREEDY_BELOW_TEMPERATURE,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    SamplingParams,
)

VOCAB = 70  # not a multiple of 32: the grammar bitmask's last word is partial
WORDS = 2  # a grammar tokenizer of 64 tokens: the model's last 6 logits are past it
EOS = (2,)
HISTORY = dict(prompt_token_ids=[1, 4, 4, 9, 33], output_token_ids=[4, 7, 7, 61])
# Derandomized: the same examples every run, no database, no deadline (timing never fails it).
FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
FEWER = settings(FUZZ, max_examples=40)

# The rows that share a batch with the fuzzed one, each deterministic (greedy or seeded). Alone,
# the plain ones take the sampler's short path; next to most fuzzed rows, the full one.
PLAIN = [
    SamplingRow(SamplingParams(temperature=0.0), 0),
    SamplingRow(SamplingParams(temperature=0.8, seed=11, logprobs=3), 2),
    SamplingRow(SamplingParams(temperature=1.3, top_k=5, top_p=0.9, seed=12, logprobs=0), 0),
]
MIXED = [
    *PLAIN,
    SamplingRow(SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2,
                               presence_penalty=0.5, seed=13, min_tokens=6), 4,
                eos_token_ids=EOS, **HISTORY),
    SamplingRow(SamplingParams(seed=14, logprobs=MAX_LOGPROBS), 1,
                allowed_tokens=np.array([0x0F0F0F0F, -1], np.int32)),
]


def edges(*values) -> st.SearchStrategy:
    return st.sampled_from(values)


F32_MAX = float(np.finfo(np.float32).max)
temperatures = edges(0.0, 5e-324, 1e-45, 1e-40, 1e-38, 1e-6, GREEDY_BELOW_TEMPERATURE, 2e-5,
                     1.0, 2.0, 1e30, F32_MAX, 1e39, 1e300, math.inf) | st.floats(
    0, allow_nan=False)
top_ps = edges(5e-324, 1e-300, 1e-45, 1e-38, 1e-8, 0.5, 1 - 1e-7, 1.0) | st.floats(
    0, 1, exclude_min=True)
top_ks = edges(0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1, 2**31, 2**63, 10**30) | (
    st.integers(0, 2**80))
min_ps = edges(0.0, 5e-324, 1e-300, 1e-45, 1e-8, 0.5, 1.0) | st.floats(0, 1)
penalties = edges(-2.0, -5e-324, 0.0, 5e-324, 2.0) | st.floats(-2, 2)
repetitions = edges(5e-324, 1e-300, 1e-38, 0.01, 1.0, 99.9, MAX_REPETITION_PENALTY) | (
    st.floats(0, MAX_REPETITION_PENALTY, exclude_min=True))
token_ids = st.integers(0, VOCAB - 1) | edges(VOCAB, VOCAB + 1, 2**31 - 1, 2**31, 2**63)
seeds = st.none() | edges(0, -1, 2**32, 2**64 + 1, -(2**100)) | st.integers()


@st.composite
def fuzzed_rows(draw) -> SamplingRow:
    max_tokens = draw(st.integers(1, 64) | edges(2**31, 10**20))
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=draw(temperatures),
        top_p=draw(top_ps),
        top_k=draw(top_ks),
        seed=draw(seeds),
        stop_token_ids=tuple(draw(st.lists(token_ids | st.integers(), max_size=4))),
        ignore_eos=draw(st.booleans()),
        logit_bias=tuple(draw(st.lists(
            st.tuples(token_ids, edges(-100.0, 0.0, 100.0) | st.floats(-100, 100)),
            max_size=6))),
        min_p=draw(min_ps),
        min_tokens=draw(st.integers(0, min(max_tokens, 64))),
        presence_penalty=draw(penalties),
        frequency_penalty=draw(penalties),
        repetition_penalty=draw(repetitions),
        logprobs=draw(st.none() | st.integers(0, MAX_LOGPROBS)),
    )
    history = st.lists(st.integers(0, VOCAB - 1), max_size=12)
    outputs = draw(history)
    mask = draw(st.none() | st.lists(st.integers(-(2**31), 2**31 - 1), min_size=WORDS,
                                     max_size=WORDS).map(lambda w: np.array(w, np.int32)))
    return SamplingRow(params, len(outputs), draw(history), outputs, EOS, mask)


def run(logits: np.ndarray, rows: list[SamplingRow]) -> tuple[list[int], dict]:
    """Each row's token, and its logprobs (TokenLogprobs, or None), as the runner computes
    them."""
    device_logits = mx.array(logits)
    tokens = sample(device_logits, SamplingBatch.build(rows))
    arrays = compute_logprobs(device_logits, tokens, [r.params.logprobs for r in rows])
    ids = tokens.tolist()
    return ids, arrays.to_host(ids) if arrays is not None else {}


def logits_for(seed: int, scale: float, rows: int) -> np.ndarray:
    return (scale * np.random.default_rng(seed).normal(size=(rows, VOCAB))).astype(np.float32)


@st.composite
def batches(draw) -> tuple[list[SamplingRow], int]:
    """Victim rows, and where the fuzzed row goes among them."""
    victims = draw(st.sampled_from([PLAIN, MIXED]))
    return victims, draw(st.integers(0, len(victims)))


@FUZZ
@given(row=fuzzed_rows(), batch=batches(), seed=st.integers(0, 2**16),
       scale=edges(0.0, 1.0, 4.0, 30.0))
def test_a_fuzzed_row_leaves_the_rest_of_its_batch_bit_for_bit_alone(row, batch, seed, scale):
    victims, position = batch
    logits = logits_for(seed, scale, len(victims) + 1)
    others = np.delete(logits, position, axis=0)
    alone_tokens, alone_logprobs = run(others, victims)

    rows = [*victims[:position], row, *victims[position:]]
    tokens, logprobs = run(logits, rows)

    victim_rows = [i for i in range(len(rows)) if i != position]
    assert [tokens[i] for i in victim_rows] == alone_tokens
    assert {victim_rows.index(i): lp for i, lp in logprobs.items() if i != position} == (
        alone_logprobs)
    check_own_token(logits[position], row, tokens[position], logprobs.get(position))


def check_own_token(logits: np.ndarray, row: SamplingRow, token: int,
                    logprobs: TokenLogprobs | None) -> None:
    """The fuzzed row's own token is a real one that its filters allow, and its logprobs are
    numbers."""
    assert 0 <= token < VOCAB
    allowed = np.array(process_logits(mx.array(logits[None]), SamplingBatch.build([row])))[0]
    if (allowed > -np.inf).any():
        assert allowed[token] > -np.inf, "sampled a token its own masks rule out"
    if row.params.temperature < GREEDY_BELOW_TEMPERATURE and (allowed > -np.inf).any():
        assert token == int(np.argmax(allowed)), "a near-zero temperature is greedy"
    if row.params.logprobs is not None:
        assert logprobs is not None and logprobs.token_id == token
        assert len(logprobs.top) == row.params.logprobs
        assert not np.isnan([logprobs.logprob, *(v for _, v in logprobs.top)]).any()


@FEWER
@given(row=fuzzed_rows(), seed=st.integers(0, 2**16))
def test_a_seeded_or_greedy_row_samples_the_same_alone_and_in_a_batch(row, seed):
    if row.params.seed is None and row.params.temperature >= 1e-5:
        assume(False)  # unseeded sampling draws from the shared stream
    logits = logits_for(seed, 4.0, len(MIXED) + 1)
    alone, alone_logprobs = run(logits[-1:], [row])
    batched, logprobs = run(logits, [*MIXED, row])
    assert batched[-1] == alone[0]
    assert logprobs.get(len(MIXED)) == alone_logprobs.get(0)


invalid = st.one_of(
    st.builds(dict, temperature=st.floats(max_value=0, exclude_max=True) | st.just(math.nan)),
    st.builds(dict, top_p=st.floats(max_value=0) | st.floats(min_value=1, exclude_min=True)
              | st.just(math.nan)),
    st.builds(dict, top_k=st.integers(max_value=-1)),
    st.builds(dict, min_p=st.floats(max_value=0, exclude_max=True)
              | st.floats(min_value=1, exclude_min=True) | st.just(math.nan)),
    st.builds(dict, presence_penalty=st.floats(min_value=2, exclude_min=True) | st.just(-math.inf)
              | st.just(math.nan)),
    st.builds(dict, frequency_penalty=st.floats(max_value=-2, exclude_max=True)),
    st.builds(dict, repetition_penalty=st.floats(max_value=0)
              | st.floats(min_value=MAX_REPETITION_PENALTY, exclude_min=True)
              | st.just(math.nan)),
    st.builds(dict, max_tokens=st.integers(max_value=0)),
    st.builds(dict, min_tokens=st.integers(max_value=-1) | st.integers(min_value=17)),
    st.builds(dict, logprobs=st.integers(max_value=-1) | st.integers(min_value=MAX_LOGPROBS + 1)),
    st.builds(dict, logit_bias=st.tuples(st.tuples(st.integers(max_value=-1), st.just(0.0)))
              | st.tuples(st.tuples(st.just(1), st.floats(min_value=100, exclude_min=True)
                                    | st.just(math.nan)))),
)


@FEWER
@given(fields=invalid)
def test_values_out_of_range_are_a_value_error_at_construction(fields):
    try:
        SamplingParams(**fields)
    except ValueError:
        return
    raise AssertionError(f"SamplingParams accepted {fields}")
