"""Per-query-token paged attention with split-K partitions, and the log-sum-exp reduce.

Launch geometry (threads; the threadgroup is `32 * NH` threads, one simdgroup per query head):

    grid = (32 * NH * kv_heads * chunks, num_rows, num_parts)
    threadgroup (x, y, z) = (KV head and head chunk, decode row, key partition)

A row walks the keys it sees: from the start of its sliding window (or of the context) to
its own position. A threadgroup stages a tile of its KV head's keys and values in threadgroup
memory once and every simdgroup (one query head of the GQA group) reads it from there: K/V is
read from device memory once per group, not once per head. Within a tile each lane scores one
key (soft-capped when the call asks for it); the online softmax runs in fp32 in the exp2
domain (queries are pre-scaled by scale * log2(e)).

With one partition the kernel writes the final output; with several it writes each
partition's normalised output and (max, sum), and `reduce` merges them.
"""

from __future__ import annotations

import mlx.core as mx

THREADGROUP_MEMORY = 32768
MAX_HEADS_PER_THREADGROUP = 8


def decode_tile(dtype_size: int, head_dim: int) -> int:
    """Keys per staged tile: the largest of 32/16/8 whose buffers fit in threadgroup memory."""
    ldk = head_dim + 4 // dtype_size
    fixed = 4 * MAX_HEADS_PER_THREADGROUP * head_dim + 4 * MAX_HEADS_PER_THREADGROUP * 32
    for tile in (32, 16, 8):
        if fixed + 2 * tile * ldk * dtype_size <= THREADGROUP_MEMORY:
            return tile
    raise ValueError(f"head_dim {head_dim} is too large for the decode kernel")


def index_type(pool: mx.array) -> mx.Dtype:
    """Type of the kernels' K/V offsets (in 16-byte units): 32-bit unless the pool is > 64 GB."""
    return mx.uint32 if pool.nbytes // 16 < 2**32 else mx.int64


# Both kernels: score scale and soft-cap (exp2 domain; cap 0 = none), and which query heads
# this threadgroup serves (threadgroup x = KV head x chunk).
HEAD_GROUP_SOURCE = """
  const float scale_log2 = as_type<float>(params[8]);
  const float cap_log2 = as_type<float>(params[11]);
  const int qpg = H / KVH;
  const int kvh = int(threadgroup_position_in_grid.x) / CHUNKS;
  const int chunk = int(threadgroup_position_in_grid.x) % CHUNKS;
  const int h0 = kvh * qpg + chunk * NH;
  const int nh = min(NH, qpg - chunk * NH);
"""

