"""Logprobs of the sampled tokens and of the most likely alternatives, computed on the device.

They are the model's raw log-softmax (see TokenLogprobs), taken from the logits before the
sampler touches them, for the rows whose request asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from metal_engine.outputs import TokenLogprobs
from scheduler.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class LogprobArrays:
    """Lazy device arrays for the batch rows that want logprobs."""

    rows: list[int]  # batch rows, in order
    num_top: list[int]  # k per row
    sampled: mx.array  # [L] logprob of each row's sampled token
    top_ids: mx.array  # [L, K] K = max k, by descending logprob
    top_logprobs: mx.array  # [L, K]

    def arrays(self) -> list[mx.array]:
        return [self.sampled, self.top_ids, self.top_logprobs]

    def to_host(self, token_ids: list[int]) -> dict[int, TokenLogprobs]:
        """Batch row -> its TokenLogprobs; `token_ids` are the batch's sampled tokens."""
        sampled = self.sampled.tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        return {
            row: TokenLogprobs(token_ids[row], sampled[i],
                               list(zip(top_ids[i][:k], top_logprobs[i][:k], strict=True)))
            for i, (row, k) in enumerate(zip(self.rows, self.num_top, strict=True))
        }


def compute_logprobs(logits: mx.array, token_ids: mx.array,
                     num_top: list[int | None]) -> LogprobArrays | None:
    """`logits [S, V]` (raw), sampled `token_ids [S]`, top-k per row (None: no logprobs)."""
    rows = [i for i, k in enumerate(num_top) if k is not None]
    if not rows:
        return None
    ks = [num_top[i] for i in rows]
    index = mx.array(np.array(rows, np.int32))
    selected = logits[index].astype(mx.float32)
    logprobs = selected - mx.logsumexp(selected, axis=-1, keepdims=True)
    sampled = mx.take_along_axis(logprobs, token_ids[index][:, None], axis=-1)[:, 0]
    # Every row takes the same top-MAX_LOGPROBS (cut to its own k on the host): which of tied
    # tokens a row reports must not depend on how many another row asked for.
    k = min(MAX_LOGPROBS, logprobs.shape[-1]) if max(ks) > 0 else 0
    if k == 0:
        empty = mx.zeros((len(rows), 0))
        return LogprobArrays(rows, ks, sampled, empty.astype(mx.int32), empty)
    top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    top_logprobs = mx.take_along_axis(logprobs, top_ids, axis=-1)
    order = mx.argsort(-top_logprobs, axis=-1)
    return LogprobArrays(rows, ks, sampled, mx.take_along_axis(top_ids, order, axis=-1),
                         mx.take_along_axis(top_logprobs, order, axis=-1))
