// Tests for the Llama kernels of llama_kernels.h (RMSNorm, SwiGLU, RoPE): forwards against
// double references, backwards against central differences of them, the 16-bit overloads
// against the fp32 kernels, in-place and strided use, and thread-count invariance.
#include "backend/cpu/llama_kernels.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

#include "backend/cpu/bf16.h"
#include "kernel_test_util.h"

namespace headroom::cpu {
namespace {

using namespace headroom::cpu::testing;  // NOLINT: test helpers

template <typename F>
void with_threads(int threads, F f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  f();
  omp_set_num_threads(saved);
}

// ---- RMSNorm -------------------------------------------------------------------------------

constexpr float kEps = 1e-5f;

// out[N, C] in double, from inp and weight.
VecD rmsnorm_ref(const VecD& x, const VecD& w, int N, int C, double eps, VecD* rstd = nullptr) {
  VecD out(x.size());
  if (rstd) rstd->assign(size_t(N), 0.0);
  for (int n = 0; n < N; ++n) {
    double ss = 0;
    for (int c = 0; c < C; ++c) ss += x[size_t(n) * C + c] * x[size_t(n) * C + c];
    const double r = 1.0 / std::sqrt(ss / C + eps);
    if (rstd) (*rstd)[size_t(n)] = r;
    for (int c = 0; c < C; ++c) out[size_t(n) * C + c] = x[size_t(n) * C + c] * r * w[size_t(c)];
  }
  return out;
}

// C = 100 (a masked last vector) and 2100 (wider than the fused form's stack: the separate pass
// over columns). Tolerance: fp32 sums of C squares (relative ~1e-7 sqrt(C)) times |out| <= ~4.
TEST(RmsNorm, ForwardMatchesDoubleReference) {
  for (const int C : {100, 2100}) {
    SCOPED_TRACE(C);
    const int N = 7;
    VecF x = rand_vec(size_t(N) * C, 1, -2, 2), w = rand_vec(size_t(C), 2, 0.5f, 1.5f);
    VecF out(x.size(), NAN), rstd(size_t(N), NAN);
    rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
    VecD rstd_ref;
    const VecD ref = rmsnorm_ref(to_d(x), to_d(w), N, C, kEps, &rstd_ref);
    expect_close(out, ref, 1e-6, 1e-6, "out");
    expect_close(rstd, rstd_ref, 0, 1e-6, "rstd");
  }
}

// The gradient of L = sum(out * dout) w.r.t. inp and weight against central differences of the
// double reference (h = 1e-6: truncation ~1e-12, cancellation ~1e-10), on top of the values that
// dinp and dweight held (both accumulate). Tolerance: the kernel's fp32 rounding.
TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  for (const int C : {37, 2100}) {
    SCOPED_TRACE(C);
    const int N = C > 1000 ? 2 : 4;
    VecF x = rand_vec(size_t(N) * C, 3, -2, 2), w = rand_vec(size_t(C), 4, 0.5f, 1.5f);
    VecF dout = rand_vec(x.size(), 5);
    VecF out(x.size()), rstd(static_cast<size_t>(N));
    rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
    VecF dx(x.size(), 0.5f), dw(size_t(C), 0.25f);
    rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
    auto loss = [&](const VecD& xd, const VecD& wd) {
      const VecD o = rmsnorm_ref(xd, wd, N, C, kEps);
      double l = 0;
      for (size_t i = 0; i < o.size(); ++i) l += o[i] * dout[i];
      return l;
    };
    VecD xd = to_d(x), wd = to_d(w), gx(x.size()), gw(w.size());
    const double h = 1e-6;
    for (size_t i = 0; i < xd.size(); ++i) {
      const double x0 = xd[i];
      xd[i] = x0 + h;
      const double lp = loss(xd, wd);
      xd[i] = x0 - h;
      const double lm = loss(xd, wd);
      xd[i] = x0;
      gx[i] = 0.5 + (lp - lm) / (2 * h);
    }
    for (size_t i = 0; i < wd.size(); ++i) {
      const double w0 = wd[i];
      wd[i] = w0 + h;
      const double lp = loss(xd, wd);
      wd[i] = w0 - h;
      const double lm = loss(xd, wd);
      wd[i] = w0;
      gw[i] = 0.25 + (lp - lm) / (2 * h);
    }
    expect_close(dx, gx, 2e-6, 1e-5, "dinp vs finite differences");
    expect_close(dw, gw, 2e-6, 1e-5, "dweight vs finite differences");
  }
}

// dinp accumulates: from a start value it ends at start + the gradient from zero (within the
// rounding of one addition); dweight accumulates the same sum each call, exactly (0 + s, then
// s + s).
TEST(RmsNorm, DinpAndDweightAccumulate) {
  const int N = 9, C = 70;
  VecF x = rand_vec(size_t(N) * C, 6, -2, 2), w = rand_vec(size_t(C), 7),
       dout = rand_vec(x.size(), 8);
  VecF out(x.size()), rstd(static_cast<size_t>(N));
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
  VecF dx0(x.size(), 0.0f), dw(size_t(C), 0.0f);
  rmsnorm_backward(dx0.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  const VecF dw1 = dw;
  VecF start = rand_vec(x.size(), 9), dx = start;
  rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  VecD want(x.size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = double(start[i]) + dx0[i];
  expect_close(dx, want, 1e-6, 1e-6, "dinp accumulated");
  for (int c = 0; c < C; ++c) EXPECT_EQ(dw[size_t(c)], 2.0f * dw1[size_t(c)]) << c;
  bool nonzero = false;
  for (float v : dx0) nonzero |= v != 0.0f;
  EXPECT_TRUE(nonzero);
}

// dweight alone (dinp null: the pass over columns) is the same bits as dweight from the fused
// pass; dinp alone is the same bits as dinp with dweight.
TEST(RmsNorm, NullGradientsAreSkippedAndFormsAgree) {
  const int N = 29, C = 300;
  VecF x = rand_vec(size_t(N) * C, 10, -2, 2), w = rand_vec(size_t(C), 11),
       dout = rand_vec(x.size(), 12);
  VecF out(x.size()), rstd(static_cast<size_t>(N));
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
  VecF dx(x.size(), 0.0f), dw(size_t(C), 0.0f), dx2 = dx, dw2 = dw;
  rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  rmsnorm_backward(nullptr, dw2.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  rmsnorm_backward(dx2.data(), nullptr, dout.data(), x.data(), w.data(), rstd.data(), N, C);
  EXPECT_EQ(dw, dw2);
  EXPECT_EQ(dx, dx2);
}

TEST(RmsNorm, ThreadCountInvariant) {
  for (const int C : {300, 2100}) {
    const int N = 50;
    VecF x = rand_vec(size_t(N) * C, 13, -2, 2), w = rand_vec(size_t(C), 14),
         dout = rand_vec(x.size(), 15);
    auto run = [&](int threads) {
      VecF out(x.size()), rstd(static_cast<size_t>(N)), dx(x.size(), 0.125f), dw(size_t(C), 0.0f);
      with_threads(threads, [&] {
        rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
        rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
      });
      return std::vector<VecF>{out, rstd, dx, dw};
    };
    const auto one = run(1), two = run(2), three = run(3);
    EXPECT_EQ(one, two) << C;
    EXPECT_EQ(one, three) << C;
  }
}

// 16-bit output and dout against the fp32 kernels: the same statistics and arithmetic, out
// rounded once; with dinp_low, dinp and dweight unchanged and dinp_low the rounding of dinp.
template <typename T>
void check_rmsnorm_low(double round) {
  const int N = 13, C = 96;
  VecF x = rand_vec(size_t(N) * C, 16, -2, 2), w = rand_vec(size_t(C), 17);
  VecF out(x.size()), rstd(static_cast<size_t>(N)), rstd2(static_cast<size_t>(N));
  std::vector<T> outl(x.size());
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
  rmsnorm_forward(outl.data(), rstd2.data(), x.data(), w.data(), N, C, kEps);
  EXPECT_EQ(rstd, rstd2);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(outl[i].bits, core_bits<T>(out[i])) << i;

  const VecF dout = exact_rand<T>(x.size(), 18);
  const std::vector<T> doutl = narrow_vec<T>(dout);
  VecF dx(x.size(), 0.5f), dw(size_t(C), 0.25f), dx2 = dx, dw2 = dw, dx3 = dx, dw3 = dw;
  rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  rmsnorm_backward(dx2.data(), dw2.data(), doutl.data(), x.data(), w.data(), rstd.data(), N, C);
  expect_close(dx2, dx, 1e-6, 1e-6, "dinp");
  expect_close(dw2, dw, 1e-6, 1e-6, "dweight");
  std::vector<T> low(x.size());
  rmsnorm_backward(dx3.data(), low.data(), dw3.data(), doutl.data(), x.data(), w.data(),
                   rstd.data(), N, C);
  EXPECT_EQ(dx3, dx2);
  EXPECT_EQ(dw3, dw2);
  for (size_t i = 0; i < dx3.size(); ++i) ASSERT_EQ(low[i].bits, core_bits<T>(dx3[i])) << i;
  (void)round;
}
TEST(RmsNorm, Bf16MatchesFp32) { check_rmsnorm_low<bf16_t>(1.0 / 256); }
TEST(RmsNorm, F16MatchesFp32) { check_rmsnorm_low<f16_t>(1.0 / 2048); }

// ---- SwiGLU --------------------------------------------------------------------------------

double silu(double x) { return x / (1.0 + std::exp(-x)); }

// Strided rows: gu's padding holds NaN (a read of it would show in the results) and the outputs'
// padding a sentinel that must survive.
constexpr float kSentinel = 777.0f;

// A value's bits (NaN payloads included), for any storage type.
uint32_t raw(float v) { return std::bit_cast<uint32_t>(v); }
uint32_t raw(bf16_t v) { return v.bits; }
uint32_t raw(f16_t v) { return v.bits; }

TEST(SwiGlu, ForwardMatchesDoubleReferenceWithStridedRows) {
  const int64_t N = 5, I = 37, ld_gu = 2 * I + 5, ld_out = I + 3;
  VecF gu = rand_vec(size_t(N * ld_gu), 20, -6, 6);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 2 * I; c < ld_gu; ++c) gu[size_t(n * ld_gu + c)] = NAN;
  }
  VecF out(size_t(N * ld_out), kSentinel);
  swiglu_forward(out.data(), gu.data(), N, I, ld_out, ld_gu);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < ld_out; ++i) {
      const float got = out[size_t(n * ld_out + i)];
      if (i >= I) {
        EXPECT_EQ(got, kSentinel) << "padding written at " << n << "," << i;
        continue;
      }
      const double want = silu(gu[size_t(n * ld_gu + i)]) * gu[size_t(n * ld_gu + I + i)];
      EXPECT_NEAR(got, want, 1e-6 + 1e-6 * std::abs(want)) << n << "," << i;
    }
  }
}