# params: [H, KVH, max_blocks, part_size, num_parts, num_rows, chunks, NH, scale*log2e bits,
#          (prefill: BQ), (prefill: window), softcap*log2e bits]
# rows: [packed query row, request, context length, first key it sees] per decode row
DECODE_SOURCE = """
  const int H = params[0], KVH = params[1], MB = params[2], PART = params[3];
  const int NPARTS = params[4], NROWS = params[5], CHUNKS = params[6], NH = params[7];
""" + HEAD_GROUP_SOURCE + """
  const int row = int(threadgroup_position_in_grid.y);
  const int part = int(threadgroup_position_in_grid.z);
  const int q_row = rows[row * 4], req = rows[row * 4 + 1], ctx = rows[row * 4 + 2];
  const int k_begin = rows[row * 4 + 3] + part * PART;
  if (k_begin >= ctx) {
    return;  // the whole threadgroup: this row has fewer partitions than the grid
  }
  const int k_end = min(ctx, k_begin + PART);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);
  const int tid = int(thread_index_in_threadgroup);
  const int nthreads = int(threads_per_threadgroup.x);
  constexpr int LDK = D + 4 / sizeof(T);  // odd word stride: lanes reading rows avoid conflicts
  constexpr int LDW = LDK * sizeof(T) / 4;  // the same stride in 4-byte words
  constexpr int VPR = D * sizeof(T) / 16;  // 16-byte loads per key row (D is a multiple of 8)
  constexpr int NACC = (D + 31) / 32;
  constexpr float MASKED = -FLT_MAX;  // finite: exact under any Metal math mode

  threadgroup float q_tg[8 * D];
  threadgroup uint k_words[TILE * LDW];
  threadgroup uint v_words[TILE * LDW];
  threadgroup float p_tg[8 * 32];
  const threadgroup T* k_tg = (const threadgroup T*)k_words;
  const threadgroup T* v_tg = (const threadgroup T*)v_words;

  for (int i = tid; i < nh * D; i += nthreads) {
    q_tg[i] = float(q[(long(q_row) * H + h0) * D + i]) * scale_log2;
  }
  const bool active = sg < nh;
  float m = MASKED;
  float l = 0.0f;
  float acc[NACC];
  for (int k = 0; k < NACC; ++k) {
    acc[k] = 0.0f;
  }
  const device int* table = block_tables + long(req) * MB;
  // Staging: `tpk` threads per key of the tile (32 * NH threads, TILE divides 32), each with
  // one block-table lookup per tile and 16-byte loads, offsets in 16-byte units of type IDX.
  const device uint4* k_src = (const device uint4*)k_pool;
  const device uint4* v_src = (const device uint4*)v_pool;
  const int tpk = nthreads / TILE;
  const int jt = tid / tpk;
  const int sub = tid - jt * tpk;

  for (int t0 = k_begin; t0 < k_end; t0 += TILE) {
    const int n = min(TILE, k_end - t0);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (jt < n) {
      const int pos = t0 + jt;
      const IDX base = ((IDX(table[pos / BS]) * BS + IDX(pos % BS)) * KVH + kvh) * VPR;
      for (int v = sub; v < VPR; v += tpk) {
        const uint4 kv = k_src[base + v];
        const uint4 vv = v_src[base + v];
        threadgroup uint* kd = k_words + jt * LDW + 4 * v;
        threadgroup uint* vd = v_words + jt * LDW + 4 * v;
        kd[0] = kv.x;
        kd[1] = kv.y;
        kd[2] = kv.z;
        kd[3] = kv.w;
        vd[0] = vv.x;
        vd[1] = vv.y;
        vd[2] = vv.z;
        vd[3] = vv.w;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (!active) {
      continue;
    }
    float s = MASKED;
    if (lane < n) {
      s = 0.0f;
      for (int d = 0; d < D; ++d) {
        s += q_tg[sg * D + d] * float(k_tg[lane * LDK + d]);
      }
      if (cap_log2 > 0.0f) {
        s = cap_log2 * tanh(s / cap_log2);
      }
    }
    const float m_new = max(m, simd_max(s));  // finite: every tile has a key
    const float p = lane < n ? exp2(s - m_new) : 0.0f;
    const float alpha = exp2(m - m_new);
    l = l * alpha + simd_sum(p);
    m = m_new;
    p_tg[sg * 32 + lane] = p;
    simdgroup_barrier(mem_flags::mem_threadgroup);
    for (int k = 0; k < NACC; ++k) {
      acc[k] *= alpha;
    }
    for (int j = 0; j < n; ++j) {
      const float pj = p_tg[sg * 32 + j];
      for (int k = 0; k < NACC; ++k) {
        const int d = lane + 32 * k;
        if (d < D) {
          acc[k] += pj * float(v_tg[j * LDK + d]);
        }
      }
    }
  }

  if (!active) {
    return;
  }
  const int h = h0 + sg;
  const float inv = 1.0f / l;
  if (NPARTS == 1) {
    for (int k = 0; k < NACC; ++k) {
      const int d = lane + 32 * k;
      if (d < D) {
        out[(long(row) * H + h) * D + d] = T(acc[k] * inv);
      }
    }
  } else {
    const long base = (long(part) * NROWS + row) * H + h;
    for (int k = 0; k < NACC; ++k) {
      const int d = lane + 32 * k;
      if (d < D) {
        part_out[base * D + d] = acc[k] * inv;
      }
    }
    if (lane == 0) {
      part_ml[base * 2] = m;
      part_ml[base * 2 + 1] = l;
    }
  }
"""

