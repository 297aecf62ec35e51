// Helpers shared by the kernel tests: random inputs, tolerance checks with the first misses
// reported, a double-precision reference of causal attention, and for the bf16 and f16 kernel
// tests the conversions and the checks that are the same for both storage types.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cpu/bf16.h"
#include "backend/cpu/fused_kernels.h"
#include "backend/cpu/kernels.h"
#include "core/dtype.h"

namespace headroom::cpu::testing {

using VecD = std::vector<double>;
using VecF = std::vector<float>;
using VecB = std::vector<bf16_t>;
using VecH = std::vector<f16_t>;

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

// ---- bf16 and f16 storage ------------------------------------------------------------------
// Each value rounded once to T (nearest even), and back to fp32 (exact).
template <typename T>
std::vector<T> narrow_vec(const VecF& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_f32<T>(v[i]);
  return out;
}
template <typename T>
VecF widen_vec(const std::vector<T>& v) {
  VecF out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = to_f32(v[i]);
  return out;
}
// Values that T holds exactly, so that the fp32 and T paths of a test see the same inputs.
template <typename T>
VecF exact_rand(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  return widen_vec(narrow_vec<T>(rand_vec(n, seed, lo, hi)));
}

inline VecB to_bf(const VecF& v) { return narrow_vec<bf16_t>(v); }
inline VecF from_bf(const VecB& v) { return widen_vec(v); }
inline VecF bf_rand(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  return exact_rand<bf16_t>(n, seed, lo, hi);
}
inline VecH to_h(const VecF& v) { return narrow_vec<f16_t>(v); }
inline VecF from_h(const VecH& v) { return widen_vec(v); }
inline VecF h_rand(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  return exact_rand<f16_t>(n, seed, lo, hi);
}

// core/dtype.h's scalar conversion of x to T's bits (not the kernels' own rounding).
template <typename T>
uint16_t core_bits(float x) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    return f32_to_bf16_bits(x);
  } else {
    static_assert(std::is_same_v<T, f16_t>);
    return f32_to_f16_bits(x);
  }
}

// LayerNorm with T output (forward) and T dout (backward) against the fp32 kernels: the same
// statistics, out rounded once (atol out_atol, relative round), the same fp32 arithmetic in the
// backward; with dinp_low, dinp and the parameter gradients unchanged and dinp_low the rounding
// of the updated dinp (the cast it replaces).
template <typename T>
void check_layernorm_low(double out_atol, double round) {
  const int N = 13, C = 96;
  VecF x = rand_vec(size_t(N) * C, 3, -2, 2), w = rand_vec(C, 4), b = rand_vec(C, 5);
  VecF out(size_t(N) * C), mean(N), rstd(N), mean2(N), rstd2(N);
  std::vector<T> outl(size_t(N) * C);
  layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  layernorm_forward(outl.data(), mean2.data(), rstd2.data(), x.data(), w.data(), b.data(), N, C);
  EXPECT_EQ(mean, mean2);
  EXPECT_EQ(rstd, rstd2);
  expect_close(widen_vec(outl), out, out_atol, round, "layernorm out");

  VecF dout = exact_rand<T>(size_t(N) * C, 6);
  VecF dx(size_t(N) * C, 0.5f), dw(C, 0.25f), db(C, -0.25f);
  VecF dx2 = dx, dw2 = dw, db2 = db;
  layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(),
                     rstd.data(), N, C);
  std::vector<T> doutl = narrow_vec<T>(dout);
  layernorm_backward(dx2.data(), dw2.data(), db2.data(), doutl.data(), x.data(), w.data(),
                     mean.data(), rstd.data(), N, C);
  // Same inputs, fp32 arithmetic in both (the compiler may vectorise the two differently).
  expect_close(dx2, dx, 1e-6, 1e-6, "layernorm dinp");
  expect_close(dw2, dw, 1e-6, 1e-6, "layernorm dweight");
  expect_close(db2, db, 1e-6, 1e-6, "layernorm dbias");

  VecF dx3(size_t(N) * C, 0.5f), dw3(C, 0.25f), db3(C, -0.25f);
  std::vector<T> low(size_t(N) * C);
  layernorm_backward(dx3.data(), low.data(), dw3.data(), db3.data(), doutl.data(), x.data(),
                     w.data(), mean.data(), rstd.data(), N, C);
  expect_close(dx3, dx2, 1e-6, 1e-6, "layernorm dinp with dinp_low");
  EXPECT_EQ(dw3, dw2);
  EXPECT_EQ(db3, db2);
  for (size_t i = 0; i < dx3.size(); ++i) ASSERT_EQ(low[i].bits, core_bits<T>(dx3[i])) << i;
}