// The gradient of L = sum(out * dout) against central differences of the double reference.
TEST(SwiGlu, BackwardMatchesFiniteDifferences) {
  const int64_t N = 4, I = 21, ld_gu = 2 * I + 3, ld_dout = I + 1;
  VecF gu = rand_vec(size_t(N * ld_gu), 21, -6, 6), dout = rand_vec(size_t(N * ld_dout), 22);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 2 * I; c < ld_gu; ++c) gu[size_t(n * ld_gu + c)] = NAN;
    dout[size_t(n * ld_dout + I)] = NAN;
  }
  VecF dgu(gu.size(), kSentinel);
  swiglu_backward(dgu.data(), gu.data(), dout.data(), N, I, ld_gu, ld_dout);
  const double h = 1e-6;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < I; ++i) {
      const double g = gu[size_t(n * ld_gu + i)], u = gu[size_t(n * ld_gu + I + i)];
      const double dy = dout[size_t(n * ld_dout + i)];
      const double dg = (silu(g + h) - silu(g - h)) / (2 * h) * u * dy;
      const double du = silu(g) * dy;
      EXPECT_NEAR(dgu[size_t(n * ld_gu + i)], dg, 1e-6 + 1e-5 * std::abs(dg)) << n << "," << i;
      EXPECT_NEAR(dgu[size_t(n * ld_gu + I + i)], du, 1e-6 + 1e-5 * std::abs(du)) << n << "," << i;
    }
    for (int64_t c = 2 * I; c < ld_gu; ++c) EXPECT_EQ(dgu[size_t(n * ld_gu + c)], kSentinel);
  }
}