# One simdgroup per (row, query head): merge the row's partitions by their log-sum-exp.
REDUCE_SOURCE = """
  const int H = params[0], PART = params[3], NROWS = params[5];
  const int h = int(threadgroup_position_in_grid.y);
  const int row = int(threadgroup_position_in_grid.z);
  const int lane = int(thread_index_in_simdgroup);
  constexpr int NACC = (D + 31) / 32;
  const int nparts = (rows[row * 4 + 2] - rows[row * 4 + 3] + PART - 1) / PART;
  float top = -FLT_MAX;
  for (int p = 0; p < nparts; ++p) {
    top = max(top, part_ml[((long(p) * NROWS + row) * H + h) * 2]);
  }
  float total = 0.0f;
  float acc[NACC];
  for (int k = 0; k < NACC; ++k) {
    acc[k] = 0.0f;
  }
  for (int p = 0; p < nparts; ++p) {
    const long base = (long(p) * NROWS + row) * H + h;
    const float w = part_ml[base * 2 + 1] * exp2(part_ml[base * 2] - top);
    total += w;
    for (int k = 0; k < NACC; ++k) {
      const int d = lane + 32 * k;
      if (d < D) {
        acc[k] += w * part_out[base * D + d];
      }
    }
  }
  for (int k = 0; k < NACC; ++k) {
    const int d = lane + 32 * k;
    if (d < D) {
      out[(long(row) * H + h) * D + d] = T(acc[k] / total);
    }
  }
"""


def make_decode_kernels(metal_kernel) -> tuple:
    decode = metal_kernel(
        name="paged_attention_decode",
        input_names=["q", "k_pool", "v_pool", "block_tables", "rows", "params"],
        output_names=["out", "part_out", "part_ml"],
        source=DECODE_SOURCE,
    )
    reduce = metal_kernel(
        name="paged_attention_reduce",
        input_names=["part_out", "part_ml", "rows", "params"],
        output_names=["out"],
        source=REDUCE_SOURCE,
    )
    return decode, reduce


def run_decode(kernels, q, k_pool, v_pool, block_tables, work, params) -> mx.array:
    """Attention of `work.num_rows` single query rows: `[num_rows, H, D]` in the pool dtype."""
    decode, reduce = kernels
    _, block_size, kv_heads, head_dim = k_pool.shape
    num_heads = q.shape[1]
    dtype = k_pool.dtype
    template = [("T", dtype), ("D", head_dim), ("BS", block_size),
                ("TILE", decode_tile(dtype.size, head_dim)), ("IDX", index_type(k_pool))]
    split = work.num_parts > 1
    n, parts = work.num_rows, work.num_parts
    out, part_out, part_ml = decode(
        inputs=[q, k_pool, v_pool, block_tables, work.rows, params],
        template=template,
        grid=(32 * work.heads_per_group * kv_heads * work.chunks, n, parts),
        threadgroup=(32 * work.heads_per_group, 1, 1),
        output_shapes=[(1,) if split else (n, num_heads, head_dim),
                       (parts, n, num_heads, head_dim) if split else (1,),
                       (parts, n, num_heads, 2) if split else (1,)],
        output_dtypes=[dtype, mx.float32, mx.float32],
    )
    if not split:
        return out
    (out,) = reduce(
        inputs=[part_out, part_ml, work.rows, params],
        template=[("T", dtype), ("D", head_dim)],
        grid=(32, num_heads, n),
        threadgroup=(32, 1, 1),
        output_shapes=[(n, num_heads, head_dim)],
        output_dtypes=[dtype],
    )
    return out
