// Metal Shading Language compatibility layer: lets an MSL compute kernel compile as C++ (clang)
// and run on the fiber runtime in msl_runtime.cpp. Covers what kernels_metal's kernels and the
// harness self-tests use; anything else fails to compile and the harness names the construct.
#pragma once
#include <stddef.h>
#include <stdint.h>

// ---------------------------------------------------------------- runtime hooks (libmslrt)
struct msl_thread_info;
extern "C" {
void msl_rt_threadgroup_barrier(void);
void msl_rt_simdgroup_barrier(void);
void msl_rt_simd_exchange(int tag, const void* mine, unsigned bytes, void* all, uint32_t* mask);
void* msl_rt_threadgroup_alloc(int site, unsigned bytes, unsigned align);
unsigned msl_rt_lane(void);
[[noreturn]] void msl_rt_fail(const char* message);
}

// ---------------------------------------------------------------- scalar and vector types
typedef _Float16 half;
typedef __bf16 bfloat;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

template <typename T, int N>
using vec = T __attribute__((ext_vector_type(N)));

#define MSL_VECTORS(S)                                 \
  typedef S S##2 __attribute__((ext_vector_type(2))); \
  typedef S S##3 __attribute__((ext_vector_type(3))); \
  typedef S S##4 __attribute__((ext_vector_type(4)));
MSL_VECTORS(float)
MSL_VECTORS(half)
MSL_VECTORS(bfloat)
MSL_VECTORS(int)
MSL_VECTORS(uint)
MSL_VECTORS(short)
MSL_VECTORS(ushort)
MSL_VECTORS(char)
MSL_VECTORS(uchar)
MSL_VECTORS(long)
MSL_VECTORS(ulong)
MSL_VECTORS(bool)
#undef MSL_VECTORS

// Address spaces are plain memory here; threadgroup *declarations* are rewritten by the
// harness into arena references (see translate.py), every other use is a no-op qualifier.
#define device
#define constant
#define thread
#define threadgroup
#define kernel
#define METAL_FUNC inline
#define METAL_CONST_ARG(x)
#define METAL_ALIGN(x) alignas(x)

#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define MAXFLOAT __FLT_MAX__
#define HUGE_VALF (__builtin_huge_valf())
#define FLT_MAX __FLT_MAX__
#define FLT_MIN __FLT_MIN__
#define FLT_EPSILON __FLT_EPSILON__
#define HALF_MAX 65504.0f
#define HALF_MIN 6.103515625e-05f
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f

namespace msl {

template <typename V>
struct vtraits {
  static constexpr bool is_vec = false;
  static constexpr int n = 1;
  using elem = V;
};
template <typename T, int N>
struct vtraits<T __attribute__((ext_vector_type(N)))> {
  static constexpr bool is_vec = true;
  static constexpr int n = N;
  using elem = T;
};

template <typename V, typename A>
inline void put(V& v, int& i, A a) {
  using E = typename vtraits<V>::elem;
  if constexpr (vtraits<A>::is_vec) {
    for (int k = 0; k < vtraits<A>::n; ++k) v[i++] = E(a[k]);
  } else {
    v[i++] = E(a);
  }
}

// MSL vector constructors: `float4(x)` splats a scalar or converts a vector element-wise,
// `float4(a.xy, z, w)` concatenates. (Plain C++ would bit-cast or reject these.)
template <typename V, typename... A>
inline V make(A... args) {
  static_assert(vtraits<V>::is_vec, "msl::make builds vector types only");
  using E = typename vtraits<V>::elem;
  if constexpr (sizeof...(A) == 0) {
    return V(E(0));
  } else if constexpr (sizeof...(A) == 1) {
    using A0 = typename vtraits<A...>::elem;
    if constexpr (vtraits<A...>::is_vec) {
      static_assert(vtraits<A...>::n == vtraits<V>::n, "vector conversion between lengths");
      V v;
      int i = 0;
      (put(v, i, args), ...);
      return v;
    } else {
      return V(E(A0(args...)));
    }
  } else {
    static_assert((vtraits<A>::n + ...) == vtraits<V>::n, "vector constructor: wrong count");
    V v;
    int i = 0;
    (put(v, i, args), ...);
    return v;
  }
}

// Element-wise application of a float function to a scalar or vector of any float type.
template <typename T, typename F>
inline T map1(T x, F f) {
  using E = typename vtraits<T>::elem;
  if constexpr (vtraits<T>::is_vec) {
    T r;
    for (int i = 0; i < vtraits<T>::n; ++i) r[i] = E(f(float(x[i])));
    return r;
  } else {
    return E(f(float(x)));
  }
}

template <typename T, typename F>
inline T map2(T x, T y, F f) {
  using E = typename vtraits<T>::elem;
  if constexpr (vtraits<T>::is_vec) {
    T r;
    for (int i = 0; i < vtraits<T>::n; ++i) r[i] = E(f(x[i], y[i]));
    return r;
  } else {
    return E(f(x, y));
  }
}

template <typename T>
constexpr bool is_floating = __is_same(typename vtraits<T>::elem, float) ||
                             __is_same(typename vtraits<T>::elem, half) ||
                             __is_same(typename vtraits<T>::elem, bfloat);

template <typename T>
inline T poison() {
  T v;
  __builtin_memset(&v, 0xff, sizeof(T));
  return v;
}

template <typename A>
inline A& threadgroup_array(int site) {
  return *reinterpret_cast<A*>(msl_rt_threadgroup_alloc(site, sizeof(A), alignof(A)));
}

}  // namespace msl

#include "msl_math.h"
#include "msl_simd.h"

// ---------------------------------------------------------------- launch ABI
#include "msl_thread_info.h"
