// Tests for the memory-saving kernels of fused_kernels.h: tiled attention against the plain
// attention kernels (and a double reference with finite differences on a tiny shape), the fused
// LM head + cross-entropy against matmul + cross_entropy, determinism and thread-count
// invariance.
#include "backend/cpu/fused_kernels.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/bf16.h"
#include "backend/cpu/kernels.h"
#include "kernel_test_util.h"

namespace headroom::cpu {
namespace {

using namespace headroom::cpu::testing;  // NOLINT: test helpers

// Runs f with `threads` OpenMP threads, restoring the previous setting.
template <typename F>
void with_threads(int threads, F f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  f();
  omp_set_num_threads(saved);
}

// ---- tiled attention -------------------------------------------------------------------------

struct TiledResult {
  VecF out, lse, dqkv;
};

TiledResult run_tiled(const AttnShape& s, const VecF& qkv, const VecF& dout) {
  TiledResult r;
  r.out.assign(size_t{1} * s.B * s.T * s.C, NAN);
  r.lse.assign(size_t{1} * s.B * s.NH * s.T, NAN);
  r.dqkv.assign(size_t{3} * s.B * s.T * s.C, NAN);  // overwritten: NaN would survive otherwise
  // The scratch as the planner sizes it, filled with NaN (a value read before it is written would
  // show), and followed by a guard that must survive (the kernels stay inside their plan).
  constexpr size_t kGuard = 64;
  const size_t nf = attention_tiled_scratch_floats(s.B, s.T, s.C, s.NH);
  const size_t nb = attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH);
  VecF fs(nf + kGuard, NAN), bs(nb + kGuard, NAN);
  std::fill(fs.begin() + nf, fs.end(), 12345.0f);
  std::fill(bs.begin() + nb, bs.end(), 12345.0f);
  attention_tiled_forward(r.out.data(), r.lse.data(), qkv.data(), s.B, s.T, s.C, s.NH, fs.data());
  attention_tiled_backward(r.dqkv.data(), dout.data(), qkv.data(), r.out.data(), r.lse.data(), s.B,
                           s.T, s.C, s.NH, bs.data());
  for (size_t i = nf; i < fs.size(); ++i) EXPECT_EQ(fs[i], 12345.0f) << "forward scratch overrun";
  for (size_t i = nb; i < bs.size(); ++i) EXPECT_EQ(bs[i], 12345.0f) << "backward scratch overrun";
  return r;
}

// log-sum-exp of every row of scaled scores, in double, from the inputs.
VecD lse_ref(const AttnShape& s, const VecF& qkv) {
  const int HS = s.C / s.NH;
  const int64_t C3 = 3 * s.C;
  const double scale = 1.0 / std::sqrt(static_cast<double>(HS));
  VecD lse(size_t{1} * s.B * s.NH * s.T);
  for (int b = 0; b < s.B; ++b) {
    for (int h = 0; h < s.NH; ++h) {
      const float* base = qkv.data() + int64_t{b} * s.T * C3 + h * HS;
      for (int t = 0; t < s.T; ++t) {
        VecD sc(t + 1);
        double mx = -INFINITY;
        for (int u = 0; u <= t; ++u) {
          double d = 0.0;
          for (int i = 0; i < HS; ++i) d += double{base[t * C3 + i]} * base[u * C3 + s.C + i];
          sc[u] = d * scale;
          mx = std::max(mx, sc[u]);
        }
        double sum = 0.0;
        for (double v : sc) sum += std::exp(v - mx);
        lse[(int64_t{b} * s.NH + h) * s.T + t] = mx + std::log(sum);
      }
    }
  }
  return lse;
}

// Tiled against the plain kernels of kernels.h, which kernels_test checks against a double
// reference and finite differences. Inputs in [-1, 1] (scores up to sqrt(HS) in size).
// Tolerances: both are fp32 with different summation orders (blocked sums, the online softmax's
// rescaling, probabilities recomputed from lse in the backward); the measured worst differences
// are 1.6e-7 (out), 5.5e-7 (lse, |lse| up to ~8) and 4.8e-7 (dqkv) over these shapes, so 2e-6
// absolute leaves a 4x margin while a wrong mask, block boundary or scale is off by 1e-2 or more.
void check_tiled_vs_plain(const AttnShape& s) {
  SCOPED_TRACE("B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
               " C=" + std::to_string(s.C) + " NH=" + std::to_string(s.NH));
  const VecF qkv = rand_vec(size_t{3} * s.B * s.T * s.C, 11 + s.T);
  const VecF dout = rand_vec(size_t{1} * s.B * s.T * s.C, 23 + s.T);
  VecF out(size_t{1} * s.B * s.T * s.C), att(size_t{1} * s.B * s.NH * s.T * s.T);
  attention_forward(out.data(), att.data(), qkv.data(), s.B, s.T, s.C, s.NH);
  VecF dqkv(qkv.size()), scratch(attention_backward_scratch_floats(s.B, s.T, s.NH));
  attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), s.B, s.T,
                     s.C, s.NH);

  const TiledResult r = run_tiled(s, qkv, dout);
  expect_close(r.out, out, 1e-6, 1e-6, "out");
  expect_close(r.lse, lse_ref(s, qkv), 2e-6, 1e-7, "lse");
  expect_close(r.dqkv, dqkv, 2e-6, 1e-5, "dqkv");
}

