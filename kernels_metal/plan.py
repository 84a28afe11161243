"""Split one packed step between the decode and the prefill kernel, once per step (numpy).

    packed rows:  | req0: 6-row chunk | req1: 1 | req2: 1 | req3: 20-row chunk |
    decode rows:                        r1       r2                            -> decode kernel
    prefill tiles:  [req0 rows 0..5]                      [req3 0..15][16..19]  -> tiled kernel
    output:       in packed order: the prefill launch writes its rows in place and copies
                  the decode kernel's rows into theirs (`run_plan`).

Requests with at most `decode_max_query_len` query rows (decodes, short speculative runs) go
to the per-token kernel, the rest to the tiled kernel, so a co-scheduled prefill chunk never
changes how a decode row is computed. A request with rows that see past their own position
(an image's, `AttentionMetadata.last_keys`) goes to the tiled kernel's variant that reads each
row's last key, whatever its length. Every layer of the step reuses the plan.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache

import mlx.core as mx
import numpy as np

from kernels_metal.decode import MAX_HEADS_PER_THREADGROUP, DecodeLaunch, pool_inputs
from kernels_metal.metadata import AttentionMetadata
from kernels_metal.prefill import (
    LARGE_HEAD_DIM,
    LARGE_HEAD_SIMDGROUPS,
    MAX_SIMDGROUPS,
    PrefillLaunch,
    query_block,
)

DECODE_MAX_QUERY_LEN = 4
PARTITION_SIZE = 512  # keys per split-K partition of a long decode context
# Below this many decode threadgroups the GPU has idle cores: split long contexts. From the
# device: THREADGROUPS_PER_CORE per GPU core; the constant when the core count is unknown.
SPLIT_BELOW_THREADGROUPS = 128
THREADGROUPS_PER_CORE = 4
# GPU cores of Apple's chip tiers (M1-M4, a typical count), by name and by the letter that
# ends the architecture name (applegpu_g15s: an M3 Pro).
CORES_BY_TIER = {"Ultra": 64, "Max": 32, "Pro": 16}
CORES_BY_ARCH_LETTER = {"d": 64, "c": 32, "s": 16, "g": 10}
MIN_METADATA_ELEMENTS = 8  # MLX passes smaller inputs in `constant` space: another kernel source
LOG2E = math.log2(math.e)
FLT_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class PlanOptions:
    decode_max_query_len: int = DECODE_MAX_QUERY_LEN
    partition_size: int | None = None  # None: split only when the GPU would be under-filled
    split_below_threadgroups: int | None = None  # None: from the device (split_threshold)

    def with_partition(self, partition_size: int | None) -> PlanOptions:
        return replace(self, partition_size=partition_size)

    def every_row_apart(self) -> PlanOptions:
        """Every query row to the per-token kernel, chunks' rows too (MLA's latent rows,
        which the tiled kernel does not take)."""
        return replace(self, decode_max_query_len=2**31 - 1)


def gpu_cores(info: dict) -> int | None:
    """GPU core count from `mx.device_info()`: its own key if it has one, else the chip tier."""
    for key in ("gpu_core_count", "core_count", "num_cores"):
        if isinstance(info.get(key), int) and info[key] > 0:
            return info[key]
    name = str(info.get("device_name", ""))
    if name.startswith("Apple M"):
        return next((n for tier, n in CORES_BY_TIER.items() if tier in name.split()), 10)
    arch = str(info.get("architecture", ""))
    if arch.startswith("applegpu_g") and arch[-1:] in CORES_BY_ARCH_LETTER:
        return CORES_BY_ARCH_LETTER[arch[-1]]
    return None


def split_threshold(info: dict | None = None) -> int:
    """Decode threadgroups below which long contexts are split: enough to fill each core
    (this device's without `info`)."""
    if info is None:
        return _device_split_threshold()
    cores = gpu_cores(info)
    return SPLIT_BELOW_THREADGROUPS if cores is None else THREADGROUPS_PER_CORE * cores


@cache
def _device_split_threshold() -> int:
    return split_threshold(_device_info())


@cache
def _device_info() -> dict:
    try:
        return dict(mx.device_info()) if mx.metal.is_available() else {}
    except (AttributeError, RuntimeError, ValueError):
        return {}


@dataclass(frozen=True)
class DecodeWork:
    rows: mx.array  # [n, 4] int32: packed query row, request, context length, first key seen
    num_rows: int
    num_parts: int
    part_size: int
    heads_per_group: int  # query heads per threadgroup (NH)
    chunks: int  # threadgroups per KV head


@dataclass(frozen=True)
class PrefillWork:
    # [n, 8] int32: request, first q row, first out row, rows, first position, and with
    # `last_keys` the keys the tile's rows see at most
    tiles: mx.array
    num_tiles: int
    num_rows: int
    block_q: int
    heads_per_group: int
    chunks: int
    # [max(total_q, 8)] int32: each packed row's last visible key, for the tiled kernel's
    # variant that reads them; None: every row sees up to its own position
    last_keys: mx.array | None = None
    requests: tuple = field(default=(), compare=False, repr=False)  # what tiles are cut from
    variants: dict = field(default_factory=dict, compare=False, repr=False)

    def for_head_dim(self, head_dim: int) -> PrefillWork:
        """The same rows tiled for the prefill configuration of `head_dim` (cached)."""
        queries_per_kv = self.requests[-1]
        if prefill_config(queries_per_kv, head_dim) == (
                self.heads_per_group, self.chunks, self.block_q):
            return self
        if head_dim not in self.variants:
            self.variants[head_dim] = _prefill_work(*self.requests, head_dim)[0]
        return self.variants[head_dim]


@dataclass(frozen=True)
class KernelPlan:
    decode: DecodeWork | None
    prefill: PrefillWork | None
    block_tables: mx.array
    window: int | None  # keys a row sees, its own included; None: the whole context
    params: dict  # (heads, kv heads, scale, softcap) -> int32 params array, filled lazily


def head_chunks(queries_per_kv: int,
                max_heads: int = MAX_HEADS_PER_THREADGROUP) -> tuple[int, int]:
    """(query heads per threadgroup, threadgroups per KV head), at most `max_heads` each."""
    chunks = -(-queries_per_kv // max_heads)
    return -(-queries_per_kv // chunks), chunks


def prefill_config(queries_per_kv: int, head_dim: int | None = None) -> tuple[int, int, int]:
    """(heads per threadgroup, threadgroups per KV head, query rows per threadgroup) of the
    prefill kernel. From head dim 192 its registers (Q and O of 8 rows x D per simdgroup) can
    cap a pipeline below 256 threads: at most 4 simdgroups then."""
    simdgroups = MAX_SIMDGROUPS
    if head_dim is not None and head_dim >= LARGE_HEAD_DIM:
        simdgroups = LARGE_HEAD_SIMDGROUPS
    nh, chunks = head_chunks(queries_per_kv, simdgroups)
    return nh, chunks, query_block(nh, simdgroups)


def build_plan(meta: AttentionMetadata, num_heads: int, kv_heads: int,
               options: PlanOptions, window: int | None = None) -> KernelPlan:
    nh, chunks = head_chunks(num_heads // kv_heads)
    num_requests = meta.num_requests
    if num_requests and meta.cu_seqlens_q.tolist() == list(range(num_requests + 1)):
        # Decodes only: row r is request r's last, which sees all its seq_lens[r] keys.
        rows = list(range(num_requests))
        decode = _decode_table(rows, rows, meta.seq_lens.tolist(), nh, chunks, kv_heads,
                               options, window)
        return KernelPlan(decode, None, _padded_tables(meta.block_tables), window, {})
    cu = meta.cu_seqlens_q.astype(np.int64)
    q_lens = np.diff(cu)
    seq_lens = meta.seq_lens.astype(np.int64)
    last_keys, ahead = _rows_seeing_ahead(meta)
    is_decode = (q_lens <= options.decode_max_query_len) & ~ahead
    decode = _decode_work(cu, q_lens, seq_lens, np.flatnonzero(is_decode & (q_lens > 0)),
                          nh, chunks, kv_heads, options, window)
    prefill, _ = _prefill_work(cu, q_lens, seq_lens, np.flatnonzero(~is_decode), last_keys,
                               num_heads // kv_heads)
    return KernelPlan(decode, prefill, _padded_tables(meta.block_tables), window, {})


def _rows_seeing_ahead(meta: AttentionMetadata) -> tuple[np.ndarray | None, np.ndarray]:
    """(`meta.last_keys`, or None if no row sees past its own position; for each request,
    whether one of its rows does)."""
    if meta.last_keys is None:
        return None, np.zeros(meta.num_requests, bool)
    ahead = np.zeros(meta.num_requests, bool)
    row_ahead = meta.last_keys > meta.positions
    if not row_ahead.any():
        return None, ahead
    request_of_row = np.repeat(np.arange(meta.num_requests), np.diff(meta.cu_seqlens_q))
    ahead[request_of_row[row_ahead]] = True
    return meta.last_keys, ahead


class PlanLaunch:
    """A plan's kernels for one kind of layer (queries' dtype, heads, pool shape and kind,
    scale, soft-cap), made once per step: a layer's call then only binds its arrays."""

    def __init__(self, plan: KernelPlan, decode_kernels, prefill_kernel, dtype: mx.Dtype,
                 num_heads: int, k_pool, params: mx.array, value_dim: int | None = None) -> None:
        """`value_dim`: MLA's (`DecodeLaunch`); its plan has decode rows only."""
        self.plan, self.params = plan, params
        self.decode = self.prefill = None
        if value_dim is not None and plan.prefill is not None:
            raise ValueError("latent rows go to the decode kernel only: plan them with "
                             "PlanOptions.every_row_apart")
        if plan.decode is not None:
            self.decode = DecodeLaunch(decode_kernels, dtype, num_heads, k_pool, plan.decode,
                                       value_dim)
        if plan.prefill is not None:
            merged = (plan.decode.num_rows + plan.prefill.num_rows
                      if plan.decode is not None else None)
            self.prefill = PrefillLaunch(prefill_kernel, dtype, num_heads, k_pool, plan.prefill,
                                         merged)

    @property
    def launches(self) -> tuple:
        """What decides this step's launches besides the kind of layer (its dtype, heads,
        pool, options): which kernels run, the decode kernel split or not (with a reduce),
        the prefill kernel merging decode rows or not, reading last keys or not."""
        decode, prefill = self.decode, self.prefill
        return (decode is not None and (decode.split,),
                prefill is not None and (prefill.merge, self.plan.prefill.last_keys is not None))

    def __call__(self, q: mx.array, k_pool, v_pool, sinks: mx.array) -> mx.array:
        """Both kernels of the step, the output `[total_q, H, D]` in packed order (the
        queries' dtype). `sinks`: the kernels' form (`sink_input`).

        A step of decodes only or of prefill chunks only comes out of its kernel in packed
        order; in a mixed step the prefill launch writes its rows at their packed rows and
        copies the decode kernel's rows into place: no concatenate and no gather per layer.
        """
        plan, pools = self.plan, pool_inputs(k_pool, v_pool)
        if self.decode is None:
            return self.prefill(q, pools, plan.block_tables, self.params, sinks)
        decode = self.decode(q, pools, plan.block_tables, plan.decode.rows, self.params, sinks)
        if self.prefill is None:
            return decode
        return self.prefill(q, pools, plan.block_tables, self.params, sinks, decode,
                            plan.decode.rows)


def run_plan(plan: KernelPlan, decode_kernels, prefill_kernel, q: mx.array, k_pool: mx.array,
             v_pool: mx.array, params: mx.array, sinks: mx.array | None = None) -> mx.array:
    """`PlanLaunch` made and run once: `sinks` the layer's `[H]` sink logits, or None."""
    launch = PlanLaunch(plan, decode_kernels, prefill_kernel, q.dtype, q.shape[1], k_pool,
                        params)
    return launch(q, k_pool, v_pool, sink_input(sinks, q.shape[1]))


def sink_input(sinks: mx.array | None, num_heads: int) -> mx.array:
    """The kernels' `sinks`: each head's sink logit times log2(e) (they work in the exp2
    domain), clamped finite for fast math; None becomes -FLT_MAX, a sink of weight 0."""
    if sinks is None:
        return _no_sinks(num_heads)
    logits = mx.clip(sinks.astype(mx.float32) * LOG2E, -FLT_MAX, FLT_MAX)
    padding = MIN_METADATA_ELEMENTS - num_heads
    return logits if padding <= 0 else mx.concatenate([logits, mx.zeros((padding,))])


@cache
def _no_sinks(num_heads: int) -> mx.array:
    return mx.full((max(num_heads, MIN_METADATA_ELEMENTS),), -FLT_MAX, mx.float32)


def _rows_of(cu: np.ndarray, requests: np.ndarray) -> np.ndarray:
    if len(requests) == 0:
        return np.zeros(0, np.int64)
    lens = cu[requests + 1] - cu[requests]
    starts = np.repeat(cu[requests], lens)
    return starts + np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)


def _decode_work(cu, q_lens, seq_lens, requests, nh, chunks, kv_heads, options, window):
    if len(requests) == 0:
        return None
    rows = _rows_of(cu, requests)
    req = np.repeat(requests, q_lens[requests])
    ctx = seq_lens[req] - (cu[req + 1] - rows) + 1  # keys up to and including each row's own
    return _decode_table(rows.tolist(), req.tolist(), ctx.tolist(), nh, chunks, kv_heads,
                         options, window)


def _decode_table(rows: list[int], req: list[int], ctx: list[int], nh, chunks, kv_heads,
                  options, window) -> DecodeWork:
    """The decode kernel's work: packed row `rows[i]` of request `req[i]` sees `ctx[i]` keys
    (in plain ints: a decode step has a few rows, and a list is cheaper than numpy there)."""
    first = [max(c - window, 0) for c in ctx] if window is not None else [0] * len(ctx)
    max_ctx = max(c - f for c, f in zip(ctx, first, strict=True))  # the most keys a row sees
    part = options.partition_size
    if part is None:
        threshold = options.split_below_threadgroups or split_threshold()
        few = len(rows) * kv_heads * chunks < threshold
        part = PARTITION_SIZE if few and max_ctx > PARTITION_SIZE else max_ctx
    num_parts = -(-max_ctx // part)
    table = [*zip(rows, req, ctx, first, strict=True)] + [(0, 0, 0, 0)] * (2 - len(rows))
    return DecodeWork(mx.array(table, mx.int32), len(rows), num_parts, part, nh, chunks)


def _prefill_work(cu, q_lens, seq_lens, requests, last_keys, queries_per_kv, head_dim=None):
    """The tiled kernel's work for `requests`; with `last_keys` (per packed row), each
    tile's key count from them and the rows' last keys for the kernel."""
    if len(requests) == 0:
        return None, np.zeros(0, np.int64)
    nh, chunks, block_q = prefill_config(queries_per_kv, head_dim)
    lens = q_lens[requests]
    per_req = -(-lens // block_q)
    req = np.repeat(requests, per_req)
    tile_in_req = np.arange(per_req.sum()) - np.repeat(np.cumsum(per_req) - per_req, per_req)
    first = tile_in_req * block_q  # first query index of the tile within its request
    out_start = np.repeat(np.cumsum(lens) - lens, per_req) + first
    tiles = np.zeros((len(req), 8), np.int32)
    tiles[:, 0] = req
    tiles[:, 1] = cu[req] + first
    tiles[:, 2] = out_start
    tiles[:, 3] = np.minimum(block_q, q_lens[req] - first)
    tiles[:, 4] = seq_lens[req] - q_lens[req] + first
    rows = None
    if last_keys is not None:
        in_tile = np.arange(block_q) < tiles[:, 3:4]
        rows_seen = last_keys[np.minimum(tiles[:, 1:2] + np.arange(block_q), len(last_keys) - 1)]
        tiles[:, 5] = np.minimum(np.where(in_tile, rows_seen, -1).max(axis=1) + 1,
                                 seq_lens[tiles[:, 0]])
        rows = np.zeros(max(len(last_keys), MIN_METADATA_ELEMENTS), np.int32)
        rows[: len(last_keys)] = last_keys
    # Most keys first: the longest tiles start early instead of finishing last.
    tiles = tiles[np.argsort(-(tiles[:, 4] + tiles[:, 3]), kind="stable")]
    work = PrefillWork(mx.array(tiles), len(tiles), int(lens.sum()), block_q, nh, chunks,
                       None if rows is None else mx.array(rows),
                       (cu, q_lens, seq_lens, requests, last_keys, queries_per_kv))
    return work, _rows_of(cu, requests)


def _padded_tables(tables: np.ndarray) -> mx.array:
    num_reqs, max_blocks = tables.shape
    width = max(max_blocks, -(-MIN_METADATA_ELEMENTS // max(num_reqs, 1)))
    if width == max_blocks:
        return mx.array(tables)
    padded = np.zeros((num_reqs, width), np.int32)
    padded[:, :max_blocks] = tables
    return mx.array(padded)


def params_for(plan: KernelPlan, num_heads: int, kv_heads: int, scale: float,
               softcap: float | None = None) -> mx.array:
    """The int32 params both kernels read (layout in decode.py / prefill.py), cached per step."""
    key = (num_heads, kv_heads, scale, softcap)
    if key not in plan.params:
        d, f = plan.decode, plan.prefill
        work = d or f
        plan.params[key] = _params_array(
            num_heads, kv_heads, plan.block_tables.shape[1], d.part_size if d else 0,
            d.num_parts if d else 1, d.num_rows if d else 0, work.chunks, work.heads_per_group,
            _float_bits(scale * LOG2E), f.block_q if f else 0, plan.window or 0,
            _float_bits(softcap * LOG2E) if softcap else 0)
    return plan.params[key]


@lru_cache(maxsize=256)
def _params_array(*values: int) -> mx.array:
    """The params as a device array, shared by the steps that have the same (decode steps
    of one batch size do, until a block table grows a column)."""
    return mx.array([*values, *(0,) * (16 - len(values))], mx.int32)


def _float_bits(value: float) -> int:
    """The int32 of `value`'s float32 bits (struct: no numpy call per step)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]