// GELU with T storage against fp32 on the same (T-representable) inputs: fp32 arithmetic, the
// result rounded once (atol 1e-7 for results that fall below the type's normal range).
template <typename T>
void check_gelu_low(double round) {
  const int64_t n = 1000;
  VecF x = exact_rand<T>(n, 7, -4, 4), dout = exact_rand<T>(n, 8);
  VecF y(n), dx(n);
  std::vector<T> yl(n), dxl(n);
  gelu_forward(y.data(), x.data(), n);
  std::vector<T> xl = narrow_vec<T>(x), doutl = narrow_vec<T>(dout);
  gelu_forward(yl.data(), xl.data(), n);
  expect_close(widen_vec(yl), y, 1e-7, round, "gelu");
  gelu_backward(dx.data(), x.data(), dout.data(), n);
  gelu_backward(dxl.data(), xl.data(), doutl.data(), n);
  expect_close(widen_vec(dxl), dx, 1e-7, round, "gelu backward");
}

// GELU in T storage over every one of the 65536 input bit patterns (NaNs, infinities and
// subnormals included), at a length that ends in a partial vector and splits unevenly between
// threads: the forward, and the backward with each of `douts`, bit for bit against the computed
// path. With AVX-512 the kernels look GELU up in tables (Note [GELU by lookup table]) or compute
// it (gelu_by_table(): both are checked, by HEADROOM_GELU_TABLE); the reference here is the
// computed path's arithmetic (gelu16<true> / gelu_grad16<true> and store16), so a table built or
// indexed differently fails. Without AVX-512 the kernel computes, and the reference is the portable
// loop's formula.
template <typename T>
void check_gelu_every_input_once(std::initializer_list<float> douts) {
  const int64_t n = 65536 + 37;  // every pattern, then 37 more (a masked last vector)
  std::vector<T> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = T{uint16_t((i * 40503 % 65536) ^ (i >> 16))};
  auto bits = [](const std::vector<T>& v) {
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = v[i].bits;
    return b;
  };
  // The reference for 16 inputs (d: the dout values, or null for the forward).
  auto reference = [](const T* xs, const T* ds, T* out) {
#if HR_AVX512_KERNELS
    const __m512 v = load16(xs, 0xFFFF);
    store16(
        out, 0xFFFF,
        ds == nullptr ? gelu16<true>(v) : _mm512_mul_ps(gelu_grad16<true>(v), load16(ds, 0xFFFF)));
#else
    for (int j = 0; j < 16; ++j) {
      float v = to_f32(xs[j]);
      if (ds == nullptr) {
        const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        out[j] = from_f32<T>(v < -10.0f ? -0.0f : v / (1.0f + fast_exp(-2.0f * u)));
      } else {
        v = v < -10.0f ? -10.0f : (v > 10.0f ? 10.0f : v);
        const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        const float e = fast_exp(-2.0f * u), s = 1.0f / (1.0f + e);
        const float du2 = 2.0f * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * v * v);
        out[j] = from_f32<T>(s * (1.0f + v * (e * s) * du2) * to_f32(ds[j]));
      }
    }
#endif
  };
  std::vector<T> xp = x;
  xp.resize(size_t(n + 15) / 16 * 16, T{0});
  std::vector<T> want(xp.size()), got(static_cast<size_t>(n));
  for (size_t i = 0; i < xp.size(); i += 16) reference(&xp[i], nullptr, &want[i]);
  want.resize(size_t(n));
  gelu_forward(got.data(), x.data(), n);
  const auto gb = bits(got), wb = bits(want);
  int misses = 0;
  for (size_t i = 0; i < gb.size(); ++i) {
    if (gb[i] != wb[i] && ++misses <= 5) {
      ADD_FAILURE() << "gelu of bits 0x" << std::hex << x[i].bits << ": 0x" << gb[i] << ", want 0x"
                    << wb[i];
    }
  }
  EXPECT_EQ(misses, 0) << "forward";
  for (float d : douts) {
    std::vector<T> dv(xp.size(), from_f32<T>(d)), dwant(xp.size());
    for (size_t i = 0; i < xp.size(); i += 16) reference(&xp[i], &dv[i], &dwant[i]);
    dwant.resize(size_t(n));
    dv.resize(size_t(n));
    std::vector<T> dgot = dv;  // in place, as the model runs it (dinp aliases dout)
    gelu_backward(dgot.data(), x.data(), dgot.data(), n);
    const auto db = bits(dgot), dw = bits(dwant);
    misses = 0;
    for (size_t i = 0; i < db.size(); ++i) {
      if (db[i] != dw[i] && ++misses <= 5) {
        ADD_FAILURE() << "gelu backward of bits 0x" << std::hex << x[i].bits << " with dout " << d
                      << ": 0x" << db[i] << ", want 0x" << dw[i];
      }
    }
    EXPECT_EQ(misses, 0) << "backward, dout " << d;
  }
}
template <typename T>
void check_gelu_every_input(std::initializer_list<float> douts) {
  const char* before = std::getenv("HEADROOM_GELU_TABLE");
  const std::string saved = before ? before : "";
  for (const char* table : {"1", "0"}) {
    SCOPED_TRACE(std::string("HEADROOM_GELU_TABLE=") + table);
    ::setenv("HEADROOM_GELU_TABLE", table, 1);
    EXPECT_EQ(gelu_by_table(), HR_AVX512_KERNELS && *table == '1');
    check_gelu_every_input_once<T>(douts);
  }
  ::setenv("HEADROOM_GELU_TABLE", "yes", 1);
  EXPECT_THROW((void)gelu_by_table(), std::invalid_argument);
  if (before) {
    ::setenv("HEADROOM_GELU_TABLE", saved.c_str(), 1);
  } else {
    ::unsetenv("HEADROOM_GELU_TABLE");
  }
}

