// Barriers, simd_* functions and 8x8 simdgroup_matrix for the MSL compatibility layer.
#pragma once

namespace metal {

// ---------------------------------------------------------------- barriers
enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}
inline void threadgroup_barrier(mem_flags) {
  msl_rt_threadgroup_barrier();
}
inline void simdgroup_barrier(mem_flags) {
  msl_rt_simdgroup_barrier();
}

// ---------------------------------------------------------------- simdgroup functions
// Every simd_* call is a meeting of the simdgroup's active lanes: each lane hands in its
// value and gets back all of them. Lanes that have returned are inactive; lanes that reach
// different simd functions (divergent control flow) are reported by the runtime.
namespace simd_tag {
enum : int {
  sum = 1, product, max_, min_, and_, or_, xor_, all, any, broadcast, broadcast_first,
  shuffle, shuffle_xor, shuffle_up, shuffle_down, rotate_up, rotate_down, prefix_excl_sum,
  prefix_incl_sum, prefix_excl_product, prefix_incl_product, is_first, ballot, matrix_mma,
};
}

template <typename T>
struct simd_values {
  T v[32];
  uint32_t mask;
};

template <typename T>
inline simd_values<T> simd_meet(int tag, T x) {
  simd_values<T> r;
  msl_rt_simd_exchange(tag, &x, sizeof(T), r.v, &r.mask);
  return r;
}

template <typename T, typename F>
inline T simd_fold(int tag, T x, F f) {
  simd_values<T> r = simd_meet(tag, x);
  bool first = true;
  T acc = x;
  for (int l = 0; l < 32; ++l) {
    if (!(r.mask >> l & 1u)) continue;
    acc = first ? r.v[l] : f(acc, r.v[l]);
    first = false;
  }
  return acc;
}

template <typename T>
inline T simd_sum(T x) {
  return simd_fold(simd_tag::sum, x, [](T a, T b) { return T(a + b); });
}
template <typename T>
inline T simd_product(T x) {
  return simd_fold(simd_tag::product, x, [](T a, T b) { return T(a * b); });
}
template <typename T>
inline T simd_max(T x) {
  return simd_fold(simd_tag::max_, x, [](T a, T b) { return max(a, b); });
}
template <typename T>
inline T simd_min(T x) {
  return simd_fold(simd_tag::min_, x, [](T a, T b) { return min(a, b); });
}
template <typename T>
inline T simd_and(T x) {
  return simd_fold(simd_tag::and_, x, [](T a, T b) { return T(a & b); });
}
template <typename T>
inline T simd_or(T x) {
  return simd_fold(simd_tag::or_, x, [](T a, T b) { return T(a | b); });
}
template <typename T>
inline T simd_xor(T x) {
  return simd_fold(simd_tag::xor_, x, [](T a, T b) { return T(a ^ b); });
}
inline bool simd_all(bool x) {
  return simd_fold(simd_tag::all, x, [](bool a, bool b) { return a && b; });
}
inline bool simd_any(bool x) {
  return simd_fold(simd_tag::any, x, [](bool a, bool b) { return a || b; });
}

template <typename T>
inline T simd_lane_value(const simd_values<T>& r, int lane) {
  if (lane < 0 || lane >= 32 || !(r.mask >> lane & 1u)) return msl::poison<T>();
  return r.v[lane];
}

template <typename T>
inline T simd_broadcast(T x, ushort lane) {
  return simd_lane_value(simd_meet(simd_tag::broadcast, x), lane);
}
template <typename T>
inline T simd_shuffle(T x, ushort lane) {
  return simd_lane_value(simd_meet(simd_tag::shuffle, x), lane);
}
template <typename T>
inline T simd_shuffle_xor(T x, ushort mask) {
  return simd_lane_value(simd_meet(simd_tag::shuffle_xor, x), int(msl_rt_lane() ^ mask));
}
template <typename T>
inline T simd_shuffle_up(T x, ushort delta) {
  simd_values<T> r = simd_meet(simd_tag::shuffle_up, x);
  int lane = int(msl_rt_lane());
  return lane < delta ? x : simd_lane_value(r, lane - delta);
}
template <typename T>
inline T simd_shuffle_down(T x, ushort delta) {
  simd_values<T> r = simd_meet(simd_tag::shuffle_down, x);
  int lane = int(msl_rt_lane());
  return lane + delta >= 32 ? x : simd_lane_value(r, lane + delta);
}
template <typename T>
inline T simd_shuffle_rotate_up(T x, ushort delta) {
  return simd_lane_value(simd_meet(simd_tag::rotate_up, x), int((msl_rt_lane() - delta) & 31u));
}
template <typename T>
inline T simd_shuffle_rotate_down(T x, ushort delta) {
  return simd_lane_value(simd_meet(simd_tag::rotate_down, x), int((msl_rt_lane() + delta) & 31u));
}
template <typename T>
inline T simd_broadcast_first(T x) {
  simd_values<T> r = simd_meet(simd_tag::broadcast_first, x);
  return simd_lane_value(r, __builtin_ctz(r.mask));
}
inline bool simd_is_first() {
  simd_values<int> r = simd_meet(simd_tag::is_first, 0);
  return int(msl_rt_lane()) == __builtin_ctz(r.mask);
}
template <typename T, bool Inclusive, bool Product>
inline T simd_prefix(int tag, T x) {
  simd_values<T> r = simd_meet(tag, x);
  T acc = Product ? T(1) : T(0);
  int lane = int(msl_rt_lane());
  for (int l = 0; l < lane + (Inclusive ? 1 : 0); ++l)
    if (r.mask >> l & 1u) acc = Product ? T(acc * r.v[l]) : T(acc + r.v[l]);
  return acc;
}
template <typename T>
inline T simd_prefix_exclusive_sum(T x) {
  return simd_prefix<T, false, false>(simd_tag::prefix_excl_sum, x);
}
template <typename T>
inline T simd_prefix_inclusive_sum(T x) {
  return simd_prefix<T, true, false>(simd_tag::prefix_incl_sum, x);
}
template <typename T>
inline T simd_prefix_exclusive_product(T x) {
  return simd_prefix<T, false, true>(simd_tag::prefix_excl_product, x);
}
template <typename T>
inline T simd_prefix_inclusive_product(T x) {
  return simd_prefix<T, true, true>(simd_tag::prefix_incl_product, x);
}