TEST(AttentionTiled, SingleToken) { check_tiled_vs_plain({1, 1, 8, 1}); }
TEST(AttentionTiled, OddSmall) { check_tiled_vs_plain({2, 7, 24, 3}); }  // HS = 8: scalar tail
TEST(AttentionTiled, OneFullBlock) { check_tiled_vs_plain({1, 64, 64, 2}); }
TEST(AttentionTiled, PartialSecondBlock) { check_tiled_vs_plain({2, 65, 48, 3}); }       // HS = 16
TEST(AttentionTiled, NotAMultipleOfTheBlock) { check_tiled_vs_plain({1, 100, 80, 4}); }  // HS=20
TEST(AttentionTiled, LongGpt2Head) { check_tiled_vs_plain({1, 300, 256, 4}); }           // HS = 64
TEST(AttentionTiled, WideHead) { check_tiled_vs_plain({1, 130, 144, 1}); }               // HS = 144

// The gradient of L = sum(out * dout) against central differences of the double reference
// (h = 1e-5: truncation and cancellation errors below 1e-9, so the tolerance is the kernel's
// fp32 rounding; measured worst 1.1e-7).
TEST(AttentionTiled, BackwardMatchesFiniteDifferences) {
  const AttnShape s{2, 9, 12, 2};
  const VecF qkv = rand_vec(size_t{3} * s.B * s.T * s.C, 5);
  const VecF dout = rand_vec(size_t{1} * s.B * s.T * s.C, 6);
  const TiledResult r = run_tiled(s, qkv, dout);
  VecD x(qkv.begin(), qkv.end());
  expect_close(r.out, attention_ref(x, s.B, s.T, s.C, s.NH), 1e-6, 1e-6, "out vs double");
  VecD g(x.size());
  const double h = 1e-5;
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    double lp = 0.0, lm = 0.0;
    x[i] = x0 + h;
    VecD o = attention_ref(x, s.B, s.T, s.C, s.NH);
    for (size_t j = 0; j < o.size(); ++j) lp += o[j] * dout[j];
    x[i] = x0 - h;
    o = attention_ref(x, s.B, s.T, s.C, s.NH);
    for (size_t j = 0; j < o.size(); ++j) lm += o[j] * dout[j];
    x[i] = x0;
    g[i] = (lp - lm) / (2 * h);
  }
  expect_close(r.dqkv, g, 1e-6, 1e-5, "dqkv vs finite differences");
}

