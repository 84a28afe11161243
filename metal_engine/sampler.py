"""Batched on-device sampling with per-row parameters.

One row per request that samples this step. Greedy rows take the argmax; the others apply
temperature, top-k and top-p, then draw with the Gumbel-max trick. A row with a seed draws its
noise from a key derived from (seed, output index), so its tokens do not depend on which other
requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from scheduler.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as arrays, built on the host once per step."""

    temperature: np.ndarray  # [S] float32; 0 = greedy
    top_k: np.ndarray  # [S] int32; 0 = off
    top_p: np.ndarray  # [S] float32; 1 = off
    seeds: list[int | None]  # per row: a seed mixed with the output index, or None
    all_greedy: bool
    bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # rows, token ids, values

    @classmethod
    def build(cls, params: list[SamplingParams], num_outputs: list[int]) -> SamplingBatch:
        seeds = [
            None if p.seed is None else hash((p.seed, n)) & 0xFFFFFFFF
            for p, n in zip(params, num_outputs, strict=True)
        ]
        return cls(
            temperature=np.array([p.temperature for p in params], np.float32),
            top_k=np.array([p.top_k for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            seeds=seeds,
            all_greedy=all(p.greedy for p in params),
            bias=_bias_entries(params),
        )


def sample(logits: mx.array, batch: SamplingBatch) -> mx.array:
    """`logits [S, V]` -> token ids `[S]` (lazy)."""
    if batch.bias is not None:
        rows, tokens, values = (mx.array(a) for a in batch.bias)
        logits = logits.at[rows, tokens].add(values.astype(logits.dtype))
    greedy = mx.argmax(logits, axis=-1)
    if batch.all_greedy:
        return greedy
    logits = logits.astype(mx.float32)
    temperature = np.where(batch.temperature > 0, batch.temperature, 1.0)
    logits = logits / mx.array(temperature)[:, None]
    if (batch.top_k > 0).any() or (batch.top_p < 1).any():
        logits = _filter_top_k_top_p(logits, batch.top_k, batch.top_p)
    drawn = mx.argmax(logits + _gumbel_noise(logits.shape, batch.seeds), axis=-1)
    return mx.where(mx.array(batch.temperature == 0), greedy, drawn)


def _bias_entries(params: list[SamplingParams]):
    entries = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
    if not entries:
        return None
    rows, tokens, values = zip(*entries, strict=True)
    return (np.array(rows, np.int32), np.array(tokens, np.int32), np.array(values, np.float32))


def _filter_top_k_top_p(logits: mx.array, top_k: np.ndarray, top_p: np.ndarray) -> mx.array:
    """Mask to -inf every logit below the row's k-th largest and outside its top-p nucleus."""
    vocab = logits.shape[-1]
    ordered = -mx.sort(-logits, axis=-1)  # descending
    k = np.where(top_k > 0, np.minimum(top_k, vocab), vocab) - 1
    kth = mx.take_along_axis(ordered, mx.array(k)[:, None], axis=-1)
    probs = mx.softmax(ordered, axis=-1)
    mass_before = mx.cumsum(probs, axis=-1) - probs
    # The nucleus: smallest prefix of sorted tokens whose mass reaches top_p (first always kept).
    in_nucleus = mass_before < mx.array(top_p)[:, None]
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
