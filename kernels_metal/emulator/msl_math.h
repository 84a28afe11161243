// metal:: math, as_type and numeric_limits for the MSL compatibility layer.
#pragma once

namespace metal {

template <typename To, typename From>
inline To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  return __builtin_bit_cast(To, x);
}

// Math modes (compile_options={"math_mode": ...}; MSL_MATH_MODE 0 = safe, 1 = relaxed, 2 = fast).
// precise:: is the host's libm. fast:: models Metal's fast-math functions on float at the error
// bound the MSL specification states (exp, exp2: 3 + floor(|2x|) ulp; divide: 2.5 ulp for
// |y| in [2^-126, 2^126]), subnormal results flushed to zero, NaN operands of min/max undefined
// (NaN here); fast-math functions without a modelled bound do not compile. half and bfloat have
// no fast variants. Unqualified calls use fast:: under relaxed and fast modes.
#ifndef MSL_MATH_MODE
#define MSL_MATH_MODE 0
#endif
#if MSL_MATH_MODE > 0
#define MSL_MODE_MATH fast
#else
#define MSL_MODE_MATH precise
#endif

namespace precise {
#define MSL_UNARY_FLOAT(name, expr)                                   \
  template <typename T>                                              \
  inline T name(T x) {                                               \
    static_assert(msl::is_floating<T>, #name " takes a float type"); \
    return msl::map1(x, [](float v) { return expr; });              \
  }
MSL_UNARY_FLOAT(exp, __builtin_expf(v))
MSL_UNARY_FLOAT(exp2, __builtin_exp2f(v))
MSL_UNARY_FLOAT(exp10, __builtin_powf(10.0f, v))
MSL_UNARY_FLOAT(log, __builtin_logf(v))
MSL_UNARY_FLOAT(log2, __builtin_log2f(v))
MSL_UNARY_FLOAT(log10, __builtin_log10f(v))
MSL_UNARY_FLOAT(sqrt, __builtin_sqrtf(v))
MSL_UNARY_FLOAT(rsqrt, 1.0f / __builtin_sqrtf(v))
MSL_UNARY_FLOAT(tanh, __builtin_tanhf(v))
MSL_UNARY_FLOAT(sin, __builtin_sinf(v))
MSL_UNARY_FLOAT(cos, __builtin_cosf(v))
MSL_UNARY_FLOAT(tan, __builtin_tanf(v))
MSL_UNARY_FLOAT(erf, __builtin_erff(v))
MSL_UNARY_FLOAT(log1p, __builtin_log1pf(v))
MSL_UNARY_FLOAT(expm1, __builtin_expm1f(v))
#undef MSL_UNARY_FLOAT

template <typename T>
inline T pow(T x, T y) {
  return msl::map2(x, y, [](float a, float b) { return __builtin_powf(a, b); });
}
template <typename T>
inline T powr(T x, T y) {
  return pow(x, y);
}
template <typename T>
inline T max(T x, T y) {
  if constexpr (msl::is_floating<T>)
    return msl::map2(x, y, [](float a, float b) { return __builtin_fmaxf(a, b); });
  else
    return msl::map2(x, y, [](auto a, auto b) { return a > b ? a : b; });
}
template <typename T>
inline T min(T x, T y) {
  if constexpr (msl::is_floating<T>)
    return msl::map2(x, y, [](float a, float b) { return __builtin_fminf(a, b); });
  else
    return msl::map2(x, y, [](auto a, auto b) { return a < b ? a : b; });
}
template <typename T>
inline T divide(T x, T y) {
  return x / y;
}
}  // namespace precise

}  // namespace metal

namespace msl {

template <typename T>
constexpr bool is_float32 = __is_same(typename vtraits<T>::elem, float);
template <typename T>
constexpr bool never = false;

inline uint32_t scramble(uint32_t b) {
  b ^= b >> 16;
  b *= 0x7feb352du;
  b ^= b >> 15;
  b *= 0x846ca68bu;
  return b ^ (b >> 16);
}

// `r` (the host's result, within 1 ulp) moved `ulps` units in its last place, up or down by a
// hash of the arguments: an error at the bound a fast-math function may have (callers pass the
// bound less 1). Subnormal results flush to zero.
inline float at_error_bound(float r, float ulps, float a, float b = 0.0f) {
  float mag = __builtin_fabsf(r);
  if (!__builtin_isfinite(r)) return r;
  if (mag < __FLT_MIN__) return __builtin_copysignf(0.0f, r);
  float ulp = __builtin_nextafterf(mag, __builtin_inff()) - mag;
  uint32_t h = scramble(__builtin_bit_cast(uint32_t, a) ^ scramble(__builtin_bit_cast(uint32_t, b)));
  double moved = double(r) + ((h & 1u) ? 1.0 : -1.0) * double(ulps) * double(ulp);
  float out = float(moved);
  return __builtin_fabsf(out) < __FLT_MIN__ ? __builtin_copysignf(0.0f, r) : out;
}

}  // namespace msl