// GELU in T storage against exact arithmetic, over every finite input: each result within one
// unit in the last place of T of the exact value rounded to T (its bit pattern at most one away:
// faithful rounding), computed in double in the cancellation-free form x / (1 + exp(-2u)). The
// forward in 16-bit storage computes with about 7e-5 relative error (gelu16<true>), well inside
// bf16's and f16's rounding; the backward computes gelu' in fp32, whose own rounding near gelu''s
// zero (x = -0.75, where two terms of about 0.3 cancel) is allowed as 1e-6 absolute. Results
// below 1e-36 (GELU of x < -10, where sigma is subnormal in fp32 or flushed by vrcp14ps) may be 0
// or off by as much. Returns the share of forward results that are the correctly rounded ones
// (for the notes).
template <typename T>
double check_gelu_faithful() {
  auto exact = [](double x, bool grad) {
    const double k = 0.7978845608028654;
    const double u = k * (x + 0.044715 * x * x * x);
    const double s = 1.0 / (1.0 + std::exp(-2.0 * u)), es = 1.0 / (1.0 + std::exp(2.0 * u));
    if (!grad) return x * s;
    return s * (1.0 + x * es * 2.0 * k * (1.0 + 3.0 * 0.044715 * x * x));  // es = 1 - s
  };
  std::vector<T> x, y(65536), g(65536);
  for (int b = 0; b < 65536; ++b) {
    if (std::isfinite(to_f32(T{uint16_t(b)}))) x.push_back(T{uint16_t(b)});
  }
  const int64_t n = static_cast<int64_t>(x.size());
  gelu_forward(y.data(), x.data(), n);
  std::vector<T> ones(x.size(), from_f32<T>(1.0f));
  gelu_backward(g.data(), x.data(), ones.data(), n);
  // Distance in representable steps (bit patterns are ordered within a sign; 0 and -0 are one).
  auto steps = [](T a, T b) {
    auto key = [](T v) { return (v.bits & 0x8000) ? -int(v.bits & 0x7FFF) : int(v.bits); };
    return std::abs(key(a) - key(b));
  };
  int64_t correct = 0;
  int misses = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double xi = to_f32(x[size_t(i)]);
    for (bool grad : {false, true}) {
      const double want = exact(xi, grad);
      const T got = grad ? g[size_t(i)] : y[size_t(i)];
      const T rn = from_f32<T>(static_cast<float>(want));
      if (!grad && got.bits == rn.bits) ++correct;
      const double err = std::fabs(to_f32(got) - want);
      const bool ok = steps(got, rn) <= 1 || err <= 1e-36 || (grad && err <= 1e-6);
      if (!ok && ++misses <= 5) {
        ADD_FAILURE() << (grad ? "gelu' (" : "gelu (") << xi << ") = " << to_f32(got) << ", exact "
                      << want << " (rounds to " << to_f32(rn) << ")";
      }
    }
  }
  EXPECT_EQ(misses, 0);
  return double(correct) / double(n);
}

