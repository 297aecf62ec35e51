// Helpers shared by the kernel tests: random inputs, tolerance checks with the first misses
// reported, and a double-precision reference of causal attention.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace headroom::cpu::testing {

using VecD = std::vector<double>;
using VecF = std::vector<float>;

inline VecF rand_vec(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  VecF v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

inline VecD to_d(const VecF& v) { return VecD(v.begin(), v.end()); }

// Expect |actual - expected| <= atol + rtol * |expected| everywhere; report the first misses.
inline void expect_close(const VecF& actual, const VecD& expected, double atol, double rtol,
                         const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  int misses = 0;
  double worst = 0.0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double err = std::abs(actual[i] - expected[i]);
    worst = std::max(worst, err);
    if (!(err <= atol + rtol * std::abs(expected[i]))) {
      if (++misses <= 5) {
        ADD_FAILURE() << what << "[" << i << "]: got " << actual[i] << ", want " << expected[i]
                      << " (err " << err << ")";
      }
    }
  }
  EXPECT_EQ(misses, 0) << what << ": " << misses << " of " << actual.size()
                       << " outside tolerance, worst abs err " << worst;
}

inline void expect_close(const VecF& actual, const VecF& expected, double atol, double rtol,
                         const std::string& what) {
  expect_close(actual, to_d(expected), atol, rtol, what);
}

// Causal multi-head attention in double: out[B,T,C] from qkv[B,T,3C]; with `att`, also the
// probabilities [B,NH,T,T].
inline VecD attention_ref(const VecD& qkv, int B, int T, int C, int NH, VecD* att = nullptr) {
  const int HS = C / NH;
  VecD out(size_t(B) * T * C, 0.0);
  if (att) att->assign(size_t(B) * NH * T * T, 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < T; ++t) {
        auto at = [&](int tt, int part, int d) {
          return qkv[(size_t(b) * T + tt) * 3 * C + part * C + h * HS + d];
        };
        VecD p(t + 1);
        double mx = -1e300;
        for (int s = 0; s <= t; ++s) {
          double sc = 0;
          for (int d = 0; d < HS; ++d) sc += at(t, 0, d) * at(s, 1, d);
          p[s] = sc / std::sqrt(double(HS));
          mx = std::max(mx, p[s]);
        }
        double sum = 0;
        for (int s = 0; s <= t; ++s) sum += (p[s] = std::exp(p[s] - mx));
        for (int s = 0; s <= t; ++s) {
          p[s] /= sum;
          if (att) (*att)[((size_t(b) * NH + h) * T + t) * T + s] = p[s];
          for (int d = 0; d < HS; ++d)
            out[(size_t(b) * T + t) * C + h * HS + d] += p[s] * at(s, 2, d);
        }
      }
  return out;
}

}  // namespace headroom::cpu::testing