namespace metal {

namespace fast {
#define MSL_FAST_EXP(name, libm)                                                        \
  template <typename T>                                                                \
  inline T name(T x) {                                                                 \
    if constexpr (msl::is_float32<T>)                                                  \
      return msl::map1(x, [](float v) {                                                \
        return msl::at_error_bound(libm(v), 2.0f + __builtin_floorf(__builtin_fabsf(2.0f * v)), v); \
      });                                                                              \
    else                                                                               \
      return precise::name(x);                                                         \
  }
MSL_FAST_EXP(exp, __builtin_expf)
MSL_FAST_EXP(exp2, __builtin_exp2f)
#undef MSL_FAST_EXP

#define MSL_FAST_UNMODELLED(name)                                                      \
  template <typename T>                                                                \
  inline T name(T x) {                                                                 \
    if constexpr (msl::is_float32<T>)                                                  \
      static_assert(msl::never<T>, "fast-math " #name                                  \
                    " is not modelled by the MSL emulator: call precise::" #name);     \
    return precise::name(x);                                                           \
  }
MSL_FAST_UNMODELLED(exp10)
MSL_FAST_UNMODELLED(log)
MSL_FAST_UNMODELLED(log2)
MSL_FAST_UNMODELLED(log10)
MSL_FAST_UNMODELLED(sqrt)
MSL_FAST_UNMODELLED(rsqrt)
MSL_FAST_UNMODELLED(tanh)
MSL_FAST_UNMODELLED(sin)
MSL_FAST_UNMODELLED(cos)
MSL_FAST_UNMODELLED(tan)
MSL_FAST_UNMODELLED(erf)
MSL_FAST_UNMODELLED(log1p)
MSL_FAST_UNMODELLED(expm1)
#undef MSL_FAST_UNMODELLED

template <typename T>
inline T pow(T x, T y) {
  if constexpr (msl::is_float32<T>)
    static_assert(msl::never<T>, "fast-math pow is not modelled by the MSL emulator: call precise::pow");
  return precise::pow(x, y);
}
template <typename T>
inline T powr(T x, T y) {
  return pow(x, y);
}
// Undefined for NaN operands in fast math: NaN here, so a kernel relying on it shows.
template <typename T>
inline T max(T x, T y) {
  if constexpr (msl::is_float32<T>)
    return msl::map2(x, y, [](float a, float b) {
      return a != a || b != b ? msl::poison<float>() : __builtin_fmaxf(a, b);
    });
  else
    return precise::max(x, y);
}
template <typename T>
inline T min(T x, T y) {
  if constexpr (msl::is_float32<T>)
    return msl::map2(x, y, [](float a, float b) {
      return a != a || b != b ? msl::poison<float>() : __builtin_fminf(a, b);
    });
  else
    return precise::min(x, y);
}
template <typename T>
inline T divide(T x, T y) {
  if constexpr (msl::is_float32<T>)
    return msl::map2(x, y, [](float a, float b) {
      float m = __builtin_fabsf(b);
      if (m < 0x1p-126f || m > 0x1p126f) return msl::poison<float>();  // undefined there
      return msl::at_error_bound(a / b, 2.0f, a, b);
    });
  else
    return precise::divide(x, y);
}
}  // namespace fast

#define MSL_MODE_UNARY(name)         \
  template <typename T>              \
  inline T name(T x) {               \
    return MSL_MODE_MATH::name(x);   \
  }
MSL_MODE_UNARY(exp)
MSL_MODE_UNARY(exp2)
MSL_MODE_UNARY(exp10)
MSL_MODE_UNARY(log)
MSL_MODE_UNARY(log2)
MSL_MODE_UNARY(log10)
MSL_MODE_UNARY(sqrt)
MSL_MODE_UNARY(rsqrt)
MSL_MODE_UNARY(tanh)
MSL_MODE_UNARY(sin)
MSL_MODE_UNARY(cos)
MSL_MODE_UNARY(tan)
MSL_MODE_UNARY(erf)
MSL_MODE_UNARY(log1p)
MSL_MODE_UNARY(expm1)
#undef MSL_MODE_UNARY

#define MSL_EXACT_UNARY(name, expr)                                   \
  template <typename T>                                              \
  inline T name(T x) {                                               \
    static_assert(msl::is_floating<T>, #name " takes a float type"); \
    return msl::map1(x, [](float v) { return expr; });              \
  }
MSL_EXACT_UNARY(fabs, __builtin_fabsf(v))
MSL_EXACT_UNARY(floor, __builtin_floorf(v))
MSL_EXACT_UNARY(ceil, __builtin_ceilf(v))
MSL_EXACT_UNARY(round, __builtin_roundf(v))
MSL_EXACT_UNARY(rint, __builtin_rintf(v))
MSL_EXACT_UNARY(trunc, __builtin_truncf(v))
MSL_EXACT_UNARY(fract, v - __builtin_floorf(v))
MSL_EXACT_UNARY(saturate, __builtin_fminf(__builtin_fmaxf(v, 0.0f), 1.0f))
#undef MSL_EXACT_UNARY

template <typename T>
inline T pow(T x, T y) {
  return MSL_MODE_MATH::pow(x, y);
}
template <typename T>
inline T powr(T x, T y) {
  return MSL_MODE_MATH::powr(x, y);
}
template <typename T>
inline T abs(T x) {
  if constexpr (msl::is_floating<T>)
    return msl::map1(x, [](float v) { return __builtin_fabsf(v); });
  else
    return msl::map2(x, x, [](auto a, auto) { return a < 0 ? -a : a; });
}
template <typename T>
inline T max(T x, T y) {
  return MSL_MODE_MATH::max(x, y);
}
template <typename T>
inline T min(T x, T y) {
  return MSL_MODE_MATH::min(x, y);
}
template <typename T>
inline T fmax(T x, T y) {
  return max(x, y);
}
template <typename T>
inline T fmin(T x, T y) {
  return min(x, y);
}
template <typename T>
inline T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <typename T>
inline T mix(T x, T y, T a) {
  return x + (y - x) * a;
}
template <typename T>
inline T fma(T a, T b, T c) {
  return a * b + c;
}
template <typename T>
inline T copysign(T x, T y) {
  return msl::map2(x, y, [](float a, float b) { return __builtin_copysignf(a, b); });
}
template <typename T>
inline T sign(T x) {
  return msl::map1(x, [](float v) { return v > 0 ? 1.0f : (v < 0 ? -1.0f : 0.0f); });
}
template <typename T>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
template <typename T>
inline bool isnan(T x) {
  return __builtin_isnan(float(x));
}
template <typename T>
inline bool isinf(T x) {
  return __builtin_isinf(float(x));
}
template <typename T>
inline bool isfinite(T x) {
  return __builtin_isfinite(float(x));
}
template <typename T>
inline typename msl::vtraits<T>::elem dot(T x, T y) {
  typename msl::vtraits<T>::elem s = 0;
  for (int i = 0; i < msl::vtraits<T>::n; ++i) s += x[i] * y[i];
  return s;
}
template <typename T>
inline T divide(T x, T y) {
  return MSL_MODE_MATH::divide(x, y);
}

// Functions exact in every mode, under both namespaces.
namespace fast {
using metal::abs;
using metal::ceil;
using metal::clamp;
using metal::fabs;
using metal::floor;
using metal::fract;
using metal::rint;
using metal::round;
using metal::saturate;
using metal::trunc;
}  // namespace fast
namespace precise {
using metal::abs;
using metal::ceil;
using metal::clamp;
using metal::fabs;
using metal::floor;
using metal::fract;
using metal::rint;
using metal::round;
using metal::saturate;
using metal::trunc;
}  // namespace precise

template <typename T>
struct numeric_limits;
template <>
struct numeric_limits<float> {
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr float max() { return __FLT_MAX__; }
  static constexpr float min() { return __FLT_MIN__; }
  static constexpr float lowest() { return -__FLT_MAX__; }
  static constexpr float epsilon() { return __FLT_EPSILON__; }
};
template <>
struct numeric_limits<half> {
  static constexpr half infinity() { return half(__builtin_inff()); }
  static constexpr half quiet_NaN() { return half(__builtin_nanf("")); }
  static constexpr half max() { return half(65504.0f); }
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half epsilon() { return half(0.0009765625f); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bfloat infinity() { return bfloat(__builtin_inff()); }
  static constexpr bfloat quiet_NaN() { return bfloat(__builtin_nanf("")); }
  static constexpr bfloat max() { return bfloat(3.38953139e38f); }
  static constexpr bfloat min() { return bfloat(1.17549435e-38f); }
  static constexpr bfloat lowest() { return bfloat(-3.38953139e38f); }
  static constexpr bfloat epsilon() { return bfloat(0.0078125f); }
};
#define MSL_INT_LIMITS(T, LO, HI)                     \
  template <>                                         \
  struct numeric_limits<T> {                          \
    static constexpr T max() { return HI; }           \
    static constexpr T min() { return LO; }           \
    static constexpr T lowest() { return LO; }        \
  };
MSL_INT_LIMITS(int, -__INT_MAX__ - 1, __INT_MAX__)
MSL_INT_LIMITS(uint, 0u, 2u * __INT_MAX__ + 1u)
MSL_INT_LIMITS(short, short(-__SHRT_MAX__ - 1), short(__SHRT_MAX__))
MSL_INT_LIMITS(ushort, ushort(0), ushort(2 * __SHRT_MAX__ + 1))
MSL_INT_LIMITS(long, -__LONG_MAX__ - 1, __LONG_MAX__)
MSL_INT_LIMITS(ulong, 0ul, 2ul * __LONG_MAX__ + 1ul)
MSL_INT_LIMITS(char, char(-128), char(127))
MSL_INT_LIMITS(uchar, uchar(0), uchar(255))
#undef MSL_INT_LIMITS

}  // namespace metal
