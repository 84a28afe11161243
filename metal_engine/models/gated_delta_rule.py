"""The gated delta rule, Gated DeltaNet's linear attention, over a step's packed rows.

Each request carries a state `S [Hv, Dk, Dv]`. Per row, with q and k l2-normalized and q
scaled by `Dk ** -0.5` (each key head serves `Hv // Hk` consecutive value heads):

    S = exp(g) * S                          decay
    S = S + k^T (beta * (v - k S))          delta-rule write: correct what S recalls for k
    o = q S

Decode rows (one per request) take that step directly, all of them batched; longer runs take
the chunked form, which solves 64 rows at a time with matmuls and carries S between chunks.
Each form pads its requests' rows to one length; a padding row (k = v = g = beta = 0) leaves
S unchanged and its output is dropped.

    rows:        | req0: 5 rows | req1: 1 row | req2: 3 rows |
    cu_seqlens:  0              5             6              9
    chunked:     [[r0 r0 r0 r0 r0], [r2 r2 r2 -- --]]     recurrent: [[r1]]
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from kernels_metal.cpu_math import exp

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


class DeltaRuleResult(NamedTuple):
    out: mx.array  # [total_q, Hv, Dv]
    state: mx.array  # [num_seqs, Hv, Dk, Dv] float32: each request's state after its rows


def l2_normalize(x: mx.array, eps: float = L2NORM_EPS) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


class PaddedRows:
    """Gathers packed rows of requests into `[num_seqs, length, ...]` and back."""

    def __init__(self, cu_seqlens, multiple: int = 1) -> None:
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        lens = np.diff(cu)
        self.num_seqs, self.total = len(lens), int(cu[-1])
        self.length = max(1, -(-int(lens.max(initial=0)) // multiple)) * multiple
        offsets = np.arange(self.length)
        valid = offsets < lens[:, None]
        # Padding points at one zero row appended after the packed rows.
        self._gather = mx.array(np.where(valid, cu[:-1, None] + offsets, self.total))
        self._valid = mx.array(np.flatnonzero(valid.ravel()))

    def pad(self, x: mx.array) -> mx.array:
        zero_row = mx.zeros((1, *x.shape[1:]), dtype=x.dtype)
        return mx.concatenate([x, zero_row])[self._gather]

    def unpad(self, y: mx.array) -> mx.array:
        return y.reshape(-1, *y.shape[2:])[self._valid]


def _prepare_qk(q: mx.array, k: mx.array, num_v_heads: int, normalize_qk: bool):
    q, k = q.astype(mx.float32), k.astype(mx.float32)
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    repeats = num_v_heads // k.shape[-2]
    if repeats > 1:
        q, k = mx.repeat(q, repeats, axis=-2), mx.repeat(k, repeats, axis=-2)
    return q, k


def _padded_inputs(q, k, v, g, beta, rows: PaddedRows, normalize_qk: bool):
    """All five inputs float32, heads grouped, padded to `[num_seqs, length, Hv, ...]`."""
    q, k = _prepare_qk(q, k, v.shape[-2], normalize_qk)
    others = (x.astype(mx.float32) for x in (v, g, beta))
    return [rows.pad(x) for x in (q, k, *others)]


def recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state: mx.array,
                               normalize_qk: bool = True) -> DeltaRuleResult:
    """The rule row by row: `q, k [total_q, Hk, Dk]`, `v [total_q, Hv, Dv]`, `g` (log decay,
    <= 0) and `beta [total_q, Hv]`, `initial_state [num_seqs, Hv, Dk, Dv]`."""
    rows, dtype = PaddedRows(cu_seqlens), v.dtype
    q, k, v, g, beta = _padded_inputs(q, k, v, g, beta, rows, normalize_qk)
    state, outs = initial_state.astype(mx.float32), []
    for t in range(rows.length):
        out, state = _recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(out)
    out = rows.unpad(mx.stack(outs, axis=1))
    return DeltaRuleResult(out.astype(dtype), state)


def _recurrent_step(q, k, v, g, beta, state):
    """One row of every request: `q, k [B, H, Dk]`, `v [B, H, Dv]`, `g, beta [B, H]`."""
    state = state * mx.exp(g)[..., None, None]
    recalled = (k[..., None, :] @ state)[..., 0, :]
    delta = (v - recalled) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return (q[..., None, :] @ state)[..., 0, :], state


def chunked_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state: mx.array,
                             normalize_qk: bool = True,
                             chunk_size: int = CHUNK_SIZE) -> DeltaRuleResult:
    """The same rule as `recurrent_gated_delta_rule`, `chunk_size` rows per matmul.

    Chunks start at each request's first row given: a prefill chunk of any length continues
    from `initial_state`.
    """
    rows, dtype = PaddedRows(cu_seqlens, chunk_size), v.dtype
    q, k, v, g, beta = _padded_inputs(q, k, v, g, beta, rows, normalize_qk)
    num_seqs, length, heads, _ = v.shape
    chunks = length // chunk_size

    def split(x):  # [B, L, H, ...] -> [B, H, chunks, C, ...]
        x = x.reshape(num_seqs, chunks, chunk_size, heads, *x.shape[3:])
        return x.transpose(0, 3, 1, 2, *range(4, x.ndim))

    out, state = _chunked_scan(*map(split, (q, k, v, g, beta)), initial_state)
    out = out.transpose(0, 2, 3, 1, 4).reshape(num_seqs, length, heads, -1)
    return DeltaRuleResult(rows.unpad(out).astype(dtype), state)


def _chunked_scan(q, k, v, g, beta, state):
    """`q, k [B, H, N, C, Dk]`, `v [B, H, N, C, Dv]`, `g, beta [B, H, N, C]`."""
    chunk_size, value_dim = q.shape[-2], v.shape[-1]
    decay = mx.cumsum(g, axis=-1)  # log decay from the chunk's start through each row
    causal = mx.tril(mx.ones((chunk_size, chunk_size), dtype=mx.bool_))
    pairwise = exp(mx.where(causal, decay[..., :, None] - decay[..., None, :], -mx.inf))
    k_beta = k * beta[..., None]
    # Row i's write depends on the writes of rows j < i: a unit lower triangular system.
    earlier = mx.tril(mx.ones((chunk_size, chunk_size), dtype=mx.bool_), k=-1)
    writes = (k_beta @ k.swapaxes(-1, -2)) * pairwise
    system = mx.where(earlier, writes, 0.0) + mx.eye(chunk_size)
    rhs = mx.concatenate([v * beta[..., None], k_beta * mx.exp(decay)[..., None]], axis=-1)
    solved = mx.linalg.solve_triangular(system, rhs, upper=False, stream=mx.cpu)
    # Values written from a zero state, and the keys through which the real state corrects them.
    fresh_values, state_keys = solved[..., :value_dim], solved[..., value_dim:]
    scores = (q @ k.swapaxes(-1, -2)) * pairwise
    q_decayed = q * mx.exp(decay)[..., None]
    k_to_end = k * mx.exp(decay[..., -1:] - decay)[..., None]
    chunk_decay = mx.exp(decay[..., -1])[..., None, None]
    outs = []
    for i in range(q.shape[2]):
        values = fresh_values[:, :, i] - state_keys[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + scores[:, :, i] @ values)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].swapaxes(-1, -2) @ values
    return mx.stack(outs, axis=2), state


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
