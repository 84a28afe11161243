"""Presence, frequency and repetition penalties over a batch of logits, on the device.

A penalty only touches the logits of tokens in a row's history, so the host lists each
penalized row's distinct history tokens as flat (row, token) entries with the factor and the
amount for each, and the device applies them with two scatters: no pass over the vocabulary.
A repetition penalty below 1 / MAX_REPETITION_PENALTY acts as that bound: its reciprocal
stays finite in float32 (SamplingParams allows any value above 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from scheduler.sampling_params import MAX_REPETITION_PENALTY

if TYPE_CHECKING:
    from metal_engine.sampling.sampling_row import SamplingRow


@dataclass(frozen=True)
class Penalties:
    """One entry per distinct history token of each penalized row."""

    rows: np.ndarray  # [N] int32
    tokens: np.ndarray  # [N] int32
    repetition: np.ndarray  # [N] float32: the row's repetition penalty
    subtract: np.ndarray  # [N] float32: frequency * output count + presence * (count > 0)

    @classmethod
    def build(cls, rows: list[SamplingRow]) -> Penalties | None:
        entries = [_entries(i, r) for i, r in enumerate(rows) if r.params.has_penalties]
        columns = [np.concatenate(column) for column in zip(*entries, strict=True)]
        return cls(*columns) if entries and len(columns[0]) else None  # None: nothing to do


def apply_penalties(logits: mx.array, penalties: Penalties) -> mx.array:
    """`logits [S, V]` float32 with the penalties applied, in vLLM's order.

    Repetition (HF / vLLM): a logit of a token seen in the prompt or output is divided by the
    penalty when positive and multiplied by it otherwise. Then, over the output tokens only
    (OpenAI): `logit -= frequency * count + presence * (count > 0)`.
    """
    # An id outside the logits has nothing to penalize (and would index out of bounds).
    inside = (penalties.tokens >= 0) & (penalties.tokens < logits.shape[-1])
    if not inside.any():
        return logits
    rows, tokens = mx.array(penalties.rows[inside]), mx.array(penalties.tokens[inside])
    repetition = mx.array(penalties.repetition[inside])
    factor = mx.where(logits[rows, tokens] > 0, 1 / repetition, repetition)
    logits = logits.at[rows, tokens].multiply(factor)
    return logits.at[rows, tokens].subtract(mx.array(penalties.subtract[inside]))


def _entries(row: int, sampling_row: SamplingRow) -> tuple[np.ndarray, ...]:
    params = sampling_row.params
    output = np.asarray(sampling_row.output_token_ids, np.int32)
    # Prompt tokens matter only to the repetition penalty.
    prompt = np.asarray(
        sampling_row.prompt_token_ids if params.repetition_penalty != 1 else (), np.int32
    )
    tokens, index = np.unique(np.concatenate([output, prompt]), return_inverse=True)
    counts = np.bincount(index[: len(output)], minlength=len(tokens)).astype(np.float32)
    subtract = params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return (
        np.full(len(tokens), row, np.int32), tokens.astype(np.int32),
        np.full(len(tokens), max(params.repetition_penalty, 1 / MAX_REPETITION_PENALTY),
                np.float32),
        subtract.astype(np.float32),
    )
