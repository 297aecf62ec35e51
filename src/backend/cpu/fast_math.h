// Branch-free expf/tanhf that GCC vectorises inside `#pragma omp simd` loops. glibc's vector
// math (libmvec) is only used under -ffast-math, which the build does not set, and scalar expf
// calls would dominate softmax over a 50257-entry vocabulary and GELU.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace headroom::cpu {

// Plain inline functions: GCC inlines and vectorises them (checked with objdump, GCC 12).
// exp(x) for x in float range; relative error below 2e-7 for x in [-87, 88]. Inputs are clamped
// to that range, so exp of very negative x returns ~1e-38 instead of 0 (harmless where it is
// used: softmax sums of at least 1, and tanh).
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;  // ternaries, not std::fmin/fmax: those block vectorisation
  x = x > 88.0f ? 88.0f : x;
  // n = round(x / ln2) by the 1.5 * 2^23 trick: std::floor/nearbyint do not vectorise without
  // -fno-trapping-math, and this rounding is exact for |n| < 2^22.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  // x - n*ln2 in two parts (Cody-Waite) keeps r accurate.
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  // exp(r) on |r| <= ln2/2: Cephes expf polynomial.
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(e);
}

// tanh(x) = 1 - 2 / (exp(2x) + 1); absolute error ~1e-7 (relative error grows for |x| < 1e-3,
// where tanh(x) ~ x is tiny anyway; in GELU it is multiplied by x).
inline float fast_tanh(float x) { return 1.0f - 2.0f / (fast_exp(2.0f * x) + 1.0f); }

// max and sum_i exp(x_i - max) of one row.
inline void softmax_row_stats(const float* x, int V, float* maxv, float* sum) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int i = 0; i < V; ++i) m = std::max(m, x[i]);
  // Sixteen explicit partial sums, then their total in double: the same rounding whether or not
  // the compiler vectorises (a scalar float sum over 50257 terms drifts by ~4e-5 relative, which
  // a debug build showed), and cheap (the exponentials dominate).
  constexpr int kLanes = 16;
  float part[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= V; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) part[j] += fast_exp(x[i + j] - m);
  }
  double s = 0.0;
  for (; i < V; ++i) s += fast_exp(x[i] - m);
  for (int j = 0; j < kLanes; ++j) s += part[j];
  *maxv = m;
  *sum = static_cast<float>(s);
}

}  // namespace headroom::cpu
