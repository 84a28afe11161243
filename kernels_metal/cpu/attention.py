"""Paged attention for MLX's CPU backend, in numpy over zero-copy views of the K/V pools.

The pure-MLX reference gathers every request's K/V into fresh arrays, transposes them and runs
batched tiny matmuls that the CPU backend dispatches one by one; at eight decode requests over
1.3k-token contexts that cost ~6 ms a layer. Here each request's blocks are gathered once into
`[keys, kv_heads, head_dim]` and handed to BLAS as strided views (no transposed copies).
Decode rows over float32 pools go to compiled loops that read their keys where the pool holds
them (cpu_decode), as do the rows of short prefill chunks; longer prefill chunks fold blocks
of their keys into a running softmax (cpu_prefill).

Decode rows over other pools (float16, quantized) run here, with the softmax vectorized in
numpy and cascade attention: decode requests that start with the same blocks (agents with one
system prompt) are grouped, the blocks a group shares are gathered once and scored against all
its rows in one product per KV head, joined to each request's own keys in one softmax. Their
scores are built a bounded batch of requests at a time, so long contexts do not allocate
`rows x heads x keys` at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from kernels_metal.cpu import decode as cpu_decode
from kernels_metal.cpu import loops as cpu_loops
from kernels_metal.cpu import prefill as cpu_prefill
from kernels_metal.cpu.math import DENORMAL_EXP_BOUND, FEW_ROWS
from kernels_metal.kv_quant import HostPool, QuantizedPool, host_pool
from kernels_metal.metadata import AttentionMetadata
from kernels_metal.reference import paged_attention_reference

# Most score elements (rows x query heads x keys) one slice of work holds: 4 MB of fp32, small
# enough that the softmax passes over it mostly stay in cache.
SCORE_BUDGET = 1 << 20
NUMPY_DTYPES = (mx.float32, mx.float16)
# Row maxima inside this range leave scores unshifted before exp (see `_softmax`), in slices
# of at least ALWAYS_SHIFT_BELOW scores.
UNSHIFTED_MAX_RANGE = (-20.0, 60.0)
ALWAYS_SHIFT_BELOW = 1 << 14
# Prefill chunks of at most this many rows x keys go to cpu_decode's loops as rows of their
# own (a chat prompt's first chunk): numpy's slices cost ~0.7 ms a layer at 60 x 60.
COMPILED_PREFILL_SCORES = 1 << 13
# So do chunks of at most this many rows whatever their keys (a decode and its drafts): numpy
# gathers the request's every key first, and a step verifying 9 rows a request over ~1300 keys
# left the one compiled call for the layer-by-layer path (4 agents: 62 ms a step with 8
# drafts, 157 with 9). Each row reads its keys itself, and still wins at long contexts: one
# request's step, 9 rows at 6000 keys 125 ms against numpy's 201, 16 rows at 7000 225 vs 285.
COMPILED_CHUNK_ROWS = 16


@dataclass(frozen=True)
class Slice:
    """Decode rows that share one product, one a request, each over the first `num_keys` keys
    of its table (after any shared prefix), masked where `blocked` is True."""

    rows: np.ndarray  # packed row ids
    tables: np.ndarray  # [requests, blocks] after any shared prefix
    num_keys: int
    blocked: np.ndarray | None  # [requests, num_keys]
    prefix: int | None  # index of the plan's shared prefix these rows also attend to


@dataclass(frozen=True)
class CpuPlan:
    prefixes: list[np.ndarray]  # blocks a group of decode requests starts with
    slices: list[Slice]
    compiled: cpu_decode.DecodeRows | None = None  # decode rows for cpu_decode's loops
    chunks: list[cpu_prefill.Chunk] = field(default_factory=list)  # longer prefill chunks
    window: int | None = None


def supports(q: mx.array, k_pool: mx.array | QuantizedPool) -> bool:
    stored = isinstance(k_pool, QuantizedPool) or k_pool.dtype in NUMPY_DTYPES
    return stored and q.shape[1] % k_pool.shape[2] == 0


def attention_or_reference(q, k_pool, v_pool, meta: AttentionMetadata, scale: float,
                           window=None, softcap=None, sinks=None) -> mx.array:
    """`paged_attention_cpu` where it takes the pools (`supports`), else the pure-MLX
    reference: the CPU backend's attention where no kernel serves."""
    attend = paged_attention_cpu if supports(q, k_pool) else paged_attention_reference
    return attend(q, k_pool, v_pool, meta, scale, window, softcap, sinks)