// Every output element is computed by one task in a fixed order: bit-identical across runs and
// thread counts (more than the "within rounding" that kernels.h promises).
TEST(AttentionTiled, DeterministicAndThreadCountInvariant) {
  const AttnShape s{2, 150, 128, 2};
  const VecF qkv = rand_vec(size_t{3} * s.B * s.T * s.C, 7);
  const VecF dout = rand_vec(size_t{1} * s.B * s.T * s.C, 8);
  TiledResult one, two, again;
  with_threads(1, [&] { one = run_tiled(s, qkv, dout); });
  with_threads(2, [&] { two = run_tiled(s, qkv, dout); });
  with_threads(2, [&] { again = run_tiled(s, qkv, dout); });
  EXPECT_EQ(one.out, two.out);
  EXPECT_EQ(one.lse, two.lse);
  EXPECT_EQ(one.dqkv, two.dqkv);
  EXPECT_EQ(two.out, again.out);
  EXPECT_EQ(two.dqkv, again.dqkv);
}

// The scratch is planned from the shapes alone: one slot per head (at most 64) holding the
// head's packed keys and values (T rounded up to 64 rows) and a few tiles, far below the
// B*NH*T*T probabilities the plain kernel keeps.
TEST(AttentionTiled, ScratchDependsOnShapesOnly) {
  // forward: k^T blocks and v rows (2 Tp HS), s [64, 64], l [64].
  EXPECT_EQ(attention_tiled_scratch_floats(8, 256, 768, 12),
            size_t{64} * (2 * 256 * 64 + 64 * 64 + 64));
  // backward: k^T and v^T blocks and k rows (3 Tp HS), the query block's q and dout rows
  // (2 x 64 HS), P and dS [64, 64], D [64].
  EXPECT_EQ(attention_tiled_backward_scratch_floats(8, 256, 768, 12),
            size_t{64} * (3 * 256 * 64 + 2 * 64 * 64 + 2 * 64 * 64 + 64));
  EXPECT_EQ(attention_tiled_scratch_floats(1, 7, 24, 3), size_t{3} * (2 * 64 * 8 + 64 * 64 + 64));
  EXPECT_EQ(attention_tiled_backward_scratch_floats(1, 7, 24, 3),
            size_t{3} * (3 * 64 * 8 + 2 * 64 * 8 + 2 * 64 * 64 + 64));
}

// ---- tiled attention with bf16 storage: the bf16 tile products ------------------------------
// The AMX and AVX512-BF16 kernels against the fp32 kernel on the same (bf16-representable)
// inputs, and against the bf16 fallback (fp32 on widened copies). A test of a kernel this CPU
// lacks is skipped (the switch falls back, which FallbackIsSelectable checks). Heads narrower
// than 32 take the fallback on every CPU (checked too).

// Sets the bf16 attention kernel for a scope, and back to kAuto after.
struct Bf16KernelScope {
  explicit Bf16KernelScope(AttentionBf16Kernel k) { set_attention_bf16_kernel(k); }
  ~Bf16KernelScope() { set_attention_bf16_kernel(AttentionBf16Kernel::kAuto); }
  Bf16KernelScope(const Bf16KernelScope&) = delete;
  Bf16KernelScope& operator=(const Bf16KernelScope&) = delete;
};

struct Bf16Result {
  VecB out, dqkv;
  VecF lse;
};