// In place (dgu = gu, as the model runs it) is the same bits as out of place, and leaves the
// padding alone; the 16-bit overloads against the fp32 kernel on the same inputs, rounded once.
// Inputs reach |gate| = 30 (sigmoid saturated both ways).
template <typename T>
void check_swiglu_storage(double round) {
  const int64_t N = 6, I = 2100 + 7, ld_gu = 2 * I + 16, ld_out = I + 9;  // two chunks a row
  const VecF guf = exact_rand<T>(size_t(N * ld_gu), 23, -30, 30);
  const VecF doutf = exact_rand<T>(size_t(N * ld_out), 24);
  const std::vector<T> gu = narrow_vec<T>(guf), dout = narrow_vec<T>(doutf);
  std::vector<T> out(size_t(N * ld_out), from_f32<T>(kSentinel));
  std::vector<T> dgu(gu.size(), from_f32<T>(kSentinel));
  const float sentinel = to_f32(from_f32<T>(kSentinel));  // 776 in bf16
  swiglu_forward(out.data(), gu.data(), N, I, ld_out, ld_gu);
  swiglu_backward(dgu.data(), gu.data(), dout.data(), N, I, ld_gu, ld_out);
  std::vector<T> inplace = gu;
  swiglu_backward(inplace.data(), inplace.data(), dout.data(), N, I, ld_gu, ld_out);
  VecF out32(out.size(), kSentinel), dgu32(gu.size(), kSentinel);
  swiglu_forward(out32.data(), guf.data(), N, I, ld_out, ld_gu);
  swiglu_backward(dgu32.data(), guf.data(), doutf.data(), N, I, ld_gu, ld_out);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < ld_gu; ++c) {
      const size_t k = size_t(n * ld_gu + c);
      if (c >= 2 * I) {
        EXPECT_EQ(to_f32(dgu[k]), sentinel);
        EXPECT_EQ(raw(inplace[k]), raw(gu[k])) << "in place touched the padding";
        continue;
      }
      ASSERT_EQ(raw(inplace[k]), raw(dgu[k])) << n << "," << c;
    }
    for (int64_t c = I; c < ld_out; ++c) EXPECT_EQ(to_f32(out[size_t(n * ld_out + c)]), sentinel);
  }
  if constexpr (std::is_same_v<T, float>) {
    EXPECT_EQ(out, out32);
    EXPECT_EQ(dgu, dgu32);
  } else {
    expect_close(widen_vec(out), out32, 1e-7, round, "out vs fp32");
    expect_close(widen_vec(dgu), dgu32, 1e-7, round, "dgu vs fp32");
  }
}
TEST(SwiGlu, Fp32InPlaceAndStrided) { check_swiglu_storage<float>(0); }
TEST(SwiGlu, Bf16InPlaceStridedAndAgainstFp32) { check_swiglu_storage<bf16_t>(1.0 / 256); }
TEST(SwiGlu, F16InPlaceStridedAndAgainstFp32) { check_swiglu_storage<f16_t>(1.0 / 2048); }