def paged_attention_cpu(
    q: mx.array, k_pool: mx.array | QuantizedPool, v_pool: mx.array | QuantizedPool,
    meta: AttentionMetadata, scale: float,
    window: int | None = None, softcap: float | None = None, sinks: mx.array | None = None,
) -> mx.array:
    """Same contract as `paged_attention_reference`; numpy queries get a numpy answer."""
    plan = _plan(meta, q.shape[1], window, decodes_compiled(k_pool))
    host = isinstance(q, np.ndarray)  # the host forward's queries, float32
    queries = q if host else np.asarray(q.astype(mx.float32))  # [total_q, H, D]
    keys, values = _host(k_pool), _host(v_pool)
    sink_logits = None if sinks is None else _host_sinks(sinks)
    out = _attend_all(queries, keys, values, plan, scale, softcap, sink_logits)
    return out if host else mx.array(out).astype(q.dtype)


def write_and_attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_pool: mx.array,
                     v_pool: mx.array, meta: AttentionMetadata, scale: float,
                     window: int | None = None, softcap: float | None = None,
                     sinks: mx.array | None = None) -> np.ndarray:
    """The host forward's step of one layer: its float32 `k`, `v` rows written into the
    float pools' buffers, then `paged_attention_cpu` of `q` over them. One call, each pool
    viewed once (a float32 pool pair written in one compiled loop): as separate calls these
    cost ~20 us a layer."""
    keys, values = np.asarray(k_pool), np.asarray(v_pool)
    compiled = keys.dtype == np.float32
    if compiled:
        cpu_loops.write_slots(keys, values, meta.slot_mapping, k, v)
    else:
        write_rows(keys, k, meta.slot_mapping)
        write_rows(values, v, meta.slot_mapping)
    plan = _plan(meta, q.shape[1], window, compiled)
    sink_logits = None if sinks is None else _host_sinks(sinks)
    return _attend_all(q, keys, values, plan, scale, softcap, sink_logits)


def write_rows(pool: np.ndarray, rows: np.ndarray, slots: np.ndarray) -> None:
    """`rows [total_q, kv_heads, head_dim]` into slots `slots` of a float pool's buffer."""
    pool.reshape(-1, *pool.shape[2:])[slots] = rows


def decodes_compiled(k_pool: mx.array | QuantizedPool) -> bool:
    """Whether decode rows over this pool go to cpu_decode's loops (float32 pools do)."""
    return not isinstance(k_pool, QuantizedPool) and k_pool.dtype == mx.float32


def compiled_rows(meta: AttentionMetadata, num_heads: int,
                  window: int | None) -> cpu_decode.DecodeRows | None:
    """The step's rows as cpu_decode's rows when every row over float32 pools goes there
    (decode rows, short prefill chunks), else None."""
    plan = _plan(meta, num_heads, window, True)
    return None if plan.slices or plan.chunks else plan.compiled


def _plan(meta: AttentionMetadata, num_heads: int, window: int | None,
          compiled_decode: bool) -> CpuPlan:
    """The step's plan for these layers, built by the first of them."""
    key = ("cpu", window, num_heads, compiled_decode)
    plan: CpuPlan | None = meta.backend_plans.get(key)
    if plan is None:
        plan = meta.backend_plans[key] = build_plan(meta, num_heads, window, compiled_decode)
    return plan


def _host_sinks(sinks: mx.array) -> np.ndarray:
    return np.asarray(sinks.astype(mx.float32))


def _attend_all(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, plan: CpuPlan,
                scale: float, softcap: float | None, sinks: np.ndarray | None) -> np.ndarray:
    out = np.empty(queries.shape, np.float32)
    if (decode := plan.compiled) is not None:
        cpu_decode.attend(queries, keys, values, decode, scale, softcap, sinks, out)
    if plan.slices:
        _attend_slices(queries, keys, values, plan, scale, softcap, sinks, out)
    for chunk in plan.chunks:
        k, v = (_gather(pool, chunk.tables)[0] for pool in (keys, values))
        cpu_prefill.attend(queries, k, v, chunk, scale, plan.window, softcap, sinks, out)
    return out


