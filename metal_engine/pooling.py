"""Pooling on the runner's side: a pooling request's vector from the final hidden states of
the steps that compute its prompt.

A prompt may run over several steps (chunked prefill). "last" reads the row of the step that
ends the prompt; "cls" keeps the first row's state from the step that starts it; "mean"
keeps a running sum across the steps. Such state lives here, by request, until the request
pools or is released. A request that restarts (preempted, then recomputed) starts at
position 0 again, which resets its state.

    step rows:   | req a chunk 2 ........ | req b (whole prompt) | ...
                   a: sum += rows            b: vector = rows[-1] (last) / rows[0] (cls)
                   a pools: sum / n_prompt
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from scheduler.output import ScheduledRequest
from scheduler.pooling_params import PoolingParams

# Below this norm a vector is left as it is rather than divided (as torch's F.normalize).
NORM_EPS = 1e-12


class Pooler:
    """Turns each step's hidden states into the vectors of the requests that pool in it."""

    def __init__(self) -> None:
        self._sums: dict[str, mx.array] = {}  # mean pooling: the rows so far, summed
        self._firsts: dict[str, mx.array] = {}  # CLS pooling: the prompt's first row

    def arrays(self) -> list[mx.array]:
        """The running state, to evaluate with the step: left lazy, it would hold the step's
        graph, and with it the pools' old buffers (no in-place K/V write then)."""
        return [*self._sums.values(), *self._firsts.values()]

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._sums.pop(request_id, None)
            self._firsts.pop(request_id, None)

    def pool(self, scheduled: list[ScheduledRequest], cu_seqlens: np.ndarray,
             hidden: mx.array, logits: Callable[[mx.array], mx.array]) -> dict[str, mx.array]:
        """The vector of each request that pools in this step (queued, not evaluated), by
        request id; the running state of those that go on. `hidden`: `[total_q, hidden]`,
        request i's rows at `cu_seqlens[i]:cu_seqlens[i + 1]`; `logits`: the LM head, for
        requests that read token logits."""
        vectors = {}
        for i, s in enumerate(scheduled):
            if s.pooling is None:
                continue
            start, end = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            pooled = self._take(s, hidden[start:end])
            if s.pools:
                vectors[s.request_id] = _finish(pooled, s.pooling, logits)
        return vectors

    def _take(self, s: ScheduledRequest, rows: mx.array) -> mx.array | None:
        """Fold a share's rows into the request's state; its pooled rows once it pools."""
        kind, request_id = s.pooling.kind, s.request_id
        if kind == "last":
            return rows[-1:]
        if kind == "cls":
            if s.start_position == 0:
                self._firsts[request_id] = rows[:1]
            return self._firsts.pop(request_id) if s.pools else None
        total = rows.astype(mx.float32).sum(axis=0, keepdims=True)
        if s.start_position > 0:
            total = total + self._sums[request_id]
        if not s.pools:
            self._sums[request_id] = total
            return None
        self._sums.pop(request_id, None)
        return total / (s.start_position + len(s.token_ids))


def _finish(pooled: mx.array, params: PoolingParams,
            logits: Callable[[mx.array], mx.array]) -> mx.array:
    """The request's answer from its pooled row `[1, hidden]`: token logits, or the vector
    cut to `dimensions` and normalized as asked. float32, `[n]`."""
    if params.logit_token_ids:
        return logits(pooled)[0, mx.array(params.logit_token_ids)].astype(mx.float32)
    vector = pooled[0].astype(mx.float32)
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = vector / mx.maximum(mx.linalg.norm(vector), NORM_EPS)
    return vector