// Forward and backward with bf16 storage under the kernel now selected. The scratch is sized by
// the functions the planner uses, filled with NaN, and followed by a guard that must survive.
Bf16Result run_tiled_bf16(const AttnShape& s, const VecB& qkv, const VecB& dout) {
  Bf16Result r;
  r.out.assign(size_t{1} * s.B * s.T * s.C, bf16_t{0x7fc0});
  r.lse.assign(size_t{1} * s.B * s.NH * s.T, NAN);
  r.dqkv.assign(size_t{3} * s.B * s.T * s.C, bf16_t{0x7fc0});
  constexpr size_t kGuard = 64;
  const size_t nf = attention_tiled_scratch_floats(s.B, s.T, s.C, s.NH, DType::kBF16);
  const size_t nb = attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH, DType::kBF16);
  VecF fs(nf + kGuard, NAN), bs(nb + kGuard, NAN);
  std::fill(fs.begin() + nf, fs.end(), 12345.0f);
  std::fill(bs.begin() + nb, bs.end(), 12345.0f);
  attention_tiled_forward(r.out.data(), r.lse.data(), qkv.data(), s.B, s.T, s.C, s.NH, fs.data());
  attention_tiled_backward(r.dqkv.data(), dout.data(), qkv.data(), r.out.data(), r.lse.data(), s.B,
                           s.T, s.C, s.NH, bs.data());
  for (size_t i = nf; i < fs.size(); ++i) EXPECT_EQ(fs[i], 12345.0f) << "forward scratch overrun";
  for (size_t i = nb; i < bs.size(); ++i) EXPECT_EQ(bs[i], 12345.0f) << "backward scratch overrun";
  return r;
}

// Tolerances, inputs in [-2, 2] (so |v| <= 2 and |out| <= 2). The forward rounds P to bf16
// before P v (relative 2^-9 per weight; the weights sum to 1, so |d out| <= 2^-9 max|v|) and out
// once when stored (2^-9 relative): atol 2^-7 covers both with a margin (measured worst 5.4e-3).
// lse comes from fp32 scores of exact bf16 products and the fp32 probabilities: as accurate as
// the fp32 kernel's. The backward rounds P (for dV) and dS (for dK, dQ) to bf16 and dqkv once
// when stored; dqkv's entries reach ~3 here and sum 64-300 terms of either sign: atol 2^-5
// (measured worst 1.1e-2; the fallback, with one rounding only, 8.5e-3).
constexpr double kBf16OutAtol = 1.0 / 128;
constexpr double kBf16DqkvAtol = 1.0 / 32;

void check_bf16_kernel(AttentionBf16Kernel kernel, const AttnShape& s) {
  SCOPED_TRACE(::testing::Message() << "B=" << s.B << " T=" << s.T << " C=" << s.C << " NH=" << s.NH
                                    << " kernel=" << static_cast<int>(kernel));
  const VecF qkv = from_bf(to_bf(rand_vec(size_t{3} * s.B * s.T * s.C, 11, -2.0f, 2.0f)));
  const VecF dout = from_bf(to_bf(rand_vec(size_t{1} * s.B * s.T * s.C, 12, -1.0f, 1.0f)));
  const VecB qkvb = to_bf(qkv), doutb = to_bf(dout);

  Bf16Result fast, widened;
  {
    Bf16KernelScope scope(kernel);
    ASSERT_EQ(attention_bf16_kernel(), kernel);
    fast = run_tiled_bf16(s, qkvb, doutb);
  }
  {
    Bf16KernelScope scope(AttentionBf16Kernel::kWidenFp32);
    ASSERT_EQ(attention_bf16_kernel(), AttentionBf16Kernel::kWidenFp32);
    widened = run_tiled_bf16(s, qkvb, doutb);
  }
  // The fp32 kernel on the same inputs; its backward on the bf16 output, as the bf16 path sees.
  const TiledResult ref = run_tiled(s, qkv, dout);
  expect_close(from_bf(fast.out), ref.out, kBf16OutAtol, 0.0, "bf16 out vs fp32");
  expect_close(fast.lse, ref.lse, 2e-6, 1e-6, "bf16 lse vs fp32");
  VecF dqkv_ref(qkv.size());
  {
    const VecF out_r = from_bf(fast.out);
    VecF bs(attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH));
    attention_tiled_backward(dqkv_ref.data(), dout.data(), qkv.data(), out_r.data(),
                             fast.lse.data(), s.B, s.T, s.C, s.NH, bs.data());
  }
  expect_close(from_bf(fast.dqkv), dqkv_ref, kBf16DqkvAtol, 0.0, "bf16 dqkv vs fp32");
  // Against the fallback: within the sum of both paths' tolerances.
  expect_close(from_bf(fast.out), from_bf(widened.out), 2 * kBf16OutAtol, 0.0, "vs fallback out");
  expect_close(from_bf(fast.dqkv), from_bf(widened.dqkv), 2 * kBf16DqkvAtol, 0.0,
               "vs fallback dqkv");
  if (s.C / s.NH < 32) {  // narrow heads take the fallback
    EXPECT_EQ(from_bf(fast.out), from_bf(widened.out));
    EXPECT_EQ(from_bf(fast.dqkv), from_bf(widened.dqkv));
  } else if (s.T >= 64) {  // the bf16 products round P: not the fallback's result (at T = 1,
                           // P = 1 is exact and the two agree)
    EXPECT_NE(from_bf(fast.out), from_bf(widened.out));
  }
}