TEST(SwiGlu, ThreadCountInvariant) {
  const int64_t N = 3, I = 5000;
  const VecF gu = rand_vec(size_t(N * 2 * I), 25, -8, 8), dout = rand_vec(size_t(N * I), 26);
  auto run = [&](int threads) {
    VecF out(size_t(N * I)), dgu(gu.size());
    with_threads(threads, [&] {
      swiglu_forward(out.data(), gu.data(), N, I, I, 2 * I);
      swiglu_backward(dgu.data(), gu.data(), dout.data(), N, I, 2 * I, I);
    });
    return std::vector<VecF>{out, dgu};
  };
  EXPECT_EQ(run(1), run(2));
  EXPECT_EQ(run(1), run(3));
}

// ---- RoPE ----------------------------------------------------------------------------------

// transformers' _compute_llama3_parameters, in double, from the unscaled frequencies.
double llama3_ref(double f, const RopeScaling& s) {
  const double orig = s.original_max_position_embeddings;
  const double low_wl = orig / s.low_freq_factor, high_wl = orig / s.high_freq_factor;
  const double wavelen = 2 * std::numbers::pi / f;
  if (wavelen < high_wl) return f;
  if (wavelen > low_wl) return f / s.factor;
  const double smooth =
      (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  return (1 - smooth) * f / s.factor + smooth * f;
}

TEST(Rope, InvFreqMatchesTheFormula) {
  const int HS = 64;
  VecF f(HS / 2, NAN);
  rope_inv_freq(f.data(), HS, 10000.0f, RopeScaling{});
  VecD want(HS / 2);
  for (int i = 0; i < HS / 2; ++i) want[size_t(i)] = 1.0 / std::pow(10000.0, 2.0 * i / HS);
  expect_close(f, want, 0, 1e-6, "inv_freq");
  EXPECT_EQ(f[0], 1.0f);
}

// Llama 3.1's scaling (theta 500000, factor 8, low 1, high 4, original 8192) over HS = 128:
// every band (kept, divided, smoothed) occurs.
TEST(Rope, InvFreqLlama3ScalingMatchesTransformers) {
  const int HS = 128;
  RopeScaling s;
  s.kind = RopeScaling::Kind::kLlama3;
  s.factor = 8;
  s.low_freq_factor = 1;
  s.high_freq_factor = 4;
  s.original_max_position_embeddings = 8192;
  VecF f(HS / 2, NAN);
  rope_inv_freq(f.data(), HS, 500000.0f, s);
  VecD want(HS / 2);
  int kept = 0, divided = 0, smoothed = 0;
  for (int i = 0; i < HS / 2; ++i) {
    const double base = 1.0 / std::pow(500000.0, 2.0 * i / HS);
    want[size_t(i)] = llama3_ref(base, s);
    const double ratio = want[size_t(i)] / base;
    kept += ratio == 1.0;
    divided += ratio == 1.0 / 8;
    smoothed += ratio != 1.0 && ratio != 1.0 / 8;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(smoothed, 0);
  expect_close(f, want, 0, 1e-6, "llama3 inv_freq");
}

TEST(Rope, TableIsCosAndSinOfPositionTimesFrequencyWithOffset) {
  const int HS = 16, H = HS / 2, T = 9, pos0 = 1000;
  VecF f(H);
  rope_inv_freq(f.data(), HS, 10000.0f, RopeScaling{});
  VecF c(size_t(T) * H, NAN), s(c.size(), NAN);
  rope_table(c.data(), s.data(), f.data(), HS, pos0, T);
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < H; ++i) {
      const double a = double(pos0 + t) * f[size_t(i)];
      EXPECT_EQ(c[size_t(t) * H + i], float(std::cos(a)));
      EXPECT_EQ(s[size_t(t) * H + i], float(std::sin(a)));
    }
  }
  // Rows of a table from pos0 are the rows pos0.. of a table from 0.
  VecF c0(size_t(pos0 + T) * H), s0(c0.size());
  rope_table(c0.data(), s0.data(), f.data(), HS, 0, pos0 + T);
  EXPECT_EQ(c, VecF(c0.begin() + size_t(pos0) * H, c0.end()));
  EXPECT_EQ(s, VecF(s0.begin() + size_t(pos0) * H, s0.end()));
}