struct AttnShape {
  int B, T, C, NH;
};

// Tiled attention with T storage that runs the fp32 kernels on widened copies (f16 always, bf16
// under AttentionBf16Kernel::kWidenFp32, which the caller selects), against the fp32 kernels on
// the same inputs: the same fp32 arithmetic, so lse identical and out rounded once; the backward
// against the fp32 backward on the forward's rounded output (what the T path sees), dqkv rounded
// once (relative round).
template <typename T>
void check_attention_widened(AttnShape s, double round) {
  SCOPED_TRACE(::testing::Message()
               << "B=" << s.B << " T=" << s.T << " C=" << s.C << " NH=" << s.NH);
  const DType storage = dtype_of<T>();
  const size_t n3 = size_t(s.B) * s.T * 3 * s.C, n1 = size_t(s.B) * s.T * s.C;
  VecF qkv = exact_rand<T>(n3, 20, -2, 2);
  std::vector<T> qkvl = narrow_vec<T>(qkv);
  VecF out(n1), lse(size_t(s.B) * s.NH * s.T), lse2(lse.size());
  std::vector<T> outl(n1);
  VecF fs(attention_tiled_scratch_floats(s.B, s.T, s.C, s.NH), NAN);
  VecF fsl(attention_tiled_scratch_floats(s.B, s.T, s.C, s.NH, storage), NAN);
  attention_tiled_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.C, s.NH, fs.data());
  attention_tiled_forward(outl.data(), lse2.data(), qkvl.data(), s.B, s.T, s.C, s.NH, fsl.data());
  EXPECT_EQ(lse, lse2);
  expect_close(widen_vec(outl), out, 1e-7, round, "attention out");

  VecF dout = exact_rand<T>(n1, 21);
  std::vector<T> doutl = narrow_vec<T>(dout);
  VecF out_r = widen_vec(outl);
  VecF dqkv(n3);
  std::vector<T> dqkvl(n3);
  VecF bs(attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH), NAN);
  VecF bsl(attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH, storage), NAN);
  attention_tiled_backward(dqkv.data(), dout.data(), qkv.data(), out_r.data(), lse.data(), s.B, s.T,
                           s.C, s.NH, bs.data());
  attention_tiled_backward(dqkvl.data(), doutl.data(), qkvl.data(), outl.data(), lse.data(), s.B,
                           s.T, s.C, s.NH, bsl.data());
  expect_close(widen_vec(dqkvl), dqkv, 1e-7, round, "attention dqkv");
}

}  // namespace headroom::cpu::testing
