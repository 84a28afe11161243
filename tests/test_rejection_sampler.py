"""Rejection sampling of draft tokens: greedy against numpy, the output distribution against the
target's by chi-square (first token, and the first two tokens jointly over two verification
rounds), filters, the sampler's own processing per row, seeds, and rows never touching another
request's."""

from __future__ import annotations

import math
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_sampling_fuzz import FEWER, MIXED, VOCAB, fuzzed_rows, logits_for

from metal_engine.sampling.logprobs import compute_logprobs
from metal_engine.sampling.rejection_sampler import (
    DraftBatch,
    VerifiedTokens,
    rejection_sample,
    verification_rows,
)
from metal_engine.sampling.sampler import SamplingBatch, sample
from metal_engine.sampling.sampling_row import SamplingRow
from scheduler import SamplingParams

# ---- the chi-square test (scipy is not a dependency) ---------------------------------------

P_VALUE = 1e-4  # every statistical test here is derandomized: this only guards its margin


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof), by Q(k + 2) = Q(k) + (x/2)^(k/2) e^(-x/2) / G(k/2 + 1)
    from Q(1) = erfc(sqrt(x / 2)) or Q(2) = e^(-x/2)."""
    if x <= 0:
        return 1.0
    half = x / 2
    q, k = (math.erfc(math.sqrt(half)), 1) if dof % 2 else (math.exp(-half), 2)
    while k < dof:
        q += math.exp(k / 2 * math.log(half) - half - math.lgamma(k / 2 + 1))
        k += 2
    return q


@pytest.mark.parametrize(("x", "dof", "sf"), [
    (3.841459, 1, 0.05), (6.634897, 1, 0.01), (13.815511, 2, 1e-3), (25.744800, 5, 1e-4),
    (18.307038, 10, 0.05), (49.801850, 35, 0.05),
])
def test_chi2_sf_matches_the_tables(x, dof, sf):
    assert chi2_sf(x, dof) == pytest.approx(sf, rel=1e-4)


def assert_distributed_as(samples: np.ndarray, probs: np.ndarray) -> None:
    """`samples` (category ids) follow `probs`: none where probs is 0, and a chi-square
    p-value above P_VALUE over the rest, the rarest pooled until each bin expects >= 5."""
    counts = np.bincount(samples, minlength=len(probs))
    assert len(counts) == len(probs)
    assert counts[probs == 0].sum() == 0, f"drew categories of probability 0: {counts}"
    order = np.argsort(probs[probs > 0])
    expected, observed = probs[probs > 0][order] * len(samples), counts[probs > 0][order]
    pooled = int((expected < 5).sum())
    while 0 < pooled < len(expected) and expected[:pooled].sum() < 5:
        pooled += 1
    if pooled:
        expected = np.array([expected[:pooled].sum(), *expected[pooled:]])
        observed = np.array([observed[:pooled].sum(), *observed[pooled:]])
    assert len(expected) >= 2 and expected.min() >= 5, "too few samples for a chi-square test"
    statistic = float(((observed - expected) ** 2 / expected).sum())
    p_value = chi2_sf(statistic, len(expected) - 1)
    assert p_value > P_VALUE, f"chi2 {statistic:.1f} on {len(expected) - 1} dof, p {p_value:.2e}"


# ---- a toy language model: target and draft logits by position and previous token ----------

V = 6
_TABLES = np.random.default_rng(17)
TARGET = [_TABLES.normal(size=(1, V)), _TABLES.normal(size=(V, V)), _TABLES.normal(size=(V, V))]
# The draft model: the target's logits, off by about one logit.
DRAFT = [t + _TABLES.normal(size=t.shape) for t in TARGET]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution the sampler draws from: temperature, then min-p, then top-k and the
    top-p nucleus (both judged on the min-p-filtered distribution), in float64."""
    z = logits.astype(np.float64) / params.temperature
    if params.min_p > 0:
        z = np.where(z >= z.max() + np.log(params.min_p), z, -np.inf)
    p = softmax(z)
    order = np.argsort(-p, kind="stable")
    keep = np.ones(len(p), bool)
    if params.top_k > 0:
        keep[order[params.top_k:]] = False
    if params.top_p < 1:
        before = np.cumsum(p[order]) - p[order]
        keep[order[1:][before[1:] >= params.top_p]] = False
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def draw(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    """One category per row of `probs [N, V]`."""
    return (rng.random(len(probs))[:, None] < np.cumsum(probs, axis=1)).argmax(axis=1)


def verify(requests: list[SamplingRow], drafts: np.ndarray, logits: np.ndarray,
           draft_probs: np.ndarray | None) -> np.ndarray:
    """Tokens `[N, k + 1]` (-1 past each request's) of requests that all have k drafts."""
    batch = DraftBatch.build(requests, drafts.tolist())
    probs = None if draft_probs is None else mx.array(draft_probs.astype(np.float32))
    verified = rejection_sample(mx.array(logits.astype(np.float32)), batch, probs)
    return np.array(verified.token_ids)


def first_two_tokens(params: list[SamplingParams], full_q: bool, seed: int) -> np.ndarray:
    """Each request's first two output tokens `[N, 2]`: one round with 2 drafts, then, for the
    requests whose first draft was rejected, a round with 1 draft after the token it emitted.
    Drafts come from DRAFT; `full_q` says whether the sampler is told their distribution
    (False: it treats them as point masses, as n-gram drafts are)."""
    rng = np.random.default_rng(seed)
    n = len(params)
    q0 = softmax(np.repeat(DRAFT[0], n, axis=0))
    d0 = draw(rng, q0)
    q1 = softmax(DRAFT[1][d0])
    d1 = draw(rng, q1)
    logits = np.stack([np.repeat(TARGET[0], n, axis=0), TARGET[1][d0], TARGET[2][d1]], axis=1)
    requests = [SamplingRow(p, 0) for p in params]
    tokens = verify(requests, np.stack([d0, d1], 1), logits.reshape(3 * n, V),
                    np.stack([q0, q1], 1).reshape(2 * n, V) if full_q else None)
    out = tokens[:, :2].copy()
    redo = np.flatnonzero(out[:, 1] < 0)
    x0 = out[redo, 0]
    q1 = softmax(DRAFT[1][x0])
    d1 = draw(rng, q1)
    logits = np.stack([TARGET[1][x0], TARGET[2][d1]], axis=1).reshape(2 * len(redo), V)
    again = verify([SamplingRow(params[i], 1) for i in redo], d1[:, None], logits,
                   q1 if full_q else None)
    out[redo, 1] = again[:, 0]
    return out


def check_first_two_tokens(params: SamplingParams, full_q: bool, n: int, seed: int) -> None:
    # Half the requests seeded (the noise from their own keys), half from the global stream.
    mx.random.seed(seed)
    rows = [params if i % 2 else replace(params, seed=i) for i in range(n)]
    out = first_two_tokens(rows, full_q, seed)
    p0 = reference_probs(TARGET[0][0], params)
    assert_distributed_as(out[:, 0], p0)
    joint = np.stack([p0[x] * reference_probs(TARGET[1][x], params) for x in range(V)])
    assert_distributed_as(out[:, 0] * V + out[:, 1], joint.ravel())


@pytest.mark.parametrize("full_q", [False, True], ids=["point-mass", "draft-probs"])
def test_outputs_are_distributed_as_sampling_the_target_token_by_token(full_q):
    check_first_two_tokens(SamplingParams(temperature=1.0), full_q, n=20_000, seed=1)


@pytest.mark.parametrize("fields", [
    dict(temperature=0.6),
    dict(temperature=1.4, top_k=3),
    dict(top_p=0.7),
    dict(temperature=1.5, min_p=0.2),
    dict(temperature=0.8, top_k=4, top_p=0.9, min_p=0.1),
], ids=["temperature", "top-k", "top-p", "min-p", "all"])
@pytest.mark.parametrize("full_q", [False, True], ids=["point-mass", "draft-probs"])
def test_filtered_outputs_are_distributed_as_the_processed_target(fields, full_q):
    check_first_two_tokens(SamplingParams(**fields), full_q, n=10_000, seed=2)


# ---- greedy and the sampler's processing, bit for bit --------------------------------------


def random_drafts(rng: np.random.Generator, best: np.ndarray) -> list[int]:
    """Mostly `best` (each row's argmax), sometimes another token."""
    return np.where(rng.random(len(best)) < 0.75, best, rng.integers(0, 50, len(best))).tolist()


@pytest.mark.parametrize("full_q", [False, True], ids=["point-mass", "draft-probs"])
@pytest.mark.parametrize("neighbours", [False, True], ids=["all-greedy", "with-sampled-rows"])
def test_greedy_accepts_the_prefix_matching_the_argmax_then_the_argmax(full_q, neighbours):
    rng = np.random.default_rng(3)
    num_drafts = [0, 1, 4, 2, 3, 4, 1, 4]
    logits = (2 * rng.normal(size=(sum(num_drafts) + len(num_drafts), 50))).astype(np.float32)
    starts = np.cumsum([0, *num_drafts])[:-1] + np.arange(len(num_drafts))
    drafts = [random_drafts(rng, logits[s:s + k].argmax(-1))
              for s, k in zip(starts, num_drafts, strict=True)]
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    params = [SamplingParams(seed=9) if neighbours and i % 3 == 1 else greedy
              for i in range(len(num_drafts))]
    q = softmax(rng.normal(size=(sum(num_drafts), 50))) if full_q else None
    batch = DraftBatch.build([SamplingRow(p, 5) for p in params], drafts)
    got = rejection_sample(mx.array(logits), batch, None if q is None else mx.array(
        q.astype(np.float32))).to_host()
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for start, k, row_drafts, p, out in zip(starts, num_drafts, drafts, params, got,
                                            strict=True):
        if p is not greedy:
            continue
        best = logits[start:start + k + 1].argmax(-1)
        n = 0
        while n < k and row_drafts[n] == best[n]:
            n += 1
        assert out.token_ids == [*row_drafts[:n], int(best[n])]
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        np.testing.assert_allclose([lp.logprob for lp in out.logprobs],
                                   log_softmax[start + np.arange(n + 1), out.token_ids],
                                   atol=1e-5)
    assert any(len(o.token_ids) > 1 for o in got) and any(len(o.token_ids) == 1 for o in got)


def bitmask(allowed: list[int], words: int = 3) -> np.ndarray:
    mask = np.zeros(words, np.uint32)
    for t in allowed:
        mask[t // 32] |= np.uint32(1 << (t % 32))
    return mask.view(np.int32)


def sample_row(logits: np.ndarray, request: SamplingRow, drafts: list[int],
               mask: np.ndarray | None) -> int:
    """What `sample()` draws at the row after `drafts`, with them in the request's history."""
    j = len(drafts)
    row = SamplingRow(request.params, request.num_output_tokens + j, request.prompt_token_ids,
                      [*request.output_token_ids, *drafts], request.eos_token_ids, mask)
    return sample(mx.array(logits[j:j + 1]), SamplingBatch.build([row])).item()


def one_at_a_time(logits: np.ndarray, request: SamplingRow, drafts: list[int],
                  masks: list[np.ndarray | None]) -> list[int]:
    """`sample()` row after row until a row draws something other than its draft."""
    out = [sample_row(logits, request, [], masks[0])]
    while len(out) <= len(drafts) and out[-1] == drafts[len(out) - 1]:
        out.append(sample_row(logits, request, drafts[:len(out)], masks[len(out)]))
    return out


REQUESTS = [
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(seed=3, repetition_penalty=1.3, logit_bias=((7, 3.0),)),
    SamplingParams(seed=4, min_tokens=7, stop_token_ids=(5,), top_k=10),
    SamplingParams(temperature=0.0, min_tokens=6),
    SamplingParams(seed=6, temperature=0.7, min_p=0.1, top_p=0.8),
]


@pytest.mark.parametrize("index", range(len(REQUESTS)))
def test_point_mass_drafts_emit_what_sample_emits_row_by_row(index):
    """Penalties over the history with the drafts in it, min_tokens lifting mid-draft, grammar
    masks per row: n-gram verification is `sample()` on each row, bit for bit."""
    rng = np.random.default_rng(10 + index)
    vocab, k = 80, 4
    request = SamplingRow(REQUESTS[index], 4, [1, 2, 3, 9], [9, 9, 7, 1], eos_token_ids=(2,))
    masks = [None if index % 2 else bitmask(rng.choice(vocab, 40, replace=False).tolist())
             for _ in range(k + 1)]
    accepted = []
    for trial in range(12):
        logits = (3 * rng.normal(size=(k + 1, vocab))).astype(np.float32)
        drafts: list[int] = []  # mostly what the rows draw, so that some get accepted
        for j in range(k):
            token = sample_row(logits, request, drafts, masks[j])
            drafts.append(token if rng.random() < 0.8 else int(rng.integers(vocab)))
        expected = one_at_a_time(logits, request, drafts, masks)
        batch = DraftBatch.build([request], [drafts], [masks if index % 2 == 0 else None])
        got = rejection_sample(mx.array(logits), batch).to_host()[0]
        assert got.token_ids == expected, f"trial {trial}"
        accepted.append(len(expected) - 1)
    assert max(accepted) >= 2 and min(accepted) < k


def test_no_drafts_is_sample_bit_for_bit():
    logits = logits_for(5, 4.0, len(MIXED))
    masks = [None if r.allowed_tokens is None else [r.allowed_tokens] for r in MIXED]
    batch = DraftBatch.build(MIXED, [[] for _ in MIXED], masks)
    got = rejection_sample(mx.array(logits), batch).to_host()
    tokens = sample(mx.array(logits), SamplingBatch.build(MIXED))
    lps = compute_logprobs(mx.array(logits), tokens, [r.params.logprobs for r in MIXED])
    expected = lps.to_host(tokens.tolist())
    assert [o.token_ids for o in got] == [[t] for t in tokens.tolist()]
    assert [o.logprobs for o in got] == [None if i not in expected else [expected[i]]
                                         for i in range(len(MIXED))]


def test_a_draft_the_grammar_forbids_is_never_accepted():
    n, vocab = 300, 64
    allowed = [t for t in range(vocab) if t % 3]
    requests = [SamplingRow(SamplingParams(seed=i), 0, allowed_tokens=bitmask(allowed, 2))
                for i in range(n)]
    drafts = [[0, 1]] * n  # 0 is forbidden at the first row
    everything = bitmask(list(range(vocab)), 2)
    masks = [[bitmask(allowed, 2), everything, everything]] * n
    q = np.zeros((2 * n, vocab), np.float32)
    q[:, 0] = 1.0  # the draft was sure of it
    batch = DraftBatch.build(requests, drafts, masks)
    for probs in (None, mx.array(q)):
        got = rejection_sample(mx.zeros((3 * n, vocab)), batch, probs).to_host()
        assert {len(o.token_ids) for o in got} == {1}
        assert {o.token_ids[0] for o in got} <= set(allowed)


# ---- seeds, and one request's rows never touching another's -------------------------------


def seeded_batch(seed_offset: int) -> tuple[DraftBatch, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(12)
    n, k = 64, 3
    requests = [SamplingRow(SamplingParams(seed=i + seed_offset, temperature=1.2), 2)
                for i in range(n)]
    drafts = rng.integers(0, V, size=(n, k))
    logits = rng.normal(size=(n * (k + 1), V)).astype(np.float32)
    q = softmax(rng.normal(size=(n * k, V))).astype(np.float32)
    return DraftBatch.build(requests, drafts.tolist()), logits, q


@pytest.mark.parametrize("full_q", [False, True], ids=["point-mass", "draft-probs"])
def test_seeds_reproduce_and_differ_from_other_seeds(full_q):
    def tokens(seed_offset: int) -> list[list[int]]:
        batch, logits, q = seeded_batch(seed_offset)
        mx.random.seed(seed_offset + 100)  # the global stream must not matter
        verified = rejection_sample(mx.array(logits), batch, mx.array(q) if full_q else None)
        return [o.token_ids for o in verified.to_host()]

    assert tokens(0) == tokens(0)
    assert tokens(0) != tokens(1000)


VICTIMS = [
    (SamplingRow(SamplingParams(temperature=0.0, logprobs=2), 3), [4, 9]),
    (SamplingRow(SamplingParams(seed=21, logprobs=0), 0), []),
    (SamplingRow(SamplingParams(seed=22, temperature=0.9, top_k=8, presence_penalty=0.5), 2,
                 [1, 2], [3, 3]), [3, 3, 3]),
    (SamplingRow(SamplingParams(seed=23, min_p=0.05, min_tokens=4), 1, eos_token_ids=(2,)),
     [2, 11, 12, 13]),
]


def run_verification(requests: list[tuple[SamplingRow, list[int]]], logits: np.ndarray,
                     q: np.ndarray | None) -> list:
    masks = [None if r.allowed_tokens is None else [r.allowed_tokens] * (len(d) + 1)
             for r, d in requests]
    batch = DraftBatch.build([r for r, _ in requests], [d for _, d in requests], masks)
    verified: VerifiedTokens = rejection_sample(
        mx.array(logits), batch, None if q is None else mx.array(q))
    return verified.to_host()


@FEWER
@given(row=fuzzed_rows(), drafts=st.lists(st.integers(0, VOCAB - 1), max_size=3),
       position=st.integers(0, len(VICTIMS)), seed=st.integers(0, 2**16),
       full_q=st.booleans())
def test_a_fuzzed_request_leaves_the_others_bit_for_bit_alone(row, drafts, position, seed,
                                                               full_q):
    rng = np.random.default_rng(seed)
    requests = [*VICTIMS[:position], (row, drafts), *VICTIMS[position:]]
    sizes = [len(d) + 1 for _, d in requests]
    logits = (4 * rng.normal(size=(sum(sizes), VOCAB))).astype(np.float32)
    q = softmax(rng.normal(size=(sum(sizes) - len(sizes), VOCAB))).astype(np.float32)
    rows = np.split(np.arange(len(logits)), np.cumsum(sizes)[:-1])
    draft_rows = np.split(np.arange(len(q)), np.cumsum([s - 1 for s in sizes])[:-1])
    mine = [i for i in range(len(requests)) if i != position]

    together = run_verification(requests, logits, q if full_q else None)
    alone = run_verification(VICTIMS, logits[np.concatenate([rows[i] for i in mine])],
                             q[np.concatenate([draft_rows[i] for i in mine])] if full_q else None)
    assert [together[i] for i in mine] == alone
    own = together[position]
    assert 1 <= len(own.token_ids) <= len(drafts) + 1
    assert own.token_ids[:-1] == drafts[:len(own.token_ids) - 1]
    assert 0 <= own.token_ids[-1] < VOCAB


# ---- what the API refuses -------------------------------------------------------------------


def test_inputs_that_do_not_fit_the_batch_are_value_errors():
    request = SamplingRow(SamplingParams(seed=1), 0)
    batch = DraftBatch.build([request], [[1, 2]])
    with pytest.raises(ValueError, match=r"logits must be \[3, vocab\]"):
        rejection_sample(mx.zeros((2, 8)), batch)
    with pytest.raises(ValueError, match=r"draft_probs must be \[2, 8\]"):
        rejection_sample(mx.zeros((3, 8)), batch, mx.zeros((3, 8)))
    with pytest.raises(ValueError, match=r"draft token ids must be in \[0, 2\)"):
        rejection_sample(mx.zeros((3, 2)), batch)
    with pytest.raises(ValueError, match="needs allowed_tokens"):
        verification_rows(SamplingRow(SamplingParams(), 0, allowed_tokens=bitmask([1], 1)), [1])
    with pytest.raises(ValueError, match="one draft list per request"):
        DraftBatch.build([request], [])
