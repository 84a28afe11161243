"""Tiled paged attention for prefill chunks, on 8x8 `simdgroup_matrix` multiply-accumulate.

Launch geometry (threads; the threadgroup is `32 * NH * BQ / 8` threads):

    grid = (32 * NH * BQ / 8 * kv_heads * chunks, num_tiles, 1)
    threadgroup (x, y) = (KV head and head chunk, query tile: BQ rows of one request)

Each simdgroup owns 8 query rows of one query head; all simdgroups of a threadgroup share the
K/V tile that the threadgroup gathers through the block table into threadgroup memory (from a
quantized pool dequantized to T, as in decode.py), so a GQA group reads K/V once. Key tiles
past the last query row (or, with a sliding window, before the first row's window) are never
loaded; a simdgroup skips tiles none of its rows sees, and the mask is applied only on tiles
that cross the diagonal or a window edge (or hang over the end of the context). Scores are
soft-capped when the call asks for it; a head's attention sink joins each row's softmax once,
at the end. S = Q K^T and O += P V run on 8x8 matrices, and the online softmax runs in fp32
on the lanes' own matrix elements (`thread_elements()`): each row of an 8x8 matrix sits on 4
lanes (2 columns each), so a row's max and sum take two `simd_shuffle_xor` steps, P goes into
the P V product without a trip through threadgroup memory, and the running output is rescaled
element by element. This relies on the lane -> element layout of Apple GPUs (the one MLX's
steel attention relies on too; the emulator models it, `metal-serve doctor` checks it on a
Mac).

A step whose image rows see each other (Gemma's, `AttentionMetadata.last_keys`) runs a variant
with one more input: each packed row's last visible key (`LAST_KEYS_LIMITS`); its tiles load
keys up to the last any of their rows sees. The causal kernel stays as it is for other steps.
"""

from __future__ import annotations

import mlx.core as mx

from kernels_metal.decode import (
    FAST_MATH,
    HEAD_GROUP_SOURCE,
    QUANTIZED_STAGING_HEADER,
    SINK_FOLD_SOURCE,
    THREADGROUP_MEMORY_BUDGET,
    index_type,
    pool_inputs,
    pool_template,
)
from kernels_metal.kv_quant import QuantizedPool

MAX_SIMDGROUPS = 8
LARGE_HEAD_DIM = 192  # from here on at most LARGE_HEAD_SIMDGROUPS per threadgroup (plan.py)
LARGE_HEAD_SIMDGROUPS = 4


def prefill_tile(dtype_size: int, head_dim: int) -> int:
    """Keys per tile: the largest of 32/16/8 whose K and V buffers fit in the threadgroup
    memory budget."""
    ld = head_dim + 16 // dtype_size
    for tile in (32, 16, 8):
        if 2 * tile * ld * dtype_size <= THREADGROUP_MEMORY_BUDGET:
            return tile
    raise ValueError(f"head_dim {head_dim} is too large for the prefill kernel")