def _attend_slices(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, plan: CpuPlan,
                   scale: float, softcap: float | None, sinks: np.ndarray | None,
                   out: np.ndarray) -> None:
    kv_heads = keys.shape[2]
    prefixes = [tuple(_gather(pool, blocks[None])[0] for pool in (keys, values))
                for blocks in plan.prefixes]
    for part in plan.slices:
        k = _gather(keys, part.tables)[:, :part.num_keys]
        v = _gather(values, part.tables)[:, :part.num_keys]
        shared = None if part.prefix is None else prefixes[part.prefix]
        out[part.rows] = _attend(queries[part.rows], k, v, shared,
                                 part, kv_heads, scale, softcap, sinks)


def _host(pool: mx.array | QuantizedPool) -> np.ndarray | HostPool:
    """Zero-copy numpy views of a pool (of a quantized one's codes and scales)."""
    return host_pool(pool) if isinstance(pool, QuantizedPool) else np.asarray(pool)


def _gather(pool: np.ndarray | HostPool, tables: np.ndarray) -> np.ndarray:
    """Blocks `[R, n]` -> `[R, n * block_size, kv_heads, head_dim]` float32 (a copy; a
    quantized pool's dequantized)."""
    blocks = pool.gather(tables) if isinstance(pool, HostPool) else pool[tables]
    r, n, bs, kvh, d = blocks.shape
    kv = blocks.reshape(r, n * bs, kvh, d)
    return kv if kv.dtype == np.float32 else kv.astype(np.float32)


def _attend(rows: np.ndarray, k: np.ndarray, v: np.ndarray,
            shared: tuple[np.ndarray, np.ndarray] | None, part: Slice, kv_heads: int,
            scale: float, softcap: float | None, sinks: np.ndarray | None) -> np.ndarray:
    """Softmax attention of one decode row a request, `rows [R, H, D]`, over their keys (and
    the shared ones, and each head's sink logit)."""
    num_requests = k.shape[0]
    heads, head_dim = rows.shape[1], rows.shape[2]
    g = heads // kv_heads
    # [R, kvh, g, D]: a KV head's query heads together, so one product serves them all.
    q = rows.reshape(num_requests, kv_heads, g, head_dim) * np.float32(scale)
    scores = _scores(q, k)  # [R, kvh, g, keys]
    shared_scores = by_request = None
    if shared is not None:
        # Every request's heads of a KV head against the shared keys: [kvh, R * g, Ls],
        # and the same as a view by request, [R, kvh, g, Ls].
        q_by_head = q.transpose(1, 0, 2, 3).reshape(1, kv_heads, -1, head_dim)
        shared_scores = _scores(q_by_head, shared[0][None])[0]
        by_request = shared_scores.reshape(kv_heads, num_requests, g, -1).transpose(1, 0, 2, 3)
    if softcap is not None:
        for s in (scores, shared_scores):
            if s is not None:
                np.tanh(s / softcap, out=s)
                s *= softcap
    blocked = None if part.blocked is None else (scores, part.blocked[:, None, None, :])
    # Sink logits `[H]` laid out as the score rows: `[1, kvh, g, 1]`.
    sink_logits = None if sinks is None else sinks.reshape(1, kv_heads, g, 1)
    total = _softmax(scores, by_request, blocked, sink_logits)
    out = scores @ v.transpose(0, 2, 1, 3)  # [R, kvh, g, D]
    if shared_scores is not None:
        shared_out = shared_scores @ shared[1].transpose(1, 0, 2)  # [kvh, R * g, D]
        out += shared_out.reshape(kv_heads, num_requests, g, head_dim).transpose(1, 0, 2, 3)
    out /= total
    return out.reshape(num_requests, heads, head_dim)