class AttentionTiledBf16 : public ::testing::TestWithParam<AttentionBf16Kernel> {
 protected:
  void SetUp() override {
    Bf16KernelScope scope(GetParam());
    if (attention_bf16_kernel() != GetParam()) GTEST_SKIP() << "this CPU lacks the kernel";
  }
};

TEST_P(AttentionTiledBf16, MatchesFp32) {
  for (const AttnShape s : {AttnShape{1, 1, 8, 1},       // one token, HS = 8
                            AttnShape{1, 1, 64, 1},      // one token, HS = 64
                            AttnShape{2, 7, 24, 3},      // HS = 8, one partial block
                            AttnShape{2, 65, 48, 3},     // HS = 16, partial second block
                            AttnShape{1, 100, 80, 4},    // HS = 20: the fallback (HS < 32)
                            AttnShape{1, 100, 96, 2},    // HS = 48: padded to 64
                            AttnShape{2, 17, 128, 2},    // HS = 64, last query vector 1 lane
                            AttnShape{1, 64, 64, 1},     // HS = 64, one whole block
                            AttnShape{1, 130, 128, 2},   // HS = 64 (GPT-2), T = 2 * 64 + 2
                            AttnShape{1, 300, 256, 4},   // HS = 64, five blocks
                            AttnShape{1, 130, 144, 1},   // HS = 144: padded to 160
                            AttnShape{1, 70, 66, 2}}) {  // HS = 33: odd
    check_bf16_kernel(GetParam(), s);
  }
}

// Every output element is computed by one task in a fixed order on the bf16 kernels too.
TEST_P(AttentionTiledBf16, ThreadCountInvariant) {
  const AttnShape s{2, 150, 128, 2};
  const VecB qkv = to_bf(rand_vec(size_t{3} * s.B * s.T * s.C, 13));
  const VecB dout = to_bf(rand_vec(size_t{1} * s.B * s.T * s.C, 14));
  Bf16KernelScope scope(GetParam());
  Bf16Result one, two, three;
  with_threads(1, [&] { one = run_tiled_bf16(s, qkv, dout); });
  with_threads(2, [&] { two = run_tiled_bf16(s, qkv, dout); });
  with_threads(3, [&] { three = run_tiled_bf16(s, qkv, dout); });
  EXPECT_EQ(from_bf(one.out), from_bf(two.out));
  EXPECT_EQ(one.lse, two.lse);
  EXPECT_EQ(from_bf(one.dqkv), from_bf(two.dqkv));
  EXPECT_EQ(from_bf(one.out), from_bf(three.out));
  EXPECT_EQ(from_bf(one.dqkv), from_bf(three.dqkv));
}

INSTANTIATE_TEST_SUITE_P(Kernels, AttentionTiledBf16,
                         ::testing::Values(AttentionBf16Kernel::kAmx,
                                           AttentionBf16Kernel::kAvx512Bf16),
                         [](const ::testing::TestParamInfo<AttentionBf16Kernel>& info) {
                           return info.param == AttentionBf16Kernel::kAmx ? "Amx" : "Avx512Bf16";
                         });