struct RopeShape {
  int B, T, NH, NKV, HS;
  size_t width() const { return size_t(NH + 2 * NKV) * HS; }
  size_t size() const { return size_t(B) * T * width(); }
};

// The rotation in double, from the definition (x1 cos - x2 sin, x2 cos + x1 sin on the q and k
// heads; v as it was).
VecD rope_ref(const VecD& x, const VecF& c, const VecF& s, const RopeShape& r) {
  VecD y = x;
  const int H = r.HS / 2;
  for (int b = 0; b < r.B; ++b) {
    for (int t = 0; t < r.T; ++t) {
      for (int h = 0; h < r.NH + r.NKV; ++h) {
        const size_t base = (size_t(b) * r.T + t) * r.width() + size_t(h) * r.HS;
        for (int i = 0; i < H; ++i) {
          const double x1 = x[base + i], x2 = x[base + H + i];
          const double cc = c[size_t(t) * H + i], ss = s[size_t(t) * H + i];
          y[base + i] = x1 * cc - x2 * ss;
          y[base + H + i] = x2 * cc + x1 * ss;
        }
      }
    }
  }
  return y;
}

void rope_tables(const RopeShape& r, int pos0, VecF* c, VecF* s) {
  VecF f(size_t(r.HS / 2));
  rope_inv_freq(f.data(), r.HS, 10000.0f, RopeScaling{});
  c->assign(size_t(r.T) * (r.HS / 2), 0.0f);
  s->assign(c->size(), 0.0f);
  rope_table(c->data(), s->data(), f.data(), r.HS, pos0, r.T);
}

