"""The gated delta rule, Gated DeltaNet's linear attention, over a step's packed rows.

Each request carries a state `S [Hv, Dk, Dv]`. Per row, with q and k l2-normalized and q
scaled by `Dk ** -0.5` (each key head serves `Hv // Hk` consecutive value heads):

    S = exp(g) * S                          decay
    S = S + k^T (beta * (v - k S))          delta-rule write: correct what S recalls for k
    o = q S

Decode rows (one per request) take that step directly, all of them batched; longer runs take
the chunked form, which solves 64 rows at a time with matmuls and carries S between chunks.
Both walk the requests' rows (or chunks) step by step, all requests together; a request's
last chunk is padded with rows (k = v = g = beta = 0) that leave S unchanged.

    rows:        | req0: 5 rows | req1: 1 row | req2: 3 rows |
    cu_seqlens:  0              5             6              9
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


class DeltaRuleResult(NamedTuple):
    out: mx.array  # [total_q, Hv, Dv]
    state: mx.array  # [num_seqs, Hv, Dk, Dv] float32: each request's state after its rows


def l2_normalize(x: mx.array, eps: float = L2NORM_EPS) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def _prepare_qk(q: mx.array, k: mx.array, num_v_heads: int, normalize_qk: bool):
    q, k = q.astype(mx.float32), k.astype(mx.float32)
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    repeats = num_v_heads // k.shape[-2]
    if repeats > 1:
        q, k = mx.repeat(q, repeats, axis=-2), mx.repeat(k, repeats, axis=-2)
    return q, k


class ChunkLayout:
    """Each request's rows cut into chunks of `chunk_size` (its last one padded), ordered
    step by step, requests with more chunks first: the requests still scanning at step j
    are then a prefix of the (sorted) states, and no request scans padding chunks.

        req0: 3 chunks, req1: 1, req2: 2      chunks:  | a0 c0 b0 | a1 c1 | a2 |
        order = [0, 2, 1]                     step:      0          1       2
    """

    def __init__(self, cu_seqlens, chunk_size: int) -> None:
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        lens, total = np.diff(cu), int(cu[-1])
        num_chunks = -(-lens // chunk_size)
        self.order = np.argsort(-num_chunks, kind="stable")
        self.rank = np.argsort(self.order)
        self.active = (num_chunks[:, None] > np.arange(num_chunks.max(initial=0))).sum(0)
        self.offsets = np.concatenate([[0], np.cumsum(self.active)])
        step = np.repeat(np.arange(len(self.active)), self.active)
        request = self.order[np.arange(self.offsets[-1]) - self.offsets[step]]
        local = step[:, None] * chunk_size + np.arange(chunk_size)
        valid = local < lens[request, None]
        # Padding points at one zero row appended after the packed rows.
        self._gather = mx.array(np.where(valid, cu[request, None] + local, total))
        row_request = np.repeat(np.arange(len(lens)), lens)
        row_local = np.arange(total) - cu[row_request]
        row_chunk = self.offsets[row_local // chunk_size] + self.rank[row_request]
        self._scatter = mx.array(row_chunk * chunk_size + row_local % chunk_size)

    def steps(self):
        """(the chunks of each step, how many requests still scan), in order."""
        for step, num_active in enumerate(self.active.tolist()):
            start = int(self.offsets[step])
            yield slice(start, start + num_active), num_active

    def chunk(self, x: mx.array) -> mx.array:
        """`[total_q, H, ...]` -> `[num_chunks, H, chunk_size, ...]`."""
        zero_row = mx.zeros((1, *x.shape[1:]), dtype=x.dtype)
        return mx.concatenate([x, zero_row])[self._gather].swapaxes(1, 2)

    def unchunk(self, y: mx.array) -> mx.array:
        return y.swapaxes(1, 2).reshape(-1, *y.shape[1:2], *y.shape[3:])[self._scatter]


def _chunked_inputs(q, k, v, g, beta, layout: ChunkLayout, normalize_qk: bool):
    """All five inputs float32, heads grouped, as `[num_chunks, Hv, chunk_size, ...]`."""
    q, k = _prepare_qk(q, k, v.shape[-2], normalize_qk)
    others = (x.astype(mx.float32) for x in (v, g, beta))
    return [layout.chunk(x) for x in (q, k, *others)]


def _carry(state: mx.array, running: mx.array) -> mx.array:
    """The sorted states with the still-running prefix replaced."""
    if len(running) == len(state):
        return running
    return mx.concatenate([running, state[len(running):]])


def recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state: mx.array,
                               normalize_qk: bool = True) -> DeltaRuleResult:
    """The rule row by row: `q, k [total_q, Hk, Dk]`, `v [total_q, Hv, Dv]`, `g` (log decay,
    <= 0) and `beta [total_q, Hv]`, `initial_state [num_seqs, Hv, Dk, Dv]`."""
    layout, dtype = ChunkLayout(cu_seqlens, 1), v.dtype
    rows = [x[:, :, 0] for x in _chunked_inputs(q, k, v, g, beta, layout, normalize_qk)]
    state, outs = initial_state.astype(mx.float32)[mx.array(layout.order)], []
    for step, num_active in layout.steps():
        out, running = _recurrent_step(*(x[step] for x in rows), state[:num_active])
        outs.append(out[:, :, None])
        state = _carry(state, running)
    out = mx.concatenate(outs) if outs else rows[2][:, :, None]
    return DeltaRuleResult(layout.unchunk(out).astype(dtype), state[mx.array(layout.rank)])


def _recurrent_step(q, k, v, g, beta, state):
    """One row of every request: `q, k [B, H, Dk]`, `v [B, H, Dv]`, `g, beta [B, H]`."""
    state = state * mx.exp(g)[..., None, None]
    recalled = (k[..., None, :] @ state)[..., 0, :]
    delta = (v - recalled) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return (q[..., None, :] @ state)[..., 0, :], state


class ChunkTerms(NamedTuple):
    """What each chunk contributes, all computed at once; the scan then only carries S."""

    fresh_values: mx.array  # [F, H, C, Dv] values written when the chunk starts from S = 0
    state_keys: mx.array  # [F, H, C, Dk] how the incoming S corrects those values
    scores: mx.array  # [F, H, C, C] decayed causal q.k within the chunk
    q_decayed: mx.array  # [F, H, C, Dk] q reading the incoming S, decayed to its row
    k_to_end: mx.array  # [F, H, C, Dk] k decayed to the chunk's end
    chunk_decay: mx.array  # [F, H, 1, 1] decay across the whole chunk


def chunked_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state: mx.array,
                             normalize_qk: bool = True,
                             chunk_size: int = CHUNK_SIZE) -> DeltaRuleResult:
    """The same rule as `recurrent_gated_delta_rule`, `chunk_size` rows per matmul.

    Chunks start at each request's first row given: a prefill chunk of any length continues
    from `initial_state`.
    """
    layout, dtype = ChunkLayout(cu_seqlens, chunk_size), v.dtype
    terms = _chunk_terms(*_chunked_inputs(q, k, v, g, beta, layout, normalize_qk))
    state = initial_state.astype(mx.float32)[mx.array(layout.order)]
    out, state = _scan(terms, state, layout)
    return DeltaRuleResult(layout.unchunk(out).astype(dtype), state[mx.array(layout.rank)])


def _chunk_terms(q, k, v, g, beta) -> ChunkTerms:
    """`q, k [F, H, C, Dk]`, `v [F, H, C, Dv]`, `g, beta [F, H, C]`."""
    chunk_size, value_dim = q.shape[-2], v.shape[-1]
    decay = mx.cumsum(g, axis=-1)  # log decay from the chunk's start through each row
    causal = mx.tril(mx.ones((chunk_size, chunk_size), dtype=mx.bool_))
    pairwise = mx.exp(mx.where(causal, decay[..., :, None] - decay[..., None, :], -mx.inf))
    k_beta = k * beta[..., None]
    # Row i's write depends on the writes of rows j < i: a unit lower triangular system.
    earlier = mx.tril(mx.ones((chunk_size, chunk_size), dtype=mx.bool_), k=-1)
    writes = (k_beta @ k.swapaxes(-1, -2)) * pairwise
    system = mx.where(earlier, writes, 0.0) + mx.eye(chunk_size)
    rhs = mx.concatenate([v * beta[..., None], k_beta * mx.exp(decay)[..., None]], axis=-1)
    solved = mx.linalg.solve_triangular(system, rhs, upper=False, stream=mx.cpu)
    return ChunkTerms(
        fresh_values=solved[..., :value_dim], state_keys=solved[..., value_dim:],
        scores=(q @ k.swapaxes(-1, -2)) * pairwise,
        q_decayed=q * mx.exp(decay)[..., None],
        k_to_end=k * mx.exp(decay[..., -1:] - decay)[..., None],
        chunk_decay=mx.exp(decay[..., -1])[..., None, None])


def _scan(terms: ChunkTerms, state: mx.array, layout: ChunkLayout):
    """Carry the sorted states through the chunks, step by step; `[F, H, C, Dv]` out."""
    outs = []
    for c, num_active in layout.steps():
        running = state[:num_active]
        values = terms.fresh_values[c] - terms.state_keys[c] @ running
        outs.append(terms.q_decayed[c] @ running + terms.scores[c] @ values)
        state = _carry(state, running * terms.chunk_decay[c]
                       + terms.k_to_end[c].swapaxes(-1, -2) @ values)
    return (mx.concatenate(outs) if outs else terms.fresh_values), state


def gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state: mx.array,
                     normalize_qk: bool = True) -> DeltaRuleResult:
    """The rule over a packed step: requests with one row take the recurrent step, the rest
    the chunked form; a request with no rows keeps its state. Shapes as the two forms."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lens = np.diff(cu)
    decode, chunked = np.flatnonzero(lens == 1), np.flatnonzero(lens > 1)
    if len(decode) == len(lens):
        return recurrent_gated_delta_rule(q, k, v, g, beta, cu, initial_state, normalize_qk)
    if len(chunked) == len(lens):
        return chunked_gated_delta_rule(q, k, v, g, beta, cu, initial_state, normalize_qk)
    out = mx.zeros((int(cu[-1]), *v.shape[1:]), dtype=v.dtype)
    state = initial_state.astype(mx.float32)
    row_request = np.repeat(np.arange(len(lens)), lens)
    for requests, form in ((decode, recurrent_gated_delta_rule),
                           (chunked, chunked_gated_delta_rule)):
        if len(requests) == 0:
            continue
        rows = mx.array(np.flatnonzero(np.isin(row_request, requests)))
        sub_cu = np.concatenate([[0], np.cumsum(lens[requests])])
        inputs = (x[rows] for x in (q, k, v, g, beta))
        part = form(*inputs, sub_cu, state[mx.array(requests)], normalize_qk)
        out[rows] = part.out
        state[mx.array(requests)] = part.state
    return DeltaRuleResult(out, state)