// The switch selects the fallback on any CPU, and the scratch sizes follow the kernel: the fp32
// slot plus fp32 copies of the head's rows for the fallback, the bf16 layouts otherwise.
TEST(AttentionTiledBf16Kernel, FallbackIsSelectableAndScratchFollowsTheKernel) {
  {
    Bf16KernelScope scope(AttentionBf16Kernel::kWidenFp32);
    EXPECT_EQ(attention_bf16_kernel(), AttentionBf16Kernel::kWidenFp32);
    // The fp32 slot plus the head's rows: q | k | v and out (4 T HS) forward; q | k | v,
    // dout | out and dq | dk | dv (8 T HS) backward.
    EXPECT_EQ(attention_tiled_scratch_floats(8, 256, 768, 12, DType::kBF16),
              size_t{64} * (2 * 256 * 64 + 64 * 64 + 64 + 256 * 4 * 64));
    EXPECT_EQ(attention_tiled_backward_scratch_floats(8, 256, 768, 12, DType::kBF16),
              size_t{64} * (3 * 256 * 64 + 2 * 64 * 64 + 2 * 64 * 64 + 64 + 256 * 8 * 64));
  }
  EXPECT_NE(attention_bf16_kernel(), AttentionBf16Kernel::kAuto);
  if (attention_bf16_kernel() == AttentionBf16Kernel::kWidenFp32) GTEST_SKIP() << "no bf16 kernel";
  // HS = 64, one slot per head (at most 64): forward 1.5 Tp x HSp for the head's q rows, k^T and
  // v pairs (read straight from qkv, no staging), s, p (bf16), o and l; backward 6.5 Tp x HSp for
  // the head's operands and accumulators, Tp for D, and the tile's s and dP (P and dS in place)
  // and dS rows (bf16).
  EXPECT_EQ(attention_tiled_scratch_floats(8, 256, 768, 12, DType::kBF16),
            size_t{64} * (3 * 256 * 64 / 2 + 64 * 64 + 64 * 64 / 2 + 64 * 64 + 64));
  EXPECT_EQ(attention_tiled_backward_scratch_floats(8, 256, 768, 12, DType::kBF16),
            size_t{64} * (13 * 256 * 64 / 2 + 256 + 2 * 64 * 64 + 64 * 64 / 2));
  // HS = 48 is padded to 64, T = 100 to 128; B * NH = 2 slots.
  EXPECT_EQ(attention_tiled_backward_scratch_floats(1, 100, 96, 2, DType::kBF16),
            size_t{2} * (13 * 128 * 64 / 2 + 128 + 2 * 64 * 64 + 64 * 64 / 2));
  // Heads narrower than 32 take the fallback, scratch included.
  EXPECT_EQ(attention_tiled_backward_scratch_floats(1, 100, 80, 4, DType::kBF16),
            size_t{4} * (3 * 128 * 20 + 2 * 64 * 20 + 2 * 64 * 64 + 64 + 100 * 8 * 20));
}

// ---- fused LM head + cross-entropy ----------------------------------------------------------

struct HeadShape {
  int N, C, V;
};

struct HeadData {
  VecF x, wte, dwte0;
  std::vector<int32_t> targets;
};

HeadData head_data(const HeadShape& s, uint32_t seed) {
  HeadData d;
  d.x = rand_vec(size_t{1} * s.N * s.C, seed);
  d.wte = rand_vec(size_t{1} * s.V * s.C, seed + 1);
  d.dwte0 = rand_vec(d.wte.size(), seed + 2, -0.1f, 0.1f);  // dwte accumulates onto this
  std::mt19937 rng(seed + 3);
  std::uniform_int_distribution<int32_t> tok(0, s.V - 1);
  d.targets.resize(s.N);
  for (int n = 0; n < s.N; ++n) d.targets[n] = n % 5 == 3 ? -1 : tok(rng);  // some ignored
  return d;
}

