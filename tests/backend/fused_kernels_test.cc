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

#include "backend/cpu/kernels.h"
#include "kernel_test_util.h"

namespace headroom::cpu {
namespace {

using namespace headroom::cpu::testing;  // NOLINT: test helpers

// Expect |actual - expected| <= atol + rtol * |expected| everywhere; report the first misses.

// Runs f with `threads` OpenMP threads, restoring the previous setting.
template <typename F>
void with_threads(int threads, F f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  f();
  omp_set_num_threads(saved);
}

// ---- tiled attention -------------------------------------------------------------------------

struct AttnShape {
  int B, T, C, NH;
};

struct TiledResult {
  VecF out, lse, dqkv;
};

TiledResult run_tiled(const AttnShape& s, const VecF& qkv, const VecF& dout) {
  TiledResult r;
  r.out.assign(size_t{1} * s.B * s.T * s.C, NAN);
  r.lse.assign(size_t{1} * s.B * s.NH * s.T, NAN);
  r.dqkv.assign(size_t{3} * s.B * s.T * s.C, NAN);  // overwritten: NaN would survive otherwise
  VecF fs(attention_tiled_scratch_floats(s.B, s.T, s.C, s.NH), NAN);
  attention_tiled_forward(r.out.data(), r.lse.data(), qkv.data(), s.B, s.T, s.C, s.NH, fs.data());
  VecF bs(attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH), NAN);
  attention_tiled_backward(r.dqkv.data(), dout.data(), qkv.data(), r.out.data(), r.lse.data(), s.B,
                           s.T, s.C, s.NH, bs.data());
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

// The scratch is planned from the shapes alone: a few slots of tiles, far below the B*NH*T*T
// probabilities the plain kernel keeps.
TEST(AttentionTiled, ScratchDependsOnShapesOnly) {
  EXPECT_EQ(attention_tiled_scratch_floats(8, 256, 768, 12), size_t{64} * (64 * 64 + 64 * 64 + 64));
  EXPECT_EQ(attention_tiled_backward_scratch_floats(8, 256, 768, 12),
            size_t{64} * (2 * 64 * 64 + 2 * 64 * 64 + 64));
  EXPECT_EQ(attention_tiled_scratch_floats(1, 7, 24, 3), size_t{3} * (8 * 64 + 64 * 64 + 64));
  EXPECT_EQ(attention_tiled_backward_scratch_floats(1, 7, 24, 3),
            size_t{3} * (2 * 8 * 64 + 2 * 64 * 64 + 64));
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