// HS = 40 (20 pairs: a masked last vector), GQA widths, a position offset.
TEST(Rope, ForwardMatchesReferenceAndLeavesVAlone) {
  for (const RopeShape r :
       {RopeShape{2, 5, 4, 2, 40}, RopeShape{1, 3, 2, 2, 128}, RopeShape{2, 4, 3, 1, 8}}) {
    SCOPED_TRACE(::testing::Message() << r.NH << " " << r.NKV << " " << r.HS);
    VecF c, s;
    rope_tables(r, 37, &c, &s);
    const VecF x = rand_vec(r.size(), 30, -2, 2);
    VecF y = x;
    rope_forward(y.data(), c.data(), s.data(), r.B, r.T, r.NH, r.NKV, r.HS);
    expect_close(y, rope_ref(to_d(x), c, s, r), 1e-6, 1e-6, "rope");
    for (size_t row = 0; row < size_t(r.B) * r.T; ++row) {
      for (size_t j = size_t(r.NH + r.NKV) * r.HS; j < r.width(); ++j) {
        ASSERT_EQ(y[row * r.width() + j], x[row * r.width() + j]) << "v touched";
      }
    }
  }
}

// The gradient of L = sum(rope(x) * dy) (rope_backward(dy)) against central differences of the
// double reference; rope is linear, so they agree to rounding.
TEST(Rope, BackwardMatchesFiniteDifferences) {
  const RopeShape r{2, 3, 2, 1, 12};
  VecF c, s;
  rope_tables(r, 5, &c, &s);
  const VecF x = rand_vec(r.size(), 31), dy = rand_vec(r.size(), 32);
  VecF dx = dy;
  rope_backward(dx.data(), c.data(), s.data(), r.B, r.T, r.NH, r.NKV, r.HS);
  VecD xd = to_d(x), g(x.size());
  const double h = 1e-4;
  auto loss = [&] {
    const VecD y = rope_ref(xd, c, s, r);
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += y[i] * dy[i];
    return l;
  };
  for (size_t i = 0; i < xd.size(); ++i) {
    const double x0 = xd[i];
    xd[i] = x0 + h;
    const double lp = loss();
    xd[i] = x0 - h;
    const double lm = loss();
    xd[i] = x0;
    g[i] = (lp - lm) / (2 * h);
  }
  expect_close(dx, g, 1e-6, 1e-6, "drope vs finite differences");
}

// Backward after forward is the identity (a rotation's transpose is its inverse), within the
// rounding of the two passes; in 16-bit storage, within two roundings, and the 16-bit forward is
// the fp32 one rounded once.
template <typename T>
void check_rope_roundtrip(double round) {
  const RopeShape r{2, 70, 4, 2, 64};
  VecF c, s;
  rope_tables(r, 3000, &c, &s);
  const VecF x = exact_rand<T>(r.size(), 33, -2, 2);
  std::vector<T> y = narrow_vec<T>(x);
  rope_forward(y.data(), c.data(), s.data(), r.B, r.T, r.NH, r.NKV, r.HS);
  VecF y32 = x;
  rope_forward(y32.data(), c.data(), s.data(), r.B, r.T, r.NH, r.NKV, r.HS);
  if constexpr (!std::is_same_v<T, float>) {
    for (size_t i = 0; i < y32.size(); ++i) ASSERT_EQ(y[i].bits, core_bits<T>(y32[i])) << i;
  }
  rope_backward(y.data(), c.data(), s.data(), r.B, r.T, r.NH, r.NKV, r.HS);
  expect_close(widen_vec(y), x, std::is_same_v<T, float> ? 1e-6 : 4 * round, 0, "roundtrip");
}
TEST(Rope, Fp32ForwardThenBackwardIsIdentity) { check_rope_roundtrip<float>(0); }
TEST(Rope, Bf16ForwardThenBackwardIsIdentity) { check_rope_roundtrip<bf16_t>(1.0 / 256); }
TEST(Rope, F16ForwardThenBackwardIsIdentity) { check_rope_roundtrip<f16_t>(1.0 / 2048); }

TEST(Rope, ThreadCountInvariant) {
  const RopeShape r{3, 50, 4, 2, 64};
  VecF c, s;
  rope_tables(r, 0, &c, &s);
  const VecF x = rand_vec(r.size(), 34);
  auto run = [&](int threads) {
    VecF y = x;
    with_threads(threads,
                 [&] { rope_forward(y.data(), c.data(), s.data(), r.B, r.T, r.NH, r.NKV, r.HS); });
    return y;
  };
  EXPECT_EQ(run(1), run(2));
  EXPECT_EQ(run(1), run(3));
}

}  // namespace
}  // namespace headroom::cpu