struct HeadResult {
  VecF losses, lse, dx, dwte;
};

HeadResult run_unfused(const HeadShape& s, const HeadData& d, float dloss) {
  HeadResult r;
  VecF logits(size_t{1} * s.N * s.V);
  matmul_forward(logits.data(), d.x.data(), d.wte.data(), nullptr, s.N, s.C, s.V,
                 WeightLayout::kOutIn);
  r.losses.resize(s.N);
  cross_entropy_forward(r.losses.data(), logits.data(), d.targets.data(), s.N, s.V);
  cross_entropy_backward(logits.data(), logits.data(), d.targets.data(), s.N, s.V, dloss);
  r.dx.resize(d.x.size());
  r.dwte = d.dwte0;
  matmul_backward(r.dx.data(), r.dwte.data(), nullptr, logits.data(), d.x.data(), d.wte.data(), s.N,
                  s.C, s.V, WeightLayout::kOutIn);
  return r;
}

HeadResult run_fused(const HeadShape& s, const HeadData& d, int chunk, float dloss) {
  HeadResult r;
  r.losses.assign(s.N, NAN);
  r.lse.assign(s.N, NAN);
  r.dx.assign(d.x.size(), NAN);  // overwritten
  r.dwte = d.dwte0;
  VecF scratch(lm_head_ce_scratch_floats(chunk, s.V), NAN);
  lm_head_ce_forward(r.losses.data(), r.lse.data(), d.x.data(), d.wte.data(), d.targets.data(), s.N,
                     s.C, s.V, chunk, scratch.data());
  lm_head_ce_backward(r.dx.data(), r.dwte.data(), d.x.data(), d.wte.data(), d.targets.data(),
                      r.lse.data(), s.N, s.C, s.V, chunk, dloss, scratch.data());
  return r;
}

// Tolerances: the same fp32 GEMMs on fewer rows (oneDNN may block differently on another CPU)
// and, in the backward, softmax from the saved lse instead of max and sum. Measured here: losses
// identical, gradients within 3e-8 (their size is ~dloss = 1/N); 1e-6 / 1e-7 absolute allow for
// other GEMM blockings while a wrong row, target or chunk boundary is off by 1e-2 or more.
void check_head(const HeadShape& s, int chunk) {
  SCOPED_TRACE("N=" + std::to_string(s.N) + " C=" + std::to_string(s.C) +
               " V=" + std::to_string(s.V) + " chunk=" + std::to_string(chunk));
  const HeadData d = head_data(s, 100 + chunk);
  const float dloss = 1.0f / s.N;
  const HeadResult ref = run_unfused(s, d, dloss);
  const HeadResult f = run_fused(s, d, chunk, dloss);
  expect_close(f.losses, ref.losses, 1e-6, 1e-6, "losses");
  expect_close(f.dx, ref.dx, 1e-7, 1e-5, "dx");
  expect_close(f.dwte, ref.dwte, 1e-7, 1e-5, "dwte");
  for (int n = 0; n < s.N; ++n) {
    if (d.targets[n] < 0) {
      EXPECT_EQ(f.losses[n], 0.0f) << "ignored row " << n;
    }
  }

  HeadResult fb;  // the one-pass variant
  fb.losses.assign(s.N, NAN);
  fb.dx.assign(d.x.size(), NAN);
  fb.dwte = d.dwte0;
  VecF scratch(lm_head_ce_scratch_floats(chunk, s.V), NAN);
  lm_head_ce_forward_backward(fb.losses.data(), fb.dx.data(), fb.dwte.data(), d.x.data(),
                              d.wte.data(), d.targets.data(), s.N, s.C, s.V, chunk, dloss,
                              scratch.data());
  expect_close(fb.losses, ref.losses, 1e-6, 1e-6, "forward_backward losses");
  expect_close(fb.dx, ref.dx, 1e-7, 1e-5, "forward_backward dx");
  expect_close(fb.dwte, ref.dwte, 1e-7, 1e-5, "forward_backward dwte");
}

