"""Per-query-token paged attention with split-K partitions, and the log-sum-exp reduce.

Launch geometry (threads; the threadgroup is `32 * NH` threads, one simdgroup per query head):

    grid = (32 * NH * kv_heads * chunks, num_rows, num_parts)
    threadgroup (x, y, z) = (KV head and head chunk, decode row, key partition)

A row walks the keys it sees: from the start of its sliding window (or of the context) to
its own position. A threadgroup stages a tile of its KV head's keys and values in threadgroup
memory once and every simdgroup (one query head of the GQA group) reads it from there: K/V is
read from device memory once per group, not once per head. A quantized pool's tile is staged
dequantized to T, the queries' dtype (`QUANTIZED_STAGING_HEADER`, template KV_BITS 8 or 4;
0 for a float pool, copied as is), so everything after staging is the same code.

A simdgroup's 32 lanes form 32 / KL groups of KL lanes; each group scores one key at a time,
its lanes splitting the head dim (KW consecutive elements per chunk, chunks strided by KL) and
adding their partial dot products with `simd_shuffle_xor`, so every lane works at every head
dim and tile size. Each lane keeps its slice of the query and of the output in registers;
each lane group runs its own online softmax (fp32, exp2 domain: queries are pre-scaled by
scale * log2(e); scores soft-capped when the call asks for it) over every (32 / KL)-th key of
a tile, and the groups merge by log-sum-exp at the end.

Multi-head latent attention (MLA) runs here too, as one KV head of latent rows: template VK
says the values are the first DV elements of each key row (no V tile is staged), and DV
elements of each head's output are written (DV = D otherwise).

With one partition the kernel writes the final output; with several it writes each
partition's normalised output and (max, sum), and `reduce` merges them. A head's attention
sink (GPT-OSS: one more logit in the softmax, with no value) joins once per row, where the
final output is normalised: here with one partition, in `reduce` with several.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from kernels_metal.kv_quant import SCALE_DTYPE, QuantizedPool

THREADGROUP_MEMORY = 32768  # Apple GPUs' maxThreadgroupMemoryLength (Apple4 and later)
# What a kernel here may declare: a 4 KB reserve under the limit, which Metal counts against
# static and dynamic allocations together and which Xcode's shader validation was seen to
# raise a kernel's need against; a kernel at exactly 32 KB has no margin for either.
THREADGROUP_MEMORY_BUDGET = 28 * 1024
MAX_HEADS_PER_THREADGROUP = 8

# Fast math (faster exp2, divide and min/max, no IEEE special cases) in the decode and prefill
# kernels, safe because no NaN or infinity ever arises in them: the mask sentinel is -FLT_MAX,
# finite, so every exp2 argument is finite and <= 0 (a masked score minus a finite max stays
# -FLT_MAX) and two sentinels subtract to 0; they never read a K/V row they did not stage;
# decode divides by l >= 1, prefill only by l > 0; sink logits arrive finite (no sink:
# -FLT_MAX, `plan.sink_input`) and their fold keeps exp2 arguments <= 0, sums no smaller; fast
# exp2's error (3 + |2x| ulp) and the flush of results below 2^-126 stay far inside the
# cases' tolerances. The soft-cap's tanh stays precise::. The reduce kernel, one pass per
# row and head, keeps the safe mode.
FAST_MATH = {"math_mode": "fast"}


def decode_lanes(head_dim: int) -> tuple[int, int]:
    """(lanes per key KL, elements per chunk KW): KL a power of two up to 32 that splits the
    head dim into chunks of KW, aiming at 8 elements per lane and allowing at most 32."""
    for kw in (4, 2, 1):
        if head_dim % kw:
            continue
        chunks, cap = head_dim // kw, min(32, max(1, head_dim // 8))
        kl = max(d for d in (1, 2, 4, 8, 16, 32) if d <= cap and chunks % d == 0)
        if head_dim // kl <= 32:
            return kl, kw
    raise ValueError(f"head_dim {head_dim} is not supported by the decode kernel")


def decode_layout(dtype_size: int, head_dim: int,
                  values_in_keys: bool = False) -> tuple[int, int, int, int]:
    """(KL, KW, LDK, TILE): the lane split, the staged row stride in elements (16 bytes of
    padding when one lane group's reads span less than 128 bytes, so the groups reading
    different rows hit different banks) and the keys per tile: the largest of 32/16/8 whose
    K and V buffers (K alone `values_in_keys`) fit in the threadgroup memory budget."""
    kl, kw = decode_lanes(head_dim)
    ldk = head_dim + (16 // dtype_size if kl * kw * dtype_size < 128 else 0)
    for tile in (32, 16, 8):
        staged = tile * ldk * dtype_size
        # Without values of their own the V buffer is one 16-byte placeholder.
        if (staged + 16 if values_in_keys else 2 * staged) <= THREADGROUP_MEMORY_BUDGET:
            return kl, kw, ldk, tile
    raise ValueError(f"head_dim {head_dim} is too large for the decode kernel")


def index_type(pool: mx.array | QuantizedPool) -> mx.Dtype:
    """Type of the kernels' K/V offsets: 32-bit unless one could pass 2^32. They count 16 bytes
    in a float pool; loads of codes (8 bytes or more) and scales in a quantized one."""
    if isinstance(pool, QuantizedPool):
        units = max(pool.codes.nbytes // 8, pool.scales.size)
    else:
        units = pool.nbytes // 16
    return mx.uint32 if units < 2**32 else mx.int64


def pool_inputs(k_pool: mx.array | QuantizedPool,
                v_pool: mx.array | QuantizedPool) -> list[mx.array]:
    """Both kernels' `k_pool, v_pool, k_scales, v_scales`: a quantized pool's codes and scales;
    a float pool and a placeholder for the scales it does not have (never read)."""
    if isinstance(k_pool, QuantizedPool):
        return [k_pool.codes, v_pool.codes, k_pool.scales, v_pool.scales]
    return [k_pool, v_pool, _no_scales(), _no_scales()]


def pool_template(pool: mx.array | QuantizedPool) -> list[tuple[str, int]]:
    """KV_BITS (0: a float pool, staged as is) and KV_GROUP, the features per scale (a float
    pool's head dim: one unused group a row)."""
    head_dim = pool.shape[3]
    if isinstance(pool, QuantizedPool):
        return [("KV_BITS", pool.bits), ("KV_GROUP", head_dim // pool.scales.shape[3])]
    return [("KV_BITS", 0), ("KV_GROUP", head_dim)]


@cache
def _no_scales() -> mx.array:
    # 8 elements: MLX passes smaller inputs in `constant` space, which a device pointer cannot take.
    return mx.zeros((8,), SCALE_DTYPE)


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

# A row's sink folded into its final (max m, sum l): the sink's weight joins l, and `keep`
# rescales what the keys hold (1 exactly unless the sink is the larger, so that a sink of
# -FLT_MAX, which stands for none, changes no bit). Needs `h`, `m`, `l`; sets `keep`.
SINK_FOLD_SOURCE = """\
    const float sink = sinks[h];
    keep = sink > m ? exp2(m - sink) : 1.0f;
    l = l * keep + (sink > m ? 1.0f : exp2(sink - m));"""

# Both kernels' staging of a quantized pool's key row (kv_quant.py): each code's level times its
# group's scale in fp32 (exact), rounded once to T as `kv_quant.dequantize(..., T)` rounds, so
# the score and P V loops read T as from a float pool. The `tpk` threads of a key split the row
# by loads of 16 bytes of codes (8 where a row is not a multiple of 16 bytes: int8 at head dims
# of 8 x odd, int4 at 16 x odd); kv_quant's scale groups are then never narrower than a load,
# so a load takes one scale.
QUANTIZED_STAGING_HEADER = """
// The level of code k of a 32-bit word of codes, in scale units: int8 codes are its bytes;
// int4 codes its nibbles, low nibble first, nibble n standing for n - 7.5.
template <int KV_BITS>
inline float level_at(uint word, int k) {
  return KV_BITS == 4 ? float((word >> (4 * k)) & 0xFu) - 7.5f
                      : float(as_type<char4>(word)[k]);
}

template <typename T, int D, int KV_BITS, int KV_GROUP, typename IDX>
inline void stage_quantized_row(const device uchar* codes, const device half* scales, IDX row,
                                int sub, int tpk, threadgroup uint4* staged) {
  constexpr int CPW = KV_BITS == 4 ? 8 : 4;  // codes per 32-bit word
  constexpr int WPR = D / CPW;  // words of codes per row
  constexpr int WPL = WPR % 4 == 0 ? 4 : 2;  // words per load
  constexpr int LPR = WPR / WPL;  // loads per row
  typedef vec<uint, WPL> Load;
  const device Load* src = (const device Load*)codes + row * LPR;
  const device half* row_scales = scales + row * (D / KV_GROUP);
  threadgroup T* dst = (threadgroup T*)staged;
  for (int u = sub; u < LPR; u += tpk) {
    const Load words = src[u];
    const float scale = float(row_scales[u * WPL * CPW / KV_GROUP]);
    #pragma clang loop unroll(full)
    for (int w = 0; w < WPL; ++w) {
      #pragma clang loop unroll(full)
      for (int k = 0; k < CPW; ++k) {
        dst[(u * WPL + w) * CPW + k] = T(level_at<KV_BITS>(words[w], k) * scale);
      }
    }
  }
}
"""

# params: [H, KVH, max_blocks, part_size, num_parts, num_rows, chunks, NH, scale*log2e bits,
#          (prefill: BQ), (prefill: window), softcap*log2e bits]
# rows: [packed query row, request, context length, first key it sees] per decode row
# sinks: [max(H, 8)] float32, each head's sink logit * log2e; -FLT_MAX: no sink
# k_pool, v_pool: the float pools, or the quantized pools' codes, with k_scales, v_scales
# (float pools: a placeholder, never read; `pool_inputs`)
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
  constexpr int G = 32 / KL;  // keys a simdgroup scores at once: one per lane group
  constexpr int E = D / KL;  // elements of the query and the output each lane holds
  constexpr int NCH = E / KW;  // as chunks of KW consecutive elements, KL * KW apart
  constexpr int KPG = (TILE + G - 1) / G;  // keys of a tile per lane group
  constexpr int VPR = D * sizeof(T) / 16;  // 16-byte loads per key row (D is a multiple of 8)
  constexpr int VLD = LDK * sizeof(T) / 16;  // the tile's row stride in 16-byte units
  constexpr float MASKED = -FLT_MAX;  // finite: exact under any Metal math mode
  const int grp = lane / KL;
  const int kl = lane - grp * KL;

  threadgroup uint4 k_raw[TILE * VLD];
  threadgroup uint4 v_raw[(1 - VK) * TILE * VLD + VK];  // VK: values read from the keys
  const threadgroup T* k_tg = (const threadgroup T*)k_raw;
  const threadgroup T* v_tg = VK ? k_tg : (const threadgroup T*)v_raw;

  const bool active = sg < nh;
  float qr[E];
  float acc[E];
  #pragma clang loop unroll(full)
  for (int c = 0; c < NCH; ++c) {
    #pragma clang loop unroll(full)
    for (int w = 0; w < KW; ++w) {
      const int d = (kl + KL * c) * KW + w;
      qr[c * KW + w] = active ? float(q[(long(q_row) * H + h0 + sg) * D + d]) * scale_log2 : 0.0f;
      acc[c * KW + w] = 0.0f;
    }
  }
  float m = MASKED;  // this lane group's running max and sum
  float l = 0.0f;
  const device int* table = block_tables + long(req) * MB;
  // Staging: `tpk` threads per key of the tile (32 * NH threads, TILE divides 32), each with
  // one block-table lookup per tile and 16-byte loads, offsets in 16-byte units of type IDX
  // (quantized pools: in loads of codes and in scales, `stage_quantized_row`).
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
      const IDX row = (IDX(table[pos / BS]) * BS + IDX(pos % BS)) * KVH + kvh;
      if (KV_BITS != 0) {
        stage_quantized_row<T, D, KV_BITS, KV_GROUP>((const device uchar*)k_pool, k_scales, row,
                                                     sub, tpk, k_raw + jt * VLD);
        if (!VK) {
          stage_quantized_row<T, D, KV_BITS, KV_GROUP>((const device uchar*)v_pool, v_scales,
                                                       row, sub, tpk, v_raw + jt * VLD);
        }
      } else {
        for (int v = sub; v < VPR; v += tpk) {
          k_raw[jt * VLD + v] = k_src[row * VPR + v];
          if (!VK) {
            v_raw[jt * VLD + v] = v_src[row * VPR + v];
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (!active) {
      continue;
    }
    float sc[KPG];  // scores of keys grp, grp + G, ... of the tile
    float tile_max = MASKED;
    #pragma clang loop unroll(full)
    for (int i = 0; i < KPG; ++i) {
      const int j = grp + G * i;
      float s = 0.0f;
      if (j < n) {  // uniform within the lane group; no simd function inside
        #pragma clang loop unroll(full)
        for (int c = 0; c < NCH; ++c) {
          #pragma clang loop unroll(full)
          for (int w = 0; w < KW; ++w) {
            s += qr[c * KW + w] * float(k_tg[j * LDK + (kl + KL * c) * KW + w]);
          }
        }
      }
      for (int o = KL / 2; o > 0; o /= 2) {
        s += simd_shuffle_xor(s, ushort(o));  // the same sum on every lane of the group
      }
      if (cap_log2 > 0.0f) {
        s = cap_log2 * precise::tanh(s / cap_log2);
      }
      sc[i] = j < n ? s : MASKED;
      tile_max = max(tile_max, sc[i]);
    }
    const float m_new = max(m, tile_max);
    const float alpha = exp2(m - m_new);  // 1 while the group has seen no key
    float psum = 0.0f;
    #pragma clang loop unroll(full)
    for (int k = 0; k < E; ++k) {
      acc[k] *= alpha;
    }
    #pragma clang loop unroll(full)
    for (int i = 0; i < KPG; ++i) {
      const int j = grp + G * i;
      if (j < n) {
        const float p = exp2(sc[i] - m_new);
        psum += p;
        #pragma clang loop unroll(full)
        for (int c = 0; c < NCH; ++c) {
          #pragma clang loop unroll(full)
          for (int w = 0; w < KW; ++w) {
            const int d = (kl + KL * c) * KW + w;
            if (DV == D || d < DV) {  // the elements past DV are keys only (MLA's rope key)
              acc[c * KW + w] += p * float(v_tg[j * LDK + d]);
            }
          }
        }
      }
    }
    l = l * alpha + psum;
    m = m_new;
  }

  if (!active) {
    return;
  }
  // Merge the lane groups' states: a butterfly over the groups, each lane with its peers.
  for (int o = KL; o < 32; o *= 2) {
    const float m_o = simd_shuffle_xor(m, ushort(o));
    const float l_o = simd_shuffle_xor(l, ushort(o));
    const float m_new = max(m, m_o);
    const float a = exp2(m - m_new);
    const float b = exp2(m_o - m_new);
    l = l * a + l_o * b;
    #pragma clang loop unroll(full)
    for (int k = 0; k < E; ++k) {
      acc[k] = acc[k] * a + simd_shuffle_xor(acc[k], ushort(o)) * b;
    }
    m = m_new;
  }
  const int h = h0 + sg;
  float keep = 1.0f;
  if (NPARTS == 1) {  // split rows get their sink in the reduce, once
""" + SINK_FOLD_SOURCE + """
  }
  const float inv = keep / l;
  const long base = NPARTS == 1 ? long(row) * H + h : (long(part) * NROWS + row) * H + h;
  for (int c = grp; c < NCH; c += G) {  // the groups now agree: each writes some chunks
    #pragma clang loop unroll(full)
    for (int w = 0; w < KW; ++w) {
      const int k = c * KW + w;
      const int d = (kl + KL * c) * KW + w;
      if (DV < D && d >= DV) {
        continue;
      }
      if (NPARTS == 1) {
        out[base * DV + d] = T(acc[k] * inv);
      } else {
        part_out[base * DV + d] = acc[k] * inv;
      }
    }
  }
  if (NPARTS > 1 && lane == 0) {
    part_ml[base * 2] = m;
    part_ml[base * 2 + 1] = l;
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
  const float sink = sinks[h];  // the row's sink joins here, once (decode.py)
  float top = sink;
  for (int p = 0; p < nparts; ++p) {
    top = max(top, part_ml[((long(p) * NROWS + row) * H + h) * 2]);
  }
  float total = exp2(sink - top);  // 0 for no sink (-FLT_MAX)
  float acc[NACC];
  #pragma clang loop unroll(full)
  for (int k = 0; k < NACC; ++k) {
    acc[k] = 0.0f;
  }
  for (int p = 0; p < nparts; ++p) {
    const long base = (long(p) * NROWS + row) * H + h;
    const float w = part_ml[base * 2 + 1] * exp2(part_ml[base * 2] - top);
    total += w;
    #pragma clang loop unroll(full)
    for (int k = 0; k < NACC; ++k) {
      const int d = lane + 32 * k;
      if (d < D) {
        acc[k] += w * part_out[base * D + d];
      }
    }
  }
  #pragma clang loop unroll(full)
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
        input_names=["q", "k_pool", "v_pool", "k_scales", "v_scales", "block_tables", "rows",
                     "params", "sinks"],
        output_names=["out", "part_out", "part_ml"],
        source=DECODE_SOURCE,
        header=QUANTIZED_STAGING_HEADER,
        compile_options=FAST_MATH,
    )
    reduce = metal_kernel(
        name="paged_attention_reduce",
        input_names=["part_out", "part_ml", "rows", "params", "sinks"],
        output_names=["out"],
        source=REDUCE_SOURCE,
    )
    return decode, reduce


class DecodeLaunch:
    """The decode kernel (and its reduce) of one step for one kind of layer: templates, grid
    and output shapes made once, so each layer's launch only binds its arrays."""

    def __init__(self, kernels, dtype: mx.Dtype, num_heads: int,
                 k_pool: mx.array | QuantizedPool, work, value_dim: int | None = None) -> None:
        """`value_dim`: MLA's, the values being the first `value_dim` elements of each key
        row (the V pool is not read); None: a V pool of the keys' head dim."""
        self.decode, self.reduce = kernels
        _, block_size, kv_heads, head_dim = k_pool.shape
        dv = value_dim or head_dim
        kl, kw, ldk, tile = decode_layout(dtype.size, head_dim, value_dim is not None)
        n, parts = work.num_rows, work.num_parts
        split = parts > 1
        self.split = split
        self.spec = dict(
            template=[("T", dtype), ("D", head_dim), ("DV", dv), ("VK", value_dim is not None),
                      ("BS", block_size), ("TILE", tile), ("KL", kl), ("KW", kw), ("LDK", ldk),
                      ("IDX", index_type(k_pool)), *pool_template(k_pool)],
            grid=(32 * work.heads_per_group * kv_heads * work.chunks, n, parts),
            threadgroup=(32 * work.heads_per_group, 1, 1),
            output_shapes=[(1,) if split else (n, num_heads, dv),
                           (parts, n, num_heads, dv) if split else (1,),
                           (parts, n, num_heads, 2) if split else (1,)],
            output_dtypes=[dtype, mx.float32, mx.float32],
        )
        self.reduce_spec = dict(
            template=[("T", dtype), ("D", dv)],
            grid=(32, num_heads, n),
            threadgroup=(32, 1, 1),
            output_shapes=[(n, num_heads, dv)],
            output_dtypes=[dtype],
        )

    def __call__(self, q: mx.array, pools: list[mx.array], block_tables: mx.array,
                 rows: mx.array, params: mx.array, sinks: mx.array) -> mx.array:
        """`pools`: `pool_inputs` of the layer's pools."""
        out, part_out, part_ml = self.decode(
            inputs=[q, *pools, block_tables, rows, params, sinks], **self.spec)
        if not self.split:
            return out
        (out,) = self.reduce(inputs=[part_out, part_ml, rows, params, sinks],
                             **self.reduce_spec)
        return out


def run_decode(kernels, q, k_pool, v_pool, block_tables, work, params,
               sinks: mx.array) -> mx.array:
    """Attention of `work.num_rows` single query rows: `[num_rows, H, D]` in the queries' dtype
    (a float pool's: `PagedAttentionKernels` casts them). `sinks` is the kernels' form of the
    layer's sinks (`plan.sink_input`)."""
    launch = DecodeLaunch(kernels, q.dtype, q.shape[1], k_pool, work)
    return launch(q, pool_inputs(k_pool, v_pool), block_tables, work.rows, params, sinks)
