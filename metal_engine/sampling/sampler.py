"""Batched on-device sampling with per-row parameters.

One row per request that samples this step. All rows go through the same passes, each one an
identity for the rows that do not use it, so a row samples the same token whatever shares its
batch:

    grammar mask -> logit bias, min_tokens -> penalties -> (greedy rows: argmax)
    -> temperature -> min-p -> top-k, top-p -> Gumbel-max draw

A row with a seed draws its noise from a key derived from (seed, output index), so its tokens do
not depend on which other requests share the batch. Every parameter SamplingParams accepts stays
finite in float32 (see `SamplingBatch.build`): no value one request sends can make NaN or an
out-of-range index that reaches another row.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np

from metal_engine.sampling.penalties import Penalties, apply_penalties
from metal_engine.sampling.sampling_row import SamplingRow

_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as arrays, built on the host once per step."""

    temperature: np.ndarray  # [S] float32: 0 (greedy) or in [GREEDY_BELOW_TEMPERATURE, max]
    top_k: np.ndarray  # [S] int32; 0 = off
    top_p: np.ndarray  # [S] float32; 1 = off
    log_min_p: np.ndarray  # [S] float32; -inf = off
    seeds: list[int | None]  # per row: a seed mixed with the output index, or None
    all_greedy: bool
    # rows, token ids (any in [0, int32 max]: those past the vocabulary are dropped), values
    additions: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    penalties: Penalties | None
    allowed: tuple[np.ndarray, np.ndarray] | None  # [S, W] int32 bitmask, [S] bool: has one

    @classmethod
    def build(cls, rows: list[SamplingRow]) -> SamplingBatch:
        """The arrays of `rows`, each value in float32's safe range: a temperature below
        GREEDY_BELOW_TEMPERATURE is greedy and one past float32's range is its max; a top_p
        that rounds to 0 keeps the top token, a min_p that does is off."""
        params = [r.params for r in rows]
        basic = all(r.params.is_basic and r.allowed_tokens is None for r in rows)
        if basic and all(p.greedy and p.seed is None and p.top_k == 0 and p.top_p == 1
                         for p in params):
            return cls.greedy(len(rows))  # the same arrays, in short
        log_min_p = np.full(len(rows), -np.inf, np.float32)
        if not basic:
            min_p = np.array([p.min_p for p in params], np.float32)
            np.log(min_p, out=log_min_p, where=min_p > 0)
        temperature = np.array([0 if p.greedy else p.temperature for p in params], np.float64)
        np.minimum(temperature, _FLOAT32_MAX, out=temperature)
        return cls(
            temperature=temperature.astype(np.float32),
            # A top_k past any vocabulary is no filter; int32 holds every real one.
            top_k=np.array([min(p.top_k, _INT32_MAX) for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            log_min_p=log_min_p,
            seeds=[
                None if r.params.seed is None
                else hash((r.params.seed, r.num_output_tokens)) & 0xFFFFFFFF
                for r in rows
            ],
            all_greedy=all(p.greedy for p in params),
            additions=None if basic else _additions(rows),
            penalties=None if basic else Penalties.build(rows),
            allowed=None if basic else _allowed_bitmask(rows),
        )

    @classmethod
    def greedy(cls, num_rows: int) -> SamplingBatch:
        """`build` of rows that are all greedy with nothing else (the common step), in short:
        one read-only batch per row count, shared by the steps that have it."""
        return _greedy_batch(num_rows)


@cache
def _greedy_batch(num_rows: int) -> SamplingBatch:
    arrays = (np.zeros(num_rows, np.float32), np.zeros(num_rows, np.int32),
              np.ones(num_rows, np.float32), np.full(num_rows, -np.inf, np.float32))
    for a in arrays:
        a.flags.writeable = False
    temperature, top_k, top_p, log_min_p = arrays
    return SamplingBatch(temperature=temperature, top_k=top_k, top_p=top_p,
                         log_min_p=log_min_p, seeds=[None] * num_rows, all_greedy=True,
                         additions=None, penalties=None, allowed=None)


def sample(logits: mx.array, batch: SamplingBatch) -> mx.array:
    """`logits [S, V]` -> token ids `[S]` (lazy)."""
    logits = process_logits(logits, batch)
    greedy = mx.argmax(logits, axis=-1)
    if batch.all_greedy:
        return greedy
    logits = sampling_logits(logits, batch)
    drawn = mx.argmax(logits + _gumbel_noise(logits.shape, batch.seeds), axis=-1)
    return mx.where(mx.array(batch.temperature == 0), greedy, drawn)


def sampling_logits(logits: mx.array, batch: SamplingBatch) -> mx.array:
    """Processed logits -> the tempered, filtered logits a sampled row draws from: their
    softmax is the row's sampling distribution (a greedy row's is taken at temperature 1 and
    unused). Shared with the rejection sampler, which needs that distribution itself."""
    temperature = np.where(batch.temperature > 0, batch.temperature, 1.0)
    logits = logits / mx.array(temperature)[:, None]
    if (batch.log_min_p > -np.inf).any():
        # min-p keeps tokens with prob >= min_p * max prob, i.e. logit >= max + log(min_p).
        floor = mx.max(logits, axis=-1, keepdims=True) + mx.array(batch.log_min_p)[:, None]
        logits = mx.where(logits >= floor, logits, -mx.inf)
    if (batch.top_k > 0).any() or (batch.top_p < 1).any():
        logits = _filter_top_k_top_p(logits, batch.top_k, batch.top_p)
    return logits


def process_logits(logits: mx.array, batch: SamplingBatch) -> mx.array:
    """The float32 logits every row's choice is made from, before temperature and filters:
    grammar mask, logit bias, min_tokens suppression and penalties applied."""
    logits = logits.astype(mx.float32)
    if batch.allowed is not None:
        logits = mx.where(_expand_bitmask(*batch.allowed, logits.shape[-1]), logits, -mx.inf)
    if batch.additions is not None:
        rows, tokens, values = batch.additions
        inside = tokens < logits.shape[-1]  # an index past the end would write out of bounds
        if inside.any():
            rows, tokens, values = (mx.array(a[inside]) for a in (rows, tokens, values))
            logits = logits.at[rows, tokens].add(values)
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    return logits


def _additions(rows: list[SamplingRow]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(row, token, value) added to the logits: each logit_bias, and -inf on the stop tokens
    of rows that have not reached min_tokens yet. Ids no vocabulary has (negative, or past
    int32) cannot match a logit: they are left out."""
    entries = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias]
    for i, r in enumerate(rows):
        if r.num_output_tokens < r.params.min_tokens:
            eos = () if r.params.ignore_eos else r.eos_token_ids
            entries += [(i, t, -np.inf) for t in (*r.params.stop_token_ids, *eos)]
    entries = [e for e in entries if 0 <= e[1] <= _INT32_MAX]
    if not entries:
        return None
    rows_, tokens, values = zip(*entries, strict=True)
    return (np.array(rows_, np.int32), np.array(tokens, np.int32), np.array(values, np.float32))


def _allowed_bitmask(rows: list[SamplingRow]) -> tuple[np.ndarray, np.ndarray] | None:
    masks = [r.allowed_tokens for r in rows]
    constrained = np.array([m is not None for m in masks])
    if not constrained.any():
        return None
    width = next(len(m) for m in masks if m is not None)
    everything = np.full(width, -1, np.int32)
    return np.stack([everything if m is None else m for m in masks]), constrained


def _expand_bitmask(words: np.ndarray, constrained: np.ndarray, vocab: int) -> mx.array:
    """`[S, W]` int32 words -> `[S, vocab]` bool. Logits past the grammar tokenizer's words
    (a model vocab padded beyond the tokenizer) are allowed only in unconstrained rows."""
    missing = -(-vocab // 32) - words.shape[1]
    if missing > 0:
        padding = np.where(constrained[:, None], 0, -1).astype(np.int32)
        words = np.concatenate([words, np.broadcast_to(padding, (len(words), missing))], 1)
    bits = (mx.array(words)[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1
    return bits.reshape(len(words), -1)[:, :vocab].astype(mx.bool_)


def _filter_top_k_top_p(logits: mx.array, top_k: np.ndarray, top_p: np.ndarray) -> mx.array:
    """Mask to -inf every logit below the row's k-th largest and outside its top-p nucleus."""
    vocab = logits.shape[-1]
    ordered = -mx.sort(-logits, axis=-1)  # descending
    k = np.where(top_k > 0, np.minimum(top_k, vocab), vocab) - 1
    kth = mx.take_along_axis(ordered, mx.array(k)[:, None], axis=-1)
    probs = mx.softmax(ordered, axis=-1)
    mass_before = mx.cumsum(probs, axis=-1) - probs
    # The nucleus: smallest prefix of sorted tokens whose mass reaches top_p. The first is
    # always kept (a top_p that is 0 in float32 keeps it alone); top_p = 1 keeps every token
    # even where the rounded mass reaches 1 early.
    in_nucleus = (
        (mass_before < mx.array(top_p)[:, None]) | mx.array(top_p >= 1)[:, None]
        | (mx.arange(vocab) == 0)
    )
    smallest_kept = mx.min(mx.where(in_nucleus, ordered, mx.inf), axis=-1, keepdims=True)
    threshold = mx.maximum(kth, smallest_kept)
    return mx.where(logits >= threshold, logits, -mx.inf)


def _gumbel_noise(shape: tuple[int, ...], seeds: list[int | None]) -> mx.array:
    rows, vocab = shape
    if all(s is None for s in seeds):
        return mx.random.gumbel(shape=(rows, vocab))
    noise = [
        mx.random.gumbel(shape=(vocab,), key=mx.random.key(s)) if s is not None
        else mx.random.gumbel(shape=(vocab,))
        for s in seeds
    ]
    return mx.stack(noise)