TEST(LmHeadCe, ChunkDividesN) { check_head({12, 16, 37}, 4); }
TEST(LmHeadCe, ChunkDoesNotDivideN) { check_head({13, 16, 37}, 5); }
TEST(LmHeadCe, ChunkOfOneRow) { check_head({7, 8, 11}, 1); }
TEST(LmHeadCe, ChunkLargerThanN) { check_head({9, 16, 37}, 32); }
TEST(LmHeadCe, LargerVocabulary) { check_head({37, 64, 1000}, 16); }

TEST(LmHeadCe, LseIsTheLogSumExpOfTheLogits) {
  const HeadShape s{6, 8, 29};
  const HeadData d = head_data(s, 3);
  VecF losses(s.N), lse(s.N), scratch(lm_head_ce_scratch_floats(4, s.V));
  lm_head_ce_forward(losses.data(), lse.data(), d.x.data(), d.wte.data(), d.targets.data(), s.N,
                     s.C, s.V, 4, scratch.data());
  VecD want(s.N);
  for (int n = 0; n < s.N; ++n) {
    double sum = 0.0;
    for (int v = 0; v < s.V; ++v) {
      double z = 0.0;
      for (int c = 0; c < s.C; ++c) z += double{d.x[n * s.C + c]} * d.wte[v * s.C + c];
      sum += std::exp(z);
    }
    want[n] = std::log(sum);
  }
  expect_close(lse, want, 2e-6, 1e-7, "lse");
}

TEST(LmHeadCe, NullDxAndDwteAreSkipped) {
  const HeadShape s{10, 16, 37};
  const HeadData d = head_data(s, 9);
  const HeadResult ref = run_unfused(s, d, 0.1f);
  const HeadResult f = run_fused(s, d, 3, 0.1f);
  VecF dwte = d.dwte0, scratch(lm_head_ce_scratch_floats(3, s.V));
  lm_head_ce_backward(nullptr, dwte.data(), d.x.data(), d.wte.data(), d.targets.data(),
                      f.lse.data(), s.N, s.C, s.V, 3, 0.1f, scratch.data());
  expect_close(dwte, ref.dwte, 1e-7, 1e-5, "dwte with dx null");
  VecF dx(d.x.size(), NAN);
  lm_head_ce_backward(dx.data(), nullptr, d.x.data(), d.wte.data(), d.targets.data(), f.lse.data(),
                      s.N, s.C, s.V, 3, 0.1f, scratch.data());
  expect_close(dx, ref.dx, 1e-7, 1e-5, "dx with dwte null");
}

TEST(LmHeadCe, DeterministicAndThreadCountInvariant) {
  const HeadShape s{33, 64, 700};
  const HeadData d = head_data(s, 21);
  HeadResult one, two, again;
  with_threads(1, [&] { one = run_fused(s, d, 8, 1.0f / s.N); });
  with_threads(2, [&] { two = run_fused(s, d, 8, 1.0f / s.N); });
  with_threads(2, [&] { again = run_fused(s, d, 8, 1.0f / s.N); });
  EXPECT_EQ(two.losses, again.losses);
  EXPECT_EQ(two.dx, again.dx);
  EXPECT_EQ(two.dwte, again.dwte);
  // oneDNN may block differently for another thread count: equal within rounding.
  expect_close(one.losses, two.losses, 1e-6, 1e-6, "losses 1 vs 2 threads");
  expect_close(one.dx, two.dx, 1e-7, 1e-5, "dx 1 vs 2 threads");
  expect_close(one.dwte, two.dwte, 1e-7, 1e-5, "dwte 1 vs 2 threads");
}

}  // namespace
}  // namespace headroom::cpu
