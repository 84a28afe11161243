// The part of MLX's `metal::utils()` preamble (prepended to every metal_kernel source) that
// the emulator provides: `using namespace metal`, the float16_t/bfloat16_t names, Limits and
// ceildiv. Other MLX utilities fail to compile, and the harness names them.
#pragma once

using namespace metal;

typedef half float16_t;
typedef bfloat bfloat16_t;

template <typename U>
struct Limits {
  static constexpr U max = metal::numeric_limits<U>::max();
  static constexpr U min = metal::numeric_limits<U>::min();
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = metal::numeric_limits<U>::min();
};

#define MSL_FLOAT_LIMIT(T)                                                   \
  template <>                                                                \
  struct Limits<T> {                                                         \
    static constexpr T max = metal::numeric_limits<T>::infinity();           \
    static constexpr T min = T(-float(metal::numeric_limits<T>::infinity())); \
    static constexpr T finite_max = metal::numeric_limits<T>::max();         \
    static constexpr T finite_min = metal::numeric_limits<T>::lowest();      \
  };
MSL_FLOAT_LIMIT(float)
MSL_FLOAT_LIMIT(half)
MSL_FLOAT_LIMIT(bfloat)
#undef MSL_FLOAT_LIMIT

template <>
struct Limits<bool> {
  static constexpr bool max = true;
  static constexpr bool min = false;
};

template <typename T, typename U>
inline T ceildiv(T N, U M) {
  return (N + M - 1) / M;
}
