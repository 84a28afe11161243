// metal:: math, as_type and numeric_limits for the MSL compatibility layer.
#pragma once

namespace metal {

template <typename To, typename From>
inline To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  return __builtin_bit_cast(To, x);
}

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
MSL_UNARY_FLOAT(fabs, __builtin_fabsf(v))
MSL_UNARY_FLOAT(floor, __builtin_floorf(v))
MSL_UNARY_FLOAT(ceil, __builtin_ceilf(v))
MSL_UNARY_FLOAT(round, __builtin_roundf(v))
MSL_UNARY_FLOAT(rint, __builtin_rintf(v))
MSL_UNARY_FLOAT(trunc, __builtin_truncf(v))
MSL_UNARY_FLOAT(fract, v - __builtin_floorf(v))
MSL_UNARY_FLOAT(tanh, __builtin_tanhf(v))
MSL_UNARY_FLOAT(sin, __builtin_sinf(v))
MSL_UNARY_FLOAT(cos, __builtin_cosf(v))
MSL_UNARY_FLOAT(tan, __builtin_tanf(v))
MSL_UNARY_FLOAT(erf, __builtin_erff(v))
MSL_UNARY_FLOAT(log1p, __builtin_log1pf(v))
MSL_UNARY_FLOAT(expm1, __builtin_expm1f(v))
MSL_UNARY_FLOAT(saturate, __builtin_fminf(__builtin_fmaxf(v, 0.0f), 1.0f))
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
inline T abs(T x) {
  if constexpr (msl::is_floating<T>)
    return msl::map1(x, [](float v) { return __builtin_fabsf(v); });
  else
    return msl::map2(x, x, [](auto a, auto) { return a < 0 ? -a : a; });
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
  return x / y;
}

namespace fast {
using metal::ceil;
using metal::cos;
using metal::exp;
using metal::exp2;
using metal::fabs;
using metal::floor;
using metal::log;
using metal::log2;
using metal::max;
using metal::min;
using metal::pow;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
using metal::divide;
}  // namespace fast
namespace precise {
using namespace metal::fast;
}

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