def query_block(heads_per_group: int, max_simdgroups: int = MAX_SIMDGROUPS) -> int:
    """Query rows per threadgroup: as many 8-row blocks (up to 4) as keep it at
    <= `max_simdgroups` simdgroups."""
    return 8 * max(1, min(4, max_simdgroups // heads_per_group))


# params: as decode.py: [10] = window (0: none); NH, CHUNKS and BQ are template constants.
# sinks: as decode.py (one logit per head, exp2 domain, -FLT_MAX: none); K/V inputs as decode.py.
# tiles: [req, q_row, out_row, num_q, first_pos, keys, 0, 0]; keys (with last_keys only):
# the tile's rows see keys 0 .. keys - 1 at most.
# MERGE: `out` holds every packed row: prefill rows go to their packed row, and threadgroups
# past the last tile copy one decode row each (its head group) from `dec_out` to the packed
# row `dec_rows` names; otherwise `out` holds the prefill rows only and dec_* are not read.
_PREFILL_START = """
  const int H = params[0], KVH = params[1], MB = params[2];
  const int WIN = params[10] > 0 ? params[10] : (1 << 30);  // row p sees keys > p - WIN
""" + HEAD_GROUP_SOURCE + """
  const int tid = int(thread_index_in_threadgroup);
  const int nthreads = int(threads_per_threadgroup.x);
  const int tile = int(threadgroup_position_in_grid.y);
  if (MERGE && tile >= tiles_shape[0]) {
    const int dr = tile - tiles_shape[0];
    const device uint4* from = (const device uint4*)(dec_out + (long(dr) * H + h0) * D);
    device uint4* to = (device uint4*)(out + (long(dec_rows[dr * 4]) * H + h0) * D);
    for (int i = tid; i < nh * int(D * sizeof(T) / 16); i += nthreads) {
      to[i] = from[i];
    }
    return;  // the whole threadgroup
  }
  const device int* info = tiles + tile * 8;
  const int req = info[0], q_start = info[1], nq = info[3], pos0 = info[4];
  const int out_start = MERGE ? q_start : info[2];
  const int sg = int(simdgroup_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);
  const int r0 = (sg / NH) * 8;  // first tile row of this simdgroup
  const int h = h0 + sg % NH;
  const int sg_rows = clamp(nq - r0, 0, 8);
  const bool active = sg % NH < nh && sg_rows > 0 && r0 < BQ;
  constexpr int LD = D + 16 / sizeof(T);
  constexpr int VPR = D * sizeof(T) / 16;  // 16-byte loads per key row (D is a multiple of 8)
  constexpr int VLD = LD * sizeof(T) / 16;  // the tile's row stride in 16-byte units
  constexpr int DC = D / 8;
  constexpr int KC = TK / 8;
  constexpr float MASKED = -FLT_MAX;  // finite: exact under any Metal math mode

  threadgroup uint4 k_raw[TK * VLD];
  threadgroup uint4 v_raw[TK * VLD];
  const threadgroup T* k_tg = (const threadgroup T*)k_raw;
  const threadgroup T* v_tg = (const threadgroup T*)v_raw;
  // This lane's row of every 8x8 matrix, and its two columns (Apple's thread_elements()).
  const int qid = lane / 4;
  const int fr = (qid & 4) + (lane / 2) % 4;
  const int fc = (qid & 2) * 2 + (lane % 2) * 2;
  const bool row_valid = fr < sg_rows;

  simdgroup_matrix<T, 8, 8> qm[DC];
  simdgroup_matrix<float, 8, 8> om[DC];
  #pragma clang loop unroll(full)
  for (int c = 0; c < DC; ++c) {
    om[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    #pragma clang loop unroll(full)
    for (int k = 0; k < 2; ++k) {
      const long at = (long(q_start + r0 + fr) * H + h) * D + c * 8 + fc + k;
      qm[c].thread_elements()[k] = active && row_valid ? q[at] : T(0);
    }
  }

  float m = MASKED;  // this lane's row: running max and sum (the same on its 4 lanes)
  float l = 0.0f;
  const int row_pos = pos0 + r0 + fr;
  const int sg_first = pos0 + r0;
  const int sg_last = pos0 + r0 + sg_rows - 1;
"""

# How far each row sees (the causal kernel's: to its own position) and what the tile loads.
CAUSAL_LIMITS = """
  const int row_sees_to = row_pos;  // the last key this lane's row sees
  const int sg_sees_to = sg_last;  // the last key any row of the simdgroup sees
  const int sg_all_see_to = sg_first;  // every row of the simdgroup sees the keys up to here
  const int n_keys = pos0 + nq;  // keys up to the tile's last query position
"""

# With `last_keys` (an int32 per packed row, AttentionMetadata.last_keys): an image's rows see
# up to its end. The tile loads keys up to the last any of its rows sees (tiles[5], plan.py).
LAST_KEYS_LIMITS = """
  const int row_sees_to = row_valid ? last_keys[q_start + r0 + fr] : row_pos;
  const int sg_sees_to = simd_max(row_valid ? row_sees_to : -1);
  const int sg_all_see_to = simd_min(row_valid ? row_sees_to : (1 << 30));
  const int n_keys = info[5];
"""

_PREFILL_LOOP = """
  const int k_first = max(0, pos0 - WIN + 1);  // the first key the tile's first row sees
  const device int* table = block_tables + long(req) * MB;
  // Staging as in the decode kernel: `tpk` threads per key, one block-table lookup each.
  const device uint4* k_src = (const device uint4*)k_pool;
  const device uint4* v_src = (const device uint4*)v_pool;
  const int tpk = nthreads / TK;
  const int jt = tid / tpk;
  const int sub = tid - jt * tpk;

  for (int k0 = k_first; k0 < n_keys; k0 += TK) {
    const int n = min(TK, n_keys - k0);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const bool live = jt < n;  // rows past the context stay zero: 0 * V must not be NaN
    IDX row = 0;
    if (live) {
      const int pos = k0 + jt;
      row = (IDX(table[pos / BS]) * BS + IDX(pos % BS)) * KVH + kvh;
    }
    if (KV_BITS != 0 && live) {
      stage_quantized_row<T, D, KV_BITS, KV_GROUP>((const device uchar*)k_pool, k_scales, row,
                                                   sub, tpk, k_raw + jt * VLD);
      stage_quantized_row<T, D, KV_BITS, KV_GROUP>((const device uchar*)v_pool, v_scales, row,
                                                   sub, tpk, v_raw + jt * VLD);
    } else {  // a float pool's row, or zeros
      for (int v = sub; v < VPR; v += tpk) {
        k_raw[jt * VLD + v] = live ? k_src[row * VPR + v] : uint4(0);
        v_raw[jt * VLD + v] = live ? v_src[row * VPR + v] : uint4(0);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (!active || k0 > sg_sees_to || k0 + n - 1 <= sg_first - WIN) {
      continue;  // no key of this tile is visible to this simdgroup's rows
    }
    simdgroup_matrix<float, 8, 8> sm[KC];
    #pragma clang loop unroll(full)
    for (int kc = 0; kc < KC; ++kc) {
      sm[kc] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      #pragma clang loop unroll(full)
      for (int c = 0; c < DC; ++c) {
        simdgroup_matrix<T, 8, 8> km;
        simdgroup_load(km, k_tg + kc * 8 * LD + c * 8, LD, ulong2(0, 0), true);
        simdgroup_multiply_accumulate(sm[kc], qm[c], km, sm[kc]);
      }
    }
    const bool masked = k0 + n - 1 > sg_all_see_to || k0 <= sg_last - WIN || n < TK ||
                        sg_rows < 8;
    float tile_max = MASKED;
    #pragma clang loop unroll(full)
    for (int kc = 0; kc < KC; ++kc) {
      #pragma clang loop unroll(full)
      for (int k = 0; k < 2; ++k) {
        float s = sm[kc].thread_elements()[k] * scale_log2;
        if (cap_log2 > 0.0f) {
          s = cap_log2 * precise::tanh(s / cap_log2);
        }
        const int col = kc * 8 + fc + k;
        const int key = k0 + col;
        if (masked && (col >= n || key > row_sees_to || key <= row_pos - WIN || !row_valid)) {
          s = MASKED;
        }
        sm[kc].thread_elements()[k] = s;
        tile_max = max(tile_max, s);
      }
    }
    tile_max = max(tile_max, simd_shuffle_xor(tile_max, ushort(1)));  // the row's 4 lanes
    tile_max = max(tile_max, simd_shuffle_xor(tile_max, ushort(8)));
    const float m_new = max(m, tile_max);
    const bool empty = m_new == MASKED;  // nothing visible to this row yet
    const float alpha = empty ? 1.0f : exp2(m - m_new);
    simdgroup_matrix<T, 8, 8> pm[KC];
    float sum = 0.0f;
    #pragma clang loop unroll(full)
    for (int kc = 0; kc < KC; ++kc) {
      #pragma clang loop unroll(full)
      for (int k = 0; k < 2; ++k) {
        const T p = T(empty ? 0.0f : exp2(sm[kc].thread_elements()[k] - m_new));
        pm[kc].thread_elements()[k] = p;
        sum += float(p);  // normalise by what the P V product really uses
      }
    }
    sum += simd_shuffle_xor(sum, ushort(1));
    sum += simd_shuffle_xor(sum, ushort(8));
    l = l * alpha + sum;
    m = m_new;
    #pragma clang loop unroll(full)
    for (int c = 0; c < DC; ++c) {
      om[c].thread_elements() *= alpha;  // the row rescale, on the lane's own elements
    }
    #pragma clang loop unroll(full)
    for (int kc = 0; kc < KC; ++kc) {
      #pragma clang loop unroll(full)
      for (int c = 0; c < DC; ++c) {
        simdgroup_matrix<T, 8, 8> vm;
        simdgroup_load(vm, v_tg + kc * 8 * LD + c * 8, LD);
        simdgroup_multiply_accumulate(om[c], pm[kc], vm, om[c]);
      }
    }
  }

  if (!active || !row_valid) {
    return;
  }
  float keep = 1.0f;
  {  // the row's attention sink joins its softmax here, once
""" + SINK_FOLD_SOURCE + """
  }
  const float inv = l > 0.0f ? keep / l : 0.0f;
  #pragma clang loop unroll(full)
  for (int c = 0; c < DC; ++c) {
    #pragma clang loop unroll(full)
    for (int k = 0; k < 2; ++k) {
      out[(long(out_start + r0 + fr) * H + h) * D + c * 8 + fc + k] =
          T(om[c].thread_elements()[k] * inv);
    }
  }
"""

PREFILL_SOURCE = _PREFILL_START + CAUSAL_LIMITS + _PREFILL_LOOP
PREFILL_LAST_KEYS_SOURCE = _PREFILL_START + LAST_KEYS_LIMITS + _PREFILL_LOOP
PREFILL_INPUTS = ["q", "k_pool", "v_pool", "k_scales", "v_scales", "block_tables", "tiles",
                  "params", "dec_out", "dec_rows", "sinks"]


def make_prefill_kernel(metal_kernel, last_keys: bool = False):
    """The tiled kernel; with `last_keys`, the one whose rows see up to a key of their own
    (an extra input), so that steps without image rows keep the causal kernel as it is."""
    return metal_kernel(
        name="paged_attention_prefill_last_keys" if last_keys else "paged_attention_prefill",
        input_names=PREFILL_INPUTS + ["last_keys"] * last_keys,
        output_names=["out"],
        source=PREFILL_LAST_KEYS_SOURCE if last_keys else PREFILL_SOURCE,
        header=QUANTIZED_STAGING_HEADER,
        compile_options=FAST_MATH,  # why it is safe: decode.py
    )


class PrefillLaunch:
    """The tiled kernel of one step for one kind of layer, made once (as `DecodeLaunch`).
    `merged_rows`: the step's packed rows when the launch also copies the decode kernel's
    rows into place (MERGE), else None. `kernel` is the variant `work` needs: with
    `work.last_keys`, `make_prefill_kernel(..., last_keys=True)`'s."""

    def __init__(self, kernel, dtype: mx.Dtype, num_heads: int,
                 k_pool: mx.array | QuantizedPool, work, merged_rows: int | None) -> None:
        self.kernel = kernel
        _, block_size, kv_heads, head_dim = k_pool.shape
        self.work = work = work.for_head_dim(head_dim)
        threads = 32 * work.heads_per_group * work.block_q // 8
        self.merge = merge = merged_rows is not None
        copies = merged_rows - work.num_rows if merge else 0
        self.spec = dict(
            template=[("T", dtype), ("D", head_dim), ("BS", block_size),
                      ("TK", prefill_tile(dtype.size, head_dim)), ("IDX", index_type(k_pool)),
                      ("NH", work.heads_per_group), ("CHUNKS", work.chunks),
                      ("BQ", work.block_q), ("MERGE", merge), *pool_template(k_pool)],
            grid=(threads * kv_heads * work.chunks, work.num_tiles + copies, 1),
            threadgroup=(threads, 1, 1),
            output_shapes=[(merged_rows if merge else work.num_rows, num_heads, head_dim)],
            output_dtypes=[dtype],
        )

    def __call__(self, q: mx.array, pools: list[mx.array], block_tables: mx.array,
                 params: mx.array, sinks: mx.array, decode_out: mx.array | None = None,
                 decode_rows: mx.array | None = None) -> mx.array:
        """`pools`: `pool_inputs` of the layer's pools; `decode_out`, `decode_rows` with MERGE."""
        tiles, last_keys = self.work.tiles, self.work.last_keys
        merge = decode_out is not None
        (out,) = self.kernel(
            inputs=[q, *pools, block_tables, tiles, params, decode_out if merge else q,
                    decode_rows if merge else tiles, sinks,
                    *([] if last_keys is None else [last_keys])], **self.spec)
        return out


def run_prefill(kernel, q, k_pool, v_pool, block_tables, work, params, sinks: mx.array,
                decode_out: mx.array | None = None, decode_rows: mx.array | None = None,
                ) -> mx.array:
    """Attention of the prefill rows, in request order: `[work.num_rows, H, D]` in the
    queries' dtype (as `run_decode`). `sinks` is the kernels' form of the layer's sinks
    (`plan.sink_input`).

    With `decode_out` (the decode kernel's `[n, H, D]` output for the rows whose packed
    indices are `decode_rows[:n, 0]`) the result is every packed row in packed order instead:
    `[q.shape[0], H, D]`, the decode rows copied into place by the same launch.
    """
    merged_rows = q.shape[0] if decode_out is not None else None
    launch = PrefillLaunch(kernel, q.dtype, q.shape[1], k_pool, work, merged_rows)
    return launch(q, pool_inputs(k_pool, v_pool), block_tables, params, sinks, decode_out,
                  decode_rows)