def _softmax(scores: np.ndarray, shared: np.ndarray | None,
             blocked: tuple[np.ndarray, np.ndarray] | None,
             sinks: np.ndarray | None = None) -> np.ndarray:
    """Unnormalized softmax weights in place over the last axis of `scores` and `shared`
    (the same rows' shared keys) together; returns the rows' totals, which include the
    weight of each row's `sinks` logit (a key with no value). `blocked` is a view of
    `scores` and the mask of its entries that get no weight."""
    if blocked is not None:
        np.copyto(blocked[0], -np.inf, where=blocked[1])
    row_max = scores.max(axis=-1, keepdims=True)
    if shared is not None:
        np.maximum(row_max, shared.max(axis=-1, keepdims=True), out=row_max)
    if sinks is not None:
        np.maximum(row_max, sinks, out=row_max)
    # Softmax does not change with a shift of a row. A large slice is shifted by its row
    # maxima only if one of them lies outside the range where exp is safe to take unshifted;
    # for a small one the check costs more than the shift.
    low, high = UNSHIFTED_MAX_RANGE
    shift = scores.size < ALWAYS_SHIFT_BELOW or not low < row_max.min() <= row_max.max() < high
    if shift:
        scores -= row_max
    _exp_floored(scores)
    if blocked is not None:  # exactly 0: a floored e^-87 times a small value is a denormal
        np.copyto(blocked[0], 0.0, where=blocked[1])
    total = scores.sum(axis=-1, keepdims=True)
    if shared is not None:
        if shift:
            shared -= row_max
        total += _exp_floored(shared).sum(axis=-1, keepdims=True)
    if sinks is not None:  # unfloored: a sink of -inf weighs exactly 0
        total += np.exp(sinks - row_max) if shift else np.exp(sinks)
    return total


def _exp_floored(values: np.ndarray) -> np.ndarray:
    """exp in place, arguments floored at DENORMAL_EXP_BOUND so results stay normal floats
    (denormals slow every product after them)."""
    if values.flags.c_contiguous and values.dtype == np.float32:
        cpu_loops.exp(values.reshape(-1))  # floors at the same bound
        return values
    np.maximum(values, DENORMAL_EXP_BOUND, out=values)
    return np.exp(values, out=values)


def _scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """`q [B, kvh, rows, D]` against `k [B, keys, kvh, D]`: contiguous `[B, kvh, rows, keys]`.

    BLAS reads a KV head's `[keys, D]` slice of the gathered K (rows strided over the heads)
    as a plain matrix, but takes it transposed several times slower when there are few query
    rows (decode); then the product runs keys-major and the small result is transposed.
    """
    k_by_head = k.transpose(0, 2, 1, 3)
    if q.shape[2] >= FEW_ROWS:
        return q @ k_by_head.transpose(0, 1, 3, 2)
    keys_major = k_by_head @ np.ascontiguousarray(q.transpose(0, 1, 3, 2))
    return np.ascontiguousarray(keys_major.transpose(0, 1, 3, 2))


def build_plan(meta: AttentionMetadata, num_heads: int, window: int | None = None,
               compiled_decode: bool = False) -> CpuPlan:
    """Plan the step's rows once; every layer with this window reuses the plan. Decode rows
    go to slices, or with `compiled_decode` to cpu_decode (with the short prefill chunks);
    prefill chunks to cpu_prefill.

    A slice holds at most SCORE_BUDGET scores (rows x `num_heads` x keys) unless one row
    alone needs more.
    """
    row_budget = SCORE_BUDGET // num_heads
    q_lens = np.diff(meta.cu_seqlens_q)
    decode, prefill = np.flatnonzero(q_lens == 1), np.flatnonzero(q_lens > 1)
    prefixes, slices, compiled = [], [], None
    if compiled_decode:
        rows = q_lens[prefill]
        short = prefill[(rows <= COMPILED_CHUNK_ROWS)
                        | (rows * meta.seq_lens[prefill] <= COMPILED_PREFILL_SCORES)]
        compiled = _compiled_rows(meta, decode, short, window)
        decode, prefill = decode[:0], np.setdiff1d(prefill, short)
    for group, shared in _decode_groups(meta, decode, window):
        prefix = None
        if len(shared):
            prefix = len(prefixes)
            prefixes.append(shared)
        slices += _decode_slices(meta, group, len(shared), prefix, window, row_budget)
    chunks = [_chunk(meta, int(r)) for r in prefill]
    return CpuPlan(prefixes, slices, compiled, chunks, window)