// ---------------------------------------------------------------- simdgroup_matrix (8x8)
// Each lane owns two horizontally adjacent elements; the lane -> (row, col) map below is the
// one Apple GPUs use for thread_elements(). Loads and stores are per lane; multiply is a
// meeting of the simdgroup (every lane needs rows and columns held by others).
inline void simdgroup_lane_coord(uint lane, int& row, int& col) {
  int q = int(lane) / 4;
  row = (q & 4) + (int(lane) / 2) % 4;
  col = (q & 2) * 2 + (int(lane) % 2) * 2;
}

template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator supports 8x8 simdgroup_matrix only");
  vec<T, 2> elems;
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diagonal) {
    int r, c;
    simdgroup_lane_coord(msl_rt_lane(), r, c);
    elems[0] = r == c ? diagonal : T(0);
    elems[1] = r == c + 1 ? diagonal : T(0);
  }
  thread vec<T, 2>& thread_elements() { return elems; }
  const thread vec<T, 2>& thread_elements() const { return elems; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <typename T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.elems = vec<T, 2>(value);
  return m;
}

template <typename T, typename P>
inline void simdgroup_load(
    thread simdgroup_matrix<T, 8, 8>& d, const P* src, ulong elements_per_row = 8,
    ulong2 matrix_origin = 0, bool transpose_matrix = false) {
  static_assert(__is_same(T, P), "simdgroup_load: matrix and memory element types differ");
  int r, c;
  simdgroup_lane_coord(msl_rt_lane(), r, c);
  long stride = long(elements_per_row);
  if (transpose_matrix && (matrix_origin.x != 0 || matrix_origin.y != 0))
    msl_rt_fail("simdgroup_load with transpose and a non-zero matrix_origin");
  const P* base = src + long(matrix_origin.y) * stride + long(matrix_origin.x);
  for (int k = 0; k < 2; ++k)
    d.elems[k] = transpose_matrix ? base[long(c + k) * stride + r] : base[long(r) * stride + c + k];
}

template <typename T, typename P>
inline void simdgroup_store(
    thread const simdgroup_matrix<T, 8, 8>& a, P* dst, ulong elements_per_row = 8,
    ulong2 matrix_origin = 0, bool transpose_matrix = false) {
  static_assert(__is_same(T, P), "simdgroup_store: matrix and memory element types differ");
  int r, c;
  simdgroup_lane_coord(msl_rt_lane(), r, c);
  long stride = long(elements_per_row);
  if (transpose_matrix && (matrix_origin.x != 0 || matrix_origin.y != 0))
    msl_rt_fail("simdgroup_store with transpose and a non-zero matrix_origin");
  P* base = dst + long(matrix_origin.y) * stride + long(matrix_origin.x);
  for (int k = 0; k < 2; ++k) {
    if (transpose_matrix)
      base[long(c + k) * stride + r] = a.elems[k];
    else
      base[long(r) * stride + c + k] = a.elems[k];
  }
}

struct simdgroup_mma_lane {
  float a[2], b[2], c[2];
};

template <typename TD, typename TA, typename TB, typename TC>
inline void simdgroup_multiply_accumulate(
    thread simdgroup_matrix<TD, 8, 8>& d, thread const simdgroup_matrix<TA, 8, 8>& a,
    thread const simdgroup_matrix<TB, 8, 8>& b, thread const simdgroup_matrix<TC, 8, 8>& c) {
  simdgroup_mma_lane mine;
  for (int k = 0; k < 2; ++k) {
    mine.a[k] = float(a.elems[k]);
    mine.b[k] = float(b.elems[k]);
    mine.c[k] = float(c.elems[k]);
  }
  simd_values<simdgroup_mma_lane> all = simd_meet(simd_tag::matrix_mma, mine);
  if (all.mask != 0xffffffffu) msl_rt_fail("simdgroup_multiply_accumulate with inactive lanes");
  float A[8][8], B[8][8];
  for (uint l = 0; l < 32; ++l) {
    int r, col;
    simdgroup_lane_coord(l, r, col);
    for (int k = 0; k < 2; ++k) {
      A[r][col + k] = all.v[l].a[k];
      B[r][col + k] = all.v[l].b[k];
    }
  }
  int r, col;
  simdgroup_lane_coord(msl_rt_lane(), r, col);
  for (int k = 0; k < 2; ++k) {
    float s = mine.c[k];
    for (int i = 0; i < 8; ++i) s += A[r][i] * B[i][col + k];
    d.elems[k] = TD(s);
  }
}

template <typename TD, typename TA, typename TB>
inline void simdgroup_multiply(
    thread simdgroup_matrix<TD, 8, 8>& d, thread const simdgroup_matrix<TA, 8, 8>& a,
    thread const simdgroup_matrix<TB, 8, 8>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, 8, 8>(TD(0)));
}

}  // namespace metal