def _chunk(meta: AttentionMetadata, r: int) -> cpu_prefill.Chunk:
    """Request `r`'s prefill chunk, over the blocks that hold its keys."""
    start, end = int(meta.cu_seqlens_q[r]), int(meta.cu_seqlens_q[r + 1])
    seq_len = int(meta.seq_lens[r])
    tables = meta.block_tables[r : r + 1, : -(-seq_len // meta.block_size)]
    last_keys = None if meta.last_keys is None else meta.last_keys[start:end]
    return cpu_prefill.Chunk(start, end - start, seq_len - (end - start), tables, last_keys)


def _compiled_rows(meta: AttentionMetadata, decode: np.ndarray, prefill: np.ndarray,
                   window: int | None) -> cpu_decode.DecodeRows | None:
    """The decode requests' rows and every row of the `prefill` chunks as cpu_decode's rows:
    a chunk's row at position p attends to keys up to p (or its `meta.last_keys`), as a
    decode row there would."""
    starts, q_lens = meta.cu_seqlens_q[:-1], np.diff(meta.cu_seqlens_q)
    requests = np.concatenate([decode, prefill]).astype(np.int64)
    if not len(requests):
        return None
    counts = q_lens[requests]
    owner = np.repeat(requests, counts)  # each row's request
    rows = _ranges(starts[requests], counts)
    last_rows = np.repeat(starts[requests] + counts - 1, counts)
    seq_lens = (meta.seq_lens[owner] - (last_rows - rows)).astype(meta.seq_lens.dtype)
    first_keys = np.zeros_like(seq_lens) if window is None else np.maximum(seq_lens - window, 0)
    if meta.last_keys is not None:
        seq_lens = (meta.last_keys[rows] + 1).astype(seq_lens.dtype)
    request_rows = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return cpu_decode.DecodeRows(rows, request_rows, meta.block_tables[owner], seq_lens,
                                 first_keys)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`starts[i] .. starts[i] + counts[i]` for every i, concatenated."""
    if len(counts) and (counts == 1).all():
        return starts.astype(np.int64)
    return np.concatenate([np.arange(a, a + n)
                           for a, n in zip(starts.tolist(), counts.tolist(), strict=True)])


def _decode_groups(meta: AttentionMetadata, decode: np.ndarray,
                   window: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Decode requests grouped by their first block, each group with the blocks it shares;
    requests that share nothing go together in one group with no shared blocks.

    Equal block ids mean equal token prefixes (the prefix cache hands out one block per
    prefix). A windowed layer shares nothing: its rows see different parts of a prefix.
    """
    nothing = np.zeros(0, np.int64)
    if window is not None or not len(decode):
        return [(decode, nothing)] if len(decode) else []
    first = meta.block_tables[decode, 0]
    groups, alone = [], []
    for block in np.unique(first):
        group = decode[first == block]
        shared = _shared_blocks(meta, group)
        if len(shared):
            groups.append((group, shared))
        else:
            alone.append(group)
    if alone:
        groups.append((np.concatenate(alone), nothing))
    return groups


def _shared_blocks(meta: AttentionMetadata, decode: np.ndarray) -> np.ndarray:
    """The leading blocks all these decode requests have in common, if there are several."""
    if len(decode) < 2:
        return np.zeros(0, np.int64)
    # Every request keeps at least its newest key out of the shared part.
    full = (int(meta.seq_lens[decode].min()) - 1) // meta.block_size
    tables = meta.block_tables[decode, :full]
    differs = (tables != tables[0]).any(axis=0)
    common = int(np.argmax(differs)) if differs.any() else full
    return tables[0, :common].astype(np.int64)


def _decode_slices(meta: AttentionMetadata, decode: np.ndarray, num_shared: int,
                   prefix: int | None, window: int | None, row_budget: int) -> list[Slice]:
    """Decode requests, longest first, in batches whose padded keys fit the budget."""
    bs = meta.block_size
    shared_len = num_shared * bs
    seq_lens = meta.seq_lens[decode].astype(np.int64)
    order = np.argsort(-seq_lens, kind="stable")
    slices, begin = [], 0
    while begin < len(order):
        count = max(1, row_budget // int(seq_lens[order[begin]]))
        longest = int(seq_lens[order[begin]]) - shared_len
        batch = order[begin : begin + count]
        begin += len(batch)
        own_lens = seq_lens[batch] - shared_len
        end_block = -(-longest // bs)
        # A window (never with a shared prefix) skips the blocks before every row's window.
        first_block = 0 if window is None else max(0, int(own_lens.min()) - window) // bs
        keys = np.arange(first_block * bs, longest)[None, :]  # no masked tail for the longest
        blocked = keys >= own_lens[:, None]
        if window is not None:
            blocked |= keys < own_lens[:, None] - window
        requests = decode[batch]
        first, end = num_shared + first_block, num_shared + end_block
        slices.append(Slice(
            rows=meta.cu_seqlens_q[requests].astype(np.int64),
            tables=meta.block_tables[requests, first:end],
            num_keys=keys.shape[1],
            blocked=blocked if blocked.any() else None,
            prefix=prefix,
        ))
    return slices
