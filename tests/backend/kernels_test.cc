// Tests for the CPU fp32 kernels: every forward against a plain double-precision reference
// written here, every backward against central finite differences of L = sum(out * R) taken on
// that double reference, plus the accumulate/overwrite/aliasing rules of kernels.h and
// agreement between 1 and 2 OpenMP threads.
#include "backend/cpu/kernels.h"
#include "kernel_test_util.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/fast_math.h"
#include "backend/cpu/gemm.h"

namespace headroom::cpu {
namespace {

using namespace headroom::cpu::testing;  // NOLINT: test helpers

double dot_d(const VecD& a, const VecD& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences of L(x) = sum(f(x) * R) with respect to every element of x, in double.
// The references are smooth and evaluated in double, so with h = 1e-5 the truncation error
// (~h^2) and the cancellation error (~1e-16 / h) are both below 1e-9: the tolerances in the
// tests below are set by the float kernels, not by the differences.
VecD fd_grad(const std::function<VecD(const VecD&)>& f, VecD x, const VecD& R, double h = 1e-5) {
  VecD g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double lp = dot_d(f(x), R);
    x[i] = x0 - h;
    const double lm = dot_d(f(x), R);
    x[i] = x0;
    g[i] = (lp - lm) / (2 * h);
  }
  return g;
}

// Directional derivative of L along D: (L(x + hD) - L(x - hD)) / 2h, for large inputs where a
// full gradient by differences would be slow. Compared with sum(grad * D).
double fd_directional(const std::function<VecD(const VecD&)>& f, const VecD& x, const VecD& D,
                      const VecD& R, double h = 1e-5) {
  VecD xp(x), xm(x);
  for (size_t i = 0; i < x.size(); ++i) {
    xp[i] += h * D[i];
    xm[i] -= h * D[i];
  }
  return (dot_d(f(xp), R) - dot_d(f(xm), R)) / (2 * h);
}

// ---- double references (plain loops, straight from the definitions) ------------------------

VecD embedding_ref(const std::vector<int32_t>& tok, const VecD& wte, const VecD& wpe, int B, int T,
                   int C) {
  VecD out(size_t(B) * T * C);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c)
        out[(b * T + t) * C + c] = wte[tok[b * T + t] * C + c] + wpe[t * C + c];
  return out;
}

VecD layernorm_ref(const VecD& x, const VecD& w, const VecD* bias, int N, int C,
                   VecD* mean = nullptr, VecD* rstd = nullptr) {
  VecD out(x.size());
  if (mean) mean->assign(N, 0.0);
  if (rstd) rstd->assign(N, 0.0);
  for (int n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int c = 0; c < C; ++c) m += x[n * C + c];
    m /= C;
    for (int c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m);
    v /= C;
    const double r = 1.0 / std::sqrt(v + 1e-5);
    for (int c = 0; c < C; ++c)
      out[n * C + c] = (x[n * C + c] - m) * r * w[c] + (bias ? (*bias)[c] : 0.0);
    if (mean) (*mean)[n] = m;
    if (rstd) (*rstd)[n] = r;
  }
  return out;
}

// weight is [IC, OC] (kInOut) or [OC, IC] (kOutIn).
VecD matmul_ref(const VecD& x, const VecD& w, const VecD* bias, int N, int IC, int OC,
                WeightLayout layout) {
  VecD out(size_t(N) * OC);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) {
      double s = bias ? (*bias)[o] : 0.0;
      for (int i = 0; i < IC; ++i)
        s += x[n * IC + i] * (layout == WeightLayout::kInOut ? w[i * OC + o] : w[o * IC + i]);
      out[n * OC + o] = s;
    }
  return out;
}

double gelu_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

VecD cross_entropy_ref(const VecD& logits, const std::vector<int32_t>& tg, int N, int V) {
  VecD loss(N, 0.0);
  for (int n = 0; n < N; ++n) {
    if (tg[n] < 0) continue;
    double mx = -1e300, s = 0;
    for (int i = 0; i < V; ++i) mx = std::max(mx, logits[size_t(n) * V + i]);
    for (int i = 0; i < V; ++i) s += std::exp(logits[size_t(n) * V + i] - mx);
    loss[n] = std::log(s) + mx - logits[size_t(n) * V + tg[n]];
  }
  return loss;
}

// ---- embedding -----------------------------------------------------------------------------

TEST(Embedding, ForwardBackwardAndAccumulation) {
  const int B = 2, T = 5, C = 19, V = 7;
  std::vector<int32_t> tok = {0, 3, 3, 6, 1, 3, 0, 2, 6, 6};  // repeats on purpose
  VecF wte = rand_vec(V * C, 1), wpe = rand_vec(T * C, 2);
  VecF out(B * T * C);
  embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
  // One float addition per element: exact up to one rounding.
  expect_close(out, embedding_ref(tok, to_d(wte), to_d(wpe), B, T, C), 1e-6, 1e-6, "out");

  VecD R = to_d(rand_vec(B * T * C, 3));
  VecF dout(R.begin(), R.end());
  VecF dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C);
  auto g_wte = fd_grad([&](const VecD& w) { return embedding_ref(tok, w, to_d(wpe), B, T, C); },
                       to_d(wte), R);
  auto g_wpe = fd_grad([&](const VecD& p) { return embedding_ref(tok, to_d(wte), p, B, T, C); },
                       to_d(wpe), R);
  // Sums of at most 4 floats of size <= 1: float rounding ~1e-7, differences ~1e-10.
  expect_close(dwte, g_wte, 1e-6, 1e-5, "dwte");
  expect_close(dwpe, g_wpe, 1e-6, 1e-5, "dwpe");

  // Parameter gradients accumulate: a second call doubles them.
  embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C);
  for (auto& g : g_wte) g *= 2;
  for (auto& g : g_wpe) g *= 2;
  expect_close(dwte, g_wte, 2e-6, 1e-5, "dwte twice");
  expect_close(dwpe, g_wpe, 2e-6, 1e-5, "dwpe twice");
}

// ---- layernorm -----------------------------------------------------------------------------

TEST(LayerNorm, ForwardMatchesReference) {
  const int N = 6, C = 37;  // C not a multiple of any vector width
  VecF x = rand_vec(N * C, 10, -2, 3), w = rand_vec(C, 11), b = rand_vec(C, 12);
  for (int c = 0; c < C; ++c) x[2 * C + c] += 100.0f;  // a row with a large mean
  for (bool with_bias : {true, false}) {
    VecF out(N * C), mean(N), rstd(N);
    layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(),
                      with_bias ? b.data() : nullptr, N, C);
    VecD bd = to_d(b), md, rd;
    VecD ref = layernorm_ref(to_d(x), to_d(w), with_bias ? &bd : nullptr, N, C, &md, &rd);
    // Float means and variances over 37 values: relative error ~1e-6; the shifted row loses
    // ~log2(100) more bits in x - mean.
    expect_close(out, ref, 2e-5, 1e-5, "out");
    expect_close(mean, md, 1e-5, 1e-6, "mean");
    expect_close(rstd, rd, 1e-6, 1e-5, "rstd");
  }
}

TEST(LayerNorm, BackwardMatchesFiniteDifferencesAndAccumulates) {
  const int N = 5, C = 37;
  VecF x = rand_vec(N * C, 20, -2, 2), w = rand_vec(C, 21, 0.5, 1.5), b = rand_vec(C, 22);
  VecF out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  VecD R = to_d(rand_vec(N * C, 23));
  VecF dout(R.begin(), R.end());

  VecF dinp0 = rand_vec(N * C, 24);  // dinp accumulates onto what is there
  VecF dinp = dinp0, dw(C, 0.0f), db(C, 0.0f);
  layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                     mean.data(), rstd.data(), N, C);

  VecD xd = to_d(x), wd = to_d(w), bd = to_d(b);
  VecD g_x = fd_grad([&](const VecD& v) { return layernorm_ref(v, wd, &bd, N, C); }, xd, R);
  VecD g_w = fd_grad([&](const VecD& v) { return layernorm_ref(xd, v, &bd, N, C); }, wd, R);
  VecD g_b = fd_grad([&](const VecD& v) { return layernorm_ref(xd, wd, &v, N, C); }, bd, R);
  VecF dx(N * C);
  for (int i = 0; i < N * C; ++i) dx[i] = dinp[i] - dinp0[i];
  // Float sums over C = 37 (dinp) or N = 5 (params) terms of size ~1: errors ~1e-6.
  expect_close(dx, g_x, 1e-5, 1e-4, "dinp");
  expect_close(dw, g_w, 1e-5, 1e-4, "dweight");
  expect_close(db, g_b, 1e-5, 1e-4, "dbias");

  // Second call: dweight/dbias double exactly (one += per call), dinp adds the gradient again.
  VecF dw1 = dw, db1 = db;
  layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                     mean.data(), rstd.data(), N, C);
  for (int c = 0; c < C; ++c) {
    EXPECT_EQ(dw[c], 2 * dw1[c]);
    EXPECT_EQ(db[c], 2 * db1[c]);
  }
  for (int i = 0; i < N * C; ++i) dx[i] = dinp[i] - dinp0[i];
  for (auto& g : g_x) g *= 2;
  expect_close(dx, g_x, 2e-5, 1e-4, "dinp twice");

  // Without bias: dbias null, and dinp null skips the input gradient.
  VecF dw2(C, 0.0f);
  layernorm_backward(nullptr, dw2.data(), nullptr, dout.data(), x.data(), w.data(), mean.data(),
                     rstd.data(), N, C);
  expect_close(dw2, g_w, 1e-5, 1e-4, "dweight (no dinp, no dbias)");
}

// The input and parameter gradients of layernorm_ref in double, from their closed form (the
// finite-difference test above checks the kernel against differences at a small size; at these
// sizes differences would be slow). dx is overwritten, dw and db are sums over rows.
void layernorm_backward_ref(const VecD& x, const VecD& w, const VecD& dy, int N, int C, VecD* dx,
                            VecD* dw, VecD* db) {
  VecD mean, rstd;
  layernorm_ref(x, w, nullptr, N, C, &mean, &rstd);
  dx->assign(x.size(), 0.0);
  dw->assign(C, 0.0);
  db->assign(C, 0.0);
  for (int n = 0; n < N; ++n) {
    const size_t o = size_t(n) * C;
    double sum_dn = 0, sum_dn_n = 0;
    for (int c = 0; c < C; ++c) {
      const double norm = (x[o + c] - mean[n]) * rstd[n];
      sum_dn += dy[o + c] * w[c];
      sum_dn_n += dy[o + c] * w[c] * norm;
      (*dw)[c] += dy[o + c] * norm;
      (*db)[c] += dy[o + c];
    }
    for (int c = 0; c < C; ++c) {
      const double norm = (x[o + c] - mean[n]) * rstd[n];
      (*dx)[o + c] = (dy[o + c] * w[c] - sum_dn / C - norm * sum_dn_n / C) * rstd[n];
    }
  }
}

// Row lengths around the AVX-512 kernels' vector loops: shorter than one vector, not a multiple
// of 16 (a masked last vector after whole ones), exactly 64 (four accumulators, no tail), and
// wider than the one-pass backward takes (1100 > 1024: input gradient and parameter gradients in
// separate passes). 150 rows: 12 blocks of 12 or 13 rows for the parameter gradients.
TEST(LayerNorm, RowLengthsAroundTheVectorWidth) {
  const int N = 150;
  for (int C : {1, 7, 16, 37, 64, 100, 777, 1100}) {
    SCOPED_TRACE("C = " + std::to_string(C));
    VecF x = rand_vec(size_t(N) * C, 30, -2, 3), w = rand_vec(C, 31, 0.5, 1.5), b = rand_vec(C, 32);
    for (int c = 0; c < C; ++c) x[size_t(3) * C + c] += 100.0f;  // a row with a large mean
    VecF out(size_t(N) * C), mean(N), rstd(N);
    layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    VecD bd = to_d(b), md, rd;
    const VecD ref = layernorm_ref(to_d(x), to_d(w), &bd, N, C, &md, &rd);
    // As ForwardMatchesReference: float sums over C values (four accumulators of 16 lanes).
    expect_close(out, ref, 2e-5, 1e-5, "out");
    expect_close(mean, md, 1e-5, 1e-6, "mean");
    expect_close(rstd, rd, 1e-6, 1e-5, "rstd");

    VecF dy = rand_vec(size_t(N) * C, 33), dx0 = rand_vec(size_t(N) * C, 34);
    VecF dx = dx0, dw(C, 0.0f), db(C, 0.0f);
    layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(),
                       rstd.data(), N, C);
    VecD gx, gw, gb;
    layernorm_backward_ref(to_d(x), to_d(w), to_d(dy), N, C, &gx, &gw, &gb);
    for (size_t i = 0; i < dx.size(); ++i) dx[i] -= dx0[i];
    // dx: float sums over C terms of size ~1 (~C/32 per lane): ~1e-5 for C = 1100. dw, db: float
    // sums over 150 rows of terms below ~2 in magnitude (13 per block, then 12 blocks): ~1e-5.
    expect_close(dx, gx, 2e-5, 1e-4, "dinp");
    expect_close(dw, gw, 2e-5, 1e-4, "dweight");
    expect_close(db, gb, 2e-5, 1e-4, "dbias");

    // The parameter gradients alone (dinp null: a separate pass over columns) are the same bits
    // as those computed with the input gradient (in the same pass for C <= 1024).
    VecF dw2(C, 0.0f), db2(C, 0.0f);
    layernorm_backward(nullptr, dw2.data(), db2.data(), dy.data(), x.data(), w.data(), mean.data(),
                       rstd.data(), N, C);
    EXPECT_EQ(dw2, dw);
    EXPECT_EQ(db2, db);
  }
}

// Every LayerNorm output, for every storage type, is the same bits with 1, 2 and 3 threads: rows
// belong to one thread, and the parameter gradients are summed in blocks of rows fixed by N.
TEST(LayerNorm, ThreadCountIndependent) {
  const int saved = omp_get_max_threads();
  for (int C : {37, 768, 1100}) {
    const int N = 301;  // 12 blocks of 25 or 26 rows: 6 a thread with 2 threads, 4 with 3
    const size_t NC = size_t(N) * C;
    VecF x = rand_vec(NC, 40, -2, 2), w = rand_vec(C, 41), b = rand_vec(C, 42),
         dy = rand_vec(NC, 43);
    std::vector<bf16_t> dyb(NC);
    std::vector<f16_t> dyh(NC);
    cast_to_bf16(dyb.data(), dy.data(), int64_t(NC));
    cast_to_f16(dyh.data(), dy.data(), int64_t(NC));
    auto run = [&] {
      std::vector<VecF> r;
      VecF out(NC), mean(N), rstd(N);
      std::vector<bf16_t> outb(NC), lowb(NC);
      std::vector<f16_t> outh(NC), lowh(NC);
      layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
      layernorm_forward(outb.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
      layernorm_forward(outh.data(), mean.data(), rstd.data(), x.data(), w.data(), nullptr, N, C);
      VecF dx(NC, 0.5f), dw(C, 0.0f), db(C, 0.0f), dxb(NC, 0.5f), dwb(C, 0.0f), dbb(C, 0.0f),
          dxh(NC, 0.5f), dwh(C, 0.0f);
      layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(),
                         mean.data(), rstd.data(), N, C);
      layernorm_backward(dxb.data(), lowb.data(), dwb.data(), dbb.data(), dyb.data(), x.data(),
                         w.data(), mean.data(), rstd.data(), N, C);
      layernorm_backward(dxh.data(), lowh.data(), dwh.data(), nullptr, dyh.data(), x.data(),
                         w.data(), mean.data(), rstd.data(), N, C);
      VecF ob(NC), oh(NC), lb(NC), lh(NC);
      for (size_t i = 0; i < NC; ++i) {
        ob[i] = float(outb[i].bits), oh[i] = float(outh[i].bits);
        lb[i] = float(lowb[i].bits), lh[i] = float(lowh[i].bits);
      }
      r = {out, mean, rstd, ob, oh, dx, dw, db, dxb, dwb, dbb, lb, dxh, dwh, lh};
      return r;
    };
    omp_set_num_threads(1);
    const auto one = run();
    // dinp_low is the updated dinp rounded (the cast it replaces), in both forms of the backward.
    std::vector<bf16_t> castb(NC);
    std::vector<f16_t> casth(NC);
    cast_to_bf16(castb.data(), one[8].data(), int64_t(NC));
    cast_to_f16(casth.data(), one[12].data(), int64_t(NC));
    for (size_t i = 0; i < NC; ++i) {
      ASSERT_EQ(one[11][i], float(castb[i].bits)) << "bf16 dinp_low " << i << ", C = " << C;
      ASSERT_EQ(one[14][i], float(casth[i].bits)) << "f16 dinp_low " << i << ", C = " << C;
    }
    for (int threads : {2, 3}) {
      omp_set_num_threads(threads);
      const auto other = run();
      for (size_t i = 0; i < one.size(); ++i) {
        EXPECT_EQ(other[i], one[i])
            << "output " << i << ", C = " << C << ", " << threads << " threads";
      }
    }
  }
  omp_set_num_threads(saved);
}

// ---- matmul --------------------------------------------------------------------------------

struct MatmulCase {
  WeightLayout layout;
  bool bias;
  bool dinp;
};

class MatmulTest : public ::testing::TestWithParam<MatmulCase> {};

TEST_P(MatmulTest, ForwardBackwardAccumulate) {
  const auto [layout, has_bias, has_dinp] = GetParam();
  const int N = 7, IC = 13, OC = 11;
  VecF x = rand_vec(N * IC, 30), w = rand_vec(IC * OC, 31), b = rand_vec(OC, 32);
  VecD xd = to_d(x), wd = to_d(w), bd = to_d(b);
  const VecD* bp = has_bias ? &bd : nullptr;

  VecF out(N * OC);
  matmul_forward(out.data(), x.data(), w.data(), has_bias ? b.data() : nullptr, N, IC, OC, layout);
  // Dot products of 13 terms of size <= 1 in float: error ~1e-6.
  expect_close(out, matmul_ref(xd, wd, bp, N, IC, OC, layout), 1e-5, 1e-5, "out");

  VecD R = to_d(rand_vec(N * OC, 33));
  VecF dout(R.begin(), R.end());
  VecF dinp(N * IC, 123.0f);  // overwritten, so garbage in must not matter
  VecF dw(IC * OC, 0.0f), db(OC, 0.0f);
  matmul_backward(has_dinp ? dinp.data() : nullptr, dw.data(), has_bias ? db.data() : nullptr,
                  dout.data(), x.data(), w.data(), N, IC, OC, layout);
  VecD g_x =
      fd_grad([&](const VecD& v) { return matmul_ref(v, wd, bp, N, IC, OC, layout); }, xd, R);
  VecD g_w =
      fd_grad([&](const VecD& v) { return matmul_ref(xd, v, bp, N, IC, OC, layout); }, wd, R);
  // Float sums of <= 11 products of size <= 1: error ~1e-6.
  if (has_dinp) {
    expect_close(dinp, g_x, 1e-5, 1e-4, "dinp");
  } else {
    for (float v : dinp) ASSERT_EQ(v, 123.0f) << "dinp is null: nothing may be written";
  }
  expect_close(dw, g_w, 1e-5, 1e-4, "dweight");
  VecD g_b;
  if (has_bias) {
    g_b = fd_grad([&](const VecD& v) { return matmul_ref(xd, wd, &v, N, IC, OC, layout); }, bd, R);
    expect_close(db, g_b, 1e-5, 1e-4, "dbias");
  }

  // dweight and dbias accumulate; dinp is overwritten (same value again, not doubled).
  matmul_backward(has_dinp ? dinp.data() : nullptr, dw.data(), has_bias ? db.data() : nullptr,
                  dout.data(), x.data(), w.data(), N, IC, OC, layout);
  for (auto& g : g_w) g *= 2;
  for (auto& g : g_b) g *= 2;
  expect_close(dw, g_w, 2e-5, 1e-4, "dweight twice");
  if (has_bias) expect_close(db, g_b, 2e-5, 1e-4, "dbias twice");
  if (has_dinp) expect_close(dinp, g_x, 1e-5, 1e-4, "dinp twice (overwritten)");
}

INSTANTIATE_TEST_SUITE_P(Layouts, MatmulTest,
                         ::testing::Values(MatmulCase{WeightLayout::kInOut, true, true},
                                           MatmulCase{WeightLayout::kInOut, false, true},
                                           MatmulCase{WeightLayout::kInOut, true, false},
                                           MatmulCase{WeightLayout::kOutIn, true, true},
                                           MatmulCase{WeightLayout::kOutIn, false, true},
                                           MatmulCase{WeightLayout::kOutIn, false, false}),
                         [](const auto& info) {
                           return std::string(info.param.layout == WeightLayout::kInOut ? "InOut"
                                                                                        : "OutIn") +
                                  (info.param.bias ? "_Bias" : "_NoBias") +
                                  (info.param.dinp ? "_Dinp" : "_NoDinp");
                         });

TEST(Matmul, LargerShapeAndPrimitiveCache) {
  // Sizes past oneDNN's small-matrix paths, both layouts; forward against the reference.
  const int N = 64, IC = 96, OC = 80;
  VecF x = rand_vec(N * IC, 40), w = rand_vec(IC * OC, 41), b = rand_vec(OC, 42);
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    VecF out(N * OC);
    matmul_forward(out.data(), x.data(), w.data(), b.data(), N, IC, OC, layout);
    VecD bd = to_d(b);
    // 96-term float dot products: error ~1e-5 at worst.
    expect_close(out, matmul_ref(to_d(x), to_d(w), &bd, N, IC, OC, layout), 5e-5, 1e-5, "out");
  }
  // Repeated calls of a cached shape create no primitives.
  VecF out(N * OC);
  const size_t before = gemm_cached_primitives();
  for (int i = 0; i < 3; ++i)
    matmul_forward(out.data(), x.data(), w.data(), b.data(), N, IC, OC, WeightLayout::kInOut);
  EXPECT_EQ(gemm_cached_primitives(), before);
}

// ---- attention -----------------------------------------------------------------------------

void check_attention(int B, int T, int C, int NH, bool full_fd) {
  SCOPED_TRACE("B=" + std::to_string(B) + " T=" + std::to_string(T) + " C=" + std::to_string(C) +
               " NH=" + std::to_string(NH));
  VecF qkv = rand_vec(size_t(B) * T * 3 * C, 50 + T, -1.5f, 1.5f);
  VecF out(size_t(B) * T * C), att(size_t(B) * NH * T * T, 7.0f);
  attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
  VecD att_ref;
  VecD qd = to_d(qkv);
  VecD ref = attention_ref(qd, B, T, C, NH, &att_ref);
  // Float scores (HS-term dots) and softmax: error ~1e-6 relative; entries above the diagonal
  // must be exactly 0 (att_ref holds 0 there).
  expect_close(out, ref, 1e-5, 1e-4, "out");
  expect_close(att, att_ref, 1e-6, 1e-4, "att");

  VecD R = to_d(rand_vec(out.size(), 60 + T));
  VecF dout(R.begin(), R.end());
  VecF dqkv(qkv.size(), -5.0f);  // overwritten
  VecF scratch(attention_backward_scratch_floats(B, T, NH));
  attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH);
  auto f = [&](const VecD& v) { return attention_ref(v, B, T, C, NH); };
  if (full_fd) {
    // Float sums of <= T * HS terms of size ~1: ~1e-6 relative.
    expect_close(dqkv, fd_grad(f, qd, R), 2e-5, 1e-4, "dqkv");
  } else {
    VecD D = to_d(rand_vec(qkv.size(), 70 + T));
    const double fd = fd_directional(f, qd, D, R);
    double an = 0;
    for (size_t i = 0; i < D.size(); ++i) an += dqkv[i] * D[i];
    // A sum over ~1e4 gradient entries, each with ~1e-6 relative float error.
    EXPECT_NEAR(an, fd, 1e-4 * (1.0 + std::abs(fd)));
  }
}

TEST(Attention, OddSizes) { check_attention(1, 7, 8, 2, true); }
TEST(Attention, Batched) { check_attention(2, 13, 24, 3, true); }
TEST(Attention, Larger) { check_attention(2, 67, 128, 4, false); }

// ---- GELU ----------------------------------------------------------------------------------

TEST(Gelu, ForwardBackward) {
  VecF x = rand_vec(1000, 80, -6.0f, 6.0f);
  x[0] = 0.0f;
  x[1] = 12.0f;
  x[2] = -12.0f;
  x[3] = 1e-4f;
  VecF out(x.size());
  gelu_forward(out.data(), x.data(), x.size());
  VecD ref(x.size());
  for (size_t i = 0; i < x.size(); ++i) ref[i] = gelu_ref(x[i]);
  // fast_tanh has ~1e-7 absolute error, times 0.5|x| <= 6.
  expect_close(out, ref, 1e-6, 1e-6, "gelu");

  VecD R = to_d(rand_vec(x.size(), 81));
  VecF d(R.begin(), R.end());
  VecF dinp(x.size());
  gelu_backward(dinp.data(), x.data(), d.data(), x.size());
  VecD g(x.size());  // elementwise: one central difference per element
  for (size_t i = 0; i < x.size(); ++i)
    g[i] = R[i] * (gelu_ref(x[i] + 1e-5) - gelu_ref(x[i] - 1e-5)) / 2e-5;
  expect_close(dinp, g, 2e-6, 1e-5, "dinp");
  gelu_backward(d.data(), x.data(), d.data(), x.size());  // dinp aliases dout
  expect_close(d, dinp, 0, 0, "dinp in place");
}

// ---- residual ------------------------------------------------------------------------------

TEST(Residual, ForwardBackward) {
  const int64_t n = 101;
  VecF a = rand_vec(n, 90), b = rand_vec(n, 91), d = rand_vec(n, 92);
  VecF out(n);
  residual_forward(out.data(), a.data(), b.data(), n);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(out[i], a[i] + b[i]);
  VecF a2 = a;
  residual_forward(a2.data(), a2.data(), b.data(), n);  // out aliases a
  EXPECT_EQ(a2, out);

  VecF da = a, db = b;
  residual_backward(da.data(), db.data(), d.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(da[i], a[i] + d[i]);
    EXPECT_EQ(db[i], b[i] + d[i]);
  }
  residual_backward(nullptr, db.data(), d.data(), n);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(db[i], (b[i] + d[i]) + d[i]);
}

// ---- cross-entropy -------------------------------------------------------------------------

TEST(CrossEntropy, ForwardBackwardIgnoreAndInPlace) {
  const int N = 6, V = 37;
  VecF logits = rand_vec(N * V, 100, -4, 4);
  for (int i = 0; i < V; ++i) logits[3 * V + i] += 1000.0f;  // stability: huge logits
  std::vector<int32_t> tg = {5, -1, 36, 0, -1, 17};
  VecF loss(N, -1.0f);
  cross_entropy_forward(loss.data(), logits.data(), tg.data(), N, V);
  VecD ld = to_d(logits);
  // log-sum-exp in float: ~1e-6 relative; the +1000 row keeps ~1e-4 absolute in its logits.
  expect_close(loss, cross_entropy_ref(ld, tg, N, V), 1e-4, 1e-5, "losses");
  EXPECT_EQ(loss[1], 0.0f);
  EXPECT_EQ(loss[4], 0.0f);

  const float dloss = 0.25f;
  VecF dl(N * V, 9.0f);
  cross_entropy_backward(dl.data(), logits.data(), tg.data(), N, V, dloss);
  VecD R(N, dloss);  // L = dloss * sum_n losses[n]
  VecD g = fd_grad([&](const VecD& v) { return cross_entropy_ref(v, tg, N, V); }, ld, R);
  expect_close(dl, g, 1e-6, 1e-4, "dlogits");
  for (int i = 0; i < V; ++i) ASSERT_EQ(dl[1 * V + i], 0.0f) << "ignored row";

  VecF inplace = logits;
  cross_entropy_backward(inplace.data(), inplace.data(), tg.data(), N, V, dloss);
  expect_close(inplace, dl, 0, 0, "dlogits in place");
}

TEST(CrossEntropy, Gpt2Vocabulary) {
  const int N = 3, V = 50257;
  VecF logits = rand_vec(size_t(N) * V, 110, -10, 10);
  std::vector<int32_t> tg = {0, 50256, 31337};
  VecF loss(N);
  cross_entropy_forward(loss.data(), logits.data(), tg.data(), N, V);
  // A float sum of 50257 exponentials (16 lanes, then a tree): ~1e-6 relative.
  expect_close(loss, cross_entropy_ref(to_d(logits), tg, N, V), 1e-5, 1e-5, "losses");
  VecF dl(size_t(N) * V);
  cross_entropy_backward(dl.data(), logits.data(), tg.data(), N, V, 1.0f);
  for (int n = 0; n < N; ++n) {  // rows of softmax - onehot sum to 0
    double s = 0;
    for (int i = 0; i < V; ++i) s += dl[size_t(n) * V + i];
    EXPECT_NEAR(s, 0.0, 1e-5);
  }
}

// The one-pass loss: the forward saves each row's log-sum-exp, the backward reads the logits once.
// Vocabularies span several of softmax_row_stats's blocks (kSoftmaxBlock = 2048 floats), so the
// running max is raised and the partial sums rescaled between blocks.
double lse_ref(const VecD& x, size_t off, int V) {
  double mx = -1e300, s = 0;
  for (int i = 0; i < V; ++i) mx = std::max(mx, x[off + size_t(i)]);
  for (int i = 0; i < V; ++i) s += std::exp(x[off + size_t(i)] - mx);
  return std::log(s) + mx;
}

struct CeCase {
  VecF logits;
  std::vector<int32_t> tg;
  int N, V;
};

// Rows: random; ignored; +1000 (large); -1000 (small); ascending (the max rises in every block);
// descending (it never rises after the first); one spike at the end; random again.
CeCase ce_case(int V) {
  const int N = 8;
  CeCase c{rand_vec(size_t(N) * V, 120, -8, 8), {7, -1, V - 1, 0, V / 2, 3, V - 2, -1}, N, V};
  float* x = c.logits.data();
  for (int i = 0; i < V; ++i) {
    x[2 * V + i] += 1000.0f;
    x[3 * V + i] -= 1000.0f;
    x[4 * V + i] = 20.0f * float(i) / float(V);
    x[5 * V + i] = -20.0f * float(i) / float(V);
  }
  x[6 * V + V - 1] = 60.0f;
  return c;
}

TEST(CrossEntropy, OnePassForwardSavesTheLogSumExp) {
  for (int V : {37, 2048, 2049, 6150}) {
    CeCase c = ce_case(V);
    VecF loss(c.N, -1.0f), lse(c.N, -1.0f), loss_only(c.N, -1.0f);
    cross_entropy_forward(loss.data(), lse.data(), c.logits.data(), c.tg.data(), c.N, V);
    const VecD ld = to_d(c.logits);
    // One float rounding of the lse (~1e-7 relative of |lse| <= ~1060) and of the sum: the
    // +-1000 rows keep ~1e-4 absolute.
    expect_close(loss, cross_entropy_ref(ld, c.tg, c.N, V), 2e-4, 1e-5,
                 "losses V=" + std::to_string(V));
    VecD want(c.N, 0.0);
    for (int n = 0; n < c.N; ++n) {
      if (c.tg[size_t(n)] >= 0) want[size_t(n)] = lse_ref(ld, size_t(n) * V, V);
    }
    expect_close(lse, want, 2e-4, 2e-7, "lse V=" + std::to_string(V));
    EXPECT_EQ(loss[1], 0.0f);
    EXPECT_EQ(lse[1], 0.0f) << "ignored rows get lse 0";
    // Without an lse: the same losses, bit for bit.
    cross_entropy_forward(loss_only.data(), c.logits.data(), c.tg.data(), c.N, V);
    EXPECT_EQ(loss_only, loss);
  }
}

TEST(CrossEntropy, BackwardFromTheSavedLse) {
  for (int V : {37, 2049, 6150}) {
    CeCase c = ce_case(V);
    VecF loss(c.N), lse(c.N);
    cross_entropy_forward(loss.data(), lse.data(), c.logits.data(), c.tg.data(), c.N, V);
    const float dloss = 0.125f;
    VecF dl(c.logits.size(), 9.0f);
    cross_entropy_backward(dl.data(), c.logits.data(), lse.data(), c.tg.data(), c.N, V, dloss);
    // Against the double softmax: exp(x - lse) with the lse rounded to float (~1e-7 relative
    // times |lse| ~1000 in the shifted rows: ~1e-4 relative in the probabilities).
    const VecD ld = to_d(c.logits);
    VecD want(dl.size(), 0.0);
    for (int n = 0; n < c.N; ++n) {
      if (c.tg[size_t(n)] < 0) continue;
      const size_t off = size_t(n) * V;
      const double l = lse_ref(ld, off, V);
      for (int i = 0; i < V; ++i) want[off + size_t(i)] = std::exp(ld[off + size_t(i)] - l) * dloss;
      want[off + size_t(c.tg[size_t(n)])] -= dloss;
    }
    expect_close(dl, want, 1e-8, 2e-4, "dlogits V=" + std::to_string(V));
    for (int i = 0; i < V; ++i) ASSERT_EQ(dl[size_t(1) * V + size_t(i)], 0.0f) << "ignored row";
    // The statistics recomputed (no lse) and in place (fp32 storage) agree.
    VecF re(c.logits.size(), 9.0f);
    cross_entropy_backward(re.data(), c.logits.data(), c.tg.data(), c.N, V, dloss);
    expect_close(re, dl, 1e-9, 1e-5, "recomputed statistics");
    VecF inplace = c.logits;
    cross_entropy_backward_inplace(inplace.data(), lse.data(), c.tg.data(), c.N, V, dloss,
                                   DType::kF32);
    EXPECT_EQ(inplace, dl) << "in place";
    VecF aliased = c.logits;
    cross_entropy_backward(aliased.data(), aliased.data(), lse.data(), c.tg.data(), c.N, V, dloss);
    EXPECT_EQ(aliased, dl) << "dlogits aliasing logits";
  }
}

// The bf16 gradient's values [N, V] over the first half of each fp32 row (ld floats: bf16 row
// stride 2 ld); the rest of each row is scratch after the one pass (kernels.h).
bool same_bf16_gradient(const VecF& a, const VecF& b, int N, int V, int64_t ld) {
  const auto* pa = reinterpret_cast<const uint16_t*>(a.data());
  const auto* pb = reinterpret_cast<const uint16_t*>(b.data());
  for (int64_t n = 0; n < N; ++n) {
    if (std::memcmp(pa + n * 2 * ld, pb + n * 2 * ld, size_t(V) * 2) != 0) return false;
  }
  return true;
}

// Note [One-pass loss and gradient]: the forward and the in-place backward in one pass per row
// give the bytes of the two calls (losses, lse and the gradient in each storage; for fp32 and
// f16 values the whole logits buffer, padding columns included), with ignored rows, rows of
// +-1000, padded rows whose padding is NaN, dloss = inf (an injected fp16 overflow), and 1 and 2
// threads (3 for bf16 with 8 rows).
TEST(CrossEntropy, ForwardAndBackwardInOnePassAreTheTwoPassesBits) {
  const int saved = omp_get_max_threads();
  for (int V : {37, 6150}) {
    const CeCase c = ce_case(V);
    for (int N : {1, 3, 8}) {
      for (int64_t ld : {int64_t(V), int64_t(V + 11)}) {
        VecF x(size_t(N) * ld, std::nanf(""));
        for (int n = 0; n < N; ++n) {
          std::copy_n(c.logits.begin() + int64_t(n) * V, V, x.begin() + int64_t(n) * ld);
        }
        for (DType st : {DType::kF32, DType::kF16, DType::kBF16}) {
          for (float dloss : {1.0f / 3.0f, INFINITY}) {
            VecF loss(c.N, -1.0f), lse(c.N, -1.0f), two = x;
            cross_entropy_forward(loss.data(), lse.data(), two.data(), c.tg.data(), N, V, ld);
            cross_entropy_backward_inplace(two.data(), lse.data(), c.tg.data(), N, V, dloss, st,
                                           ld);
            for (int threads : {1, 2, 3}) {
              if (threads == 3 && (st != DType::kBF16 || N != 8)) continue;  // keep it quick
              omp_set_num_threads(threads);
              VecF loss1(c.N, -1.0f), lse1(c.N, -1.0f), one = x;
              cross_entropy_forward_backward_inplace(loss1.data(), lse1.data(), one.data(),
                                                     c.tg.data(), N, V, dloss, st, ld);
              const std::string what = "V=" + std::to_string(V) + " N=" + std::to_string(N) +
                                       " ld=" + std::to_string(ld) + " storage " +
                                       std::to_string(int(st)) + " dloss " + std::to_string(dloss) +
                                       " threads " + std::to_string(threads);
              ASSERT_EQ(0, std::memcmp(loss1.data(), loss.data(), loss.size() * 4)) << what;
              ASSERT_EQ(0, std::memcmp(lse1.data(), lse.data(), lse.size() * 4)) << what;
              if (st == DType::kBF16) {
                ASSERT_TRUE(same_bf16_gradient(one, two, N, V, ld)) << what;
              } else {
                ASSERT_EQ(0, std::memcmp(one.data(), two.data(), one.size() * 4)) << what;
              }
            }
            omp_set_num_threads(saved);
          }
        }
      }
    }
    // Without lse: the same losses and gradient.
    VecF loss(c.N), lse(c.N), loss1(c.N, -1.0f), two = c.logits, one = c.logits;
    cross_entropy_forward(loss.data(), lse.data(), two.data(), c.tg.data(), c.N, V);
    cross_entropy_backward_inplace(two.data(), lse.data(), c.tg.data(), c.N, V, 0.5f, DType::kBF16);
    cross_entropy_forward_backward_inplace(loss1.data(), nullptr, one.data(), c.tg.data(), c.N, V,
                                           0.5f, DType::kBF16);
    EXPECT_EQ(0, std::memcmp(loss1.data(), loss.data(), loss.size() * 4));
    EXPECT_TRUE(same_bf16_gradient(one, two, c.N, V, V));
  }
}

#if HR_AVX512_KERNELS
// exp16<true> (the loss's: no upper clamp) is exp16's bits wherever its callers use it, x <= 0
// and NaN: every 2^-12 step of [-200, 0], the ends of float's range, denormals and signed zeros.
TEST(FastMath, Exp16WithoutTheUpperClampIsExp16BelowZero) {
  std::vector<float> xs = {-INFINITY, -FLT_MAX, -FLT_MIN, -FLT_MIN / 4, -0.0f, 0.0f, std::nanf("")};
  for (int i = 0; i <= 200 * 4096; ++i) xs.push_back(-float(i) / 4096.0f);
  while (xs.size() % 16 != 0) xs.push_back(-1.0f);
  for (size_t i = 0; i < xs.size(); i += 16) {
    const __m512 x = _mm512_loadu_ps(xs.data() + i);
    alignas(64) uint32_t got[16], want[16];
    _mm512_store_si512(got, _mm512_castps_si512(exp16<true>(x)));
    _mm512_store_si512(want, _mm512_castps_si512(exp16<false>(x)));
    for (int j = 0; j < 16; ++j) ASSERT_EQ(got[j], want[j]) << "exp16 at " << xs[i + size_t(j)];
  }
}

// The group forms of gelu16 and gelu_grad16 (K vectors step by step, as the GELU kernels run them)
// give each lane the bits of the one-vector form, whichever of the K vectors holds it, in fp32 and
// 16-bit precision: every 2^-8 step of [-12, 12] and the special values (NaN, infinities, the
// clamps' edges, denormals, signed zeros), in every position of groups of 2, 4 and 8.
template <int K>
void expect_group_forms_match_one_at_a_time(const std::vector<float>& xs) {
  for (size_t i0 = 0; i0 + 16 * K <= xs.size(); i0 += 16 * K) {
    __m512 v[4][K];
    for (int k = 0; k < K; ++k) {
      for (auto& w : v) w[k] = _mm512_loadu_ps(xs.data() + i0 + 16 * size_t(k));
    }
    gelu16<false>(v[0]);
    gelu16<true>(v[1]);
    gelu_grad16<false>(v[2]);
    gelu_grad16<true>(v[3]);
    for (int k = 0; k < K; ++k) {
      const __m512 x = _mm512_loadu_ps(xs.data() + i0 + 16 * size_t(k));
      const __m512 want[4] = {gelu16<false>(x), gelu16<true>(x), gelu_grad16<false>(x),
                              gelu_grad16<true>(x)};
      for (int f = 0; f < 4; ++f) {
        alignas(64) uint32_t got_bits[16], want_bits[16];
        _mm512_store_si512(got_bits, _mm512_castps_si512(v[f][k]));
        _mm512_store_si512(want_bits, _mm512_castps_si512(want[f]));
        for (int j = 0; j < 16; ++j) {
          ASSERT_EQ(got_bits[j], want_bits[j])
              << "form " << f << " (gelu16, gelu16<true>, gelu_grad16, gelu_grad16<true>), K " << K
              << ", vector " << k << ", at x = " << xs[i0 + 16 * size_t(k) + size_t(j)];
        }
      }
    }
  }
}
TEST(FastMath, GeluGroupFormsMatchOneVectorAtATime) {
  std::vector<float> xs = {std::nanf(""), -INFINITY, INFINITY, -FLT_MAX, FLT_MAX, -FLT_MIN,
                           FLT_MIN / 4,   -0.0f,     0.0f,     -10.0f,   10.0f,   -10.5f,
                           10.5f,         -0.75f,    1e20f,    -1e20f};
  for (int i = -12 * 256; i <= 12 * 256; ++i) xs.push_back(float(i) / 256.0f);
  while (xs.size() % (16 * 8) != 0) xs.push_back(-0.5f);
  for (int r = 0; r < 16; ++r) {  // by 17 each time: every value in each lane and vector of a group
    expect_group_forms_match_one_at_a_time<2>(xs);
    expect_group_forms_match_one_at_a_time<4>(xs);
    expect_group_forms_match_one_at_a_time<8>(xs);
    std::rotate(xs.begin(), xs.begin() + 17, xs.end());
  }
}
#endif

// row_max keeps four running maxima over blocks of 64, then takes the whole vectors and the
// masked last one left: the row's max wherever it stands (in each of the four accumulators, in a
// whole vector after the last block, in the masked tail), at every position of lengths around
// those edges up to 200 and at such positions of a GPT-2 row, among random values or -FLT_MAX.
TEST(FastMath, RowMaxFindsTheMaxAtEveryPosition) {
  for (int V : {1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 200, 50257}) {
    VecF x = rand_vec(V, 70 + V, -30, 30);
    for (float& v : x) v = std::min(v, 29.0f);
    const std::vector<int> where =
        V > 200 ? std::vector<int>{0, 16, 33, 63, 50175, 50191, 50240, V - 1} : [&] {
          std::vector<int> all(V);
          for (int i = 0; i < V; ++i) all[i] = i;
          return all;
        }();
    for (int at : where) {
      VecF y = x;
      y[size_t(at)] = 29.5f;
      ASSERT_EQ(row_max(y.data(), V), 29.5f) << "V " << V << ", max at " << at;
      std::fill(y.begin(), y.end(), -FLT_MAX);
      y[size_t(at)] = -1e30f;
      ASSERT_EQ(row_max(y.data(), V), -1e30f) << "V " << V << ", max at " << at;
    }
  }
}

TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  const int N = 4, V = 29;
  VecF logits = rand_vec(N * V, 130, -3, 3);
  std::vector<int32_t> tg = {2, -1, 28, 0};
  VecF loss(N), lse(N), dl(N * V);
  cross_entropy_forward(loss.data(), lse.data(), logits.data(), tg.data(), N, V);
  const float dloss = 0.5f;
  cross_entropy_backward(dl.data(), logits.data(), lse.data(), tg.data(), N, V, dloss);
  VecD R(N, dloss);
  VecD g = fd_grad([&](const VecD& v) { return cross_entropy_ref(v, tg, N, V); }, to_d(logits), R);
  expect_close(dl, g, 1e-6, 1e-4, "dlogits");
}

TEST(CrossEntropy, ThreadCountIndependent) {
  // Each row is computed by one thread with blocks and lanes fixed by V: the same bits with 1, 2
  // and 3 threads, for every dlogits storage.
  const int saved = omp_get_max_threads();
  CeCase c = ce_case(6150);
  std::vector<std::vector<float>> first;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    std::vector<std::vector<float>> r;
    VecF loss(c.N), lse(c.N);
    cross_entropy_forward(loss.data(), lse.data(), c.logits.data(), c.tg.data(), c.N, c.V);
    r.push_back(loss);
    r.push_back(lse);
    for (DType st : {DType::kF32, DType::kF16, DType::kBF16}) {
      VecF d = c.logits;
      cross_entropy_backward_inplace(d.data(), lse.data(), c.tg.data(), c.N, c.V, 0.01f, st);
      r.push_back(d);
    }
    if (first.empty()) {
      first = r;
    } else {
      for (size_t i = 0; i < r.size(); ++i) {
        EXPECT_EQ(r[i], first[i]) << "output " << i << " with " << threads << " threads";
      }
    }
  }
  omp_set_num_threads(saved);
}

// GELU and the casts run every element through the same vector instructions (the last vector of
// each thread's range masked, no scalar tail): the same bits for any thread count, at a length
// that splits differently for 1, 2 and 3 threads.
TEST(Elementwise, GeluAndCastsAreThreadCountIndependent) {
  const int saved = omp_get_max_threads();
  const int64_t n = 100003;
  const size_t un = static_cast<size_t>(n);
  VecF x = rand_vec(un, 140, -6, 6), d = rand_vec(un, 141);
  std::vector<bf16_t> xb(un), db(un);
  std::vector<f16_t> xh(un), dh(un);
  cast_to_bf16(xb.data(), x.data(), n);
  cast_to_bf16(db.data(), d.data(), n);
  cast_to_f16(xh.data(), x.data(), n);
  cast_to_f16(dh.data(), d.data(), n);
  auto run = [&] {
    std::vector<std::vector<uint16_t>> r16;
    std::vector<VecF> r32;
    VecF y(un), g(un), rh(un);
    gelu_forward(y.data(), x.data(), n);
    gelu_backward(g.data(), x.data(), d.data(), n);
    round_to_f16_values(rh.data(), x.data(), n);
    r32 = {y, g, rh};
    std::vector<bf16_t> yb(un), gb(un), cb(un);
    std::vector<f16_t> yh(un), gh(un);
    gelu_forward(yb.data(), xb.data(), n);
    gelu_backward(gb.data(), xb.data(), db.data(), n);
    cast_to_bf16(cb.data(), x.data(), n);
    gelu_forward(yh.data(), xh.data(), n);
    gelu_backward(gh.data(), xh.data(), dh.data(), n);
    for (const auto* v : {&yb, &gb, &cb}) {
      std::vector<uint16_t> bits;
      for (bf16_t b : *v) bits.push_back(b.bits);
      r16.push_back(bits);
    }
    for (const auto* v : {&yh, &gh}) {
      std::vector<uint16_t> bits;
      for (f16_t h : *v) bits.push_back(h.bits);
      r16.push_back(bits);
    }
    return std::make_pair(r32, r16);
  };
  omp_set_num_threads(1);
  const auto one = run();
  for (int threads : {2, 3}) {
    omp_set_num_threads(threads);
    const auto other = run();
    for (size_t i = 0; i < one.first.size(); ++i) {
      EXPECT_EQ(other.first[i], one.first[i]) << "fp32 output " << i << ", " << threads;
    }
    for (size_t i = 0; i < one.second.size(); ++i) {
      EXPECT_EQ(other.second[i], one.second[i]) << "16-bit output " << i << ", " << threads;
    }
  }
  omp_set_num_threads(saved);
}

// ---- AdamW ---------------------------------------------------------------------------------

TEST(AdamW, ThreeStepsMatchTorchFormula) {
  const int64_t n = 45;
  VecF p = rand_vec(n, 120), m(n, 0.0f), v(n, 0.0f);
  AdamWParams hp{/*lr=*/1e-2f,          /*beta1=*/0.9f, /*beta2=*/0.95f,    /*eps=*/1e-8f,
                 /*weight_decay=*/0.1f, /*step=*/0,     /*grad_scale=*/0.5f};
  VecD pd = to_d(p), md(n, 0.0), vd(n, 0.0);
  for (int step = 1; step <= 3; ++step) {
    VecF g = rand_vec(n, 130 + step, -2, 2);
    hp.step = step;
    adamw_update(p.data(), g.data(), m.data(), v.data(), n, hp);
    // torch.optim.AdamW: decay, then the bias-corrected Adam step, computed in double here.
    const double b1 = hp.beta1, b2 = hp.beta2;
    for (int64_t i = 0; i < n; ++i) {
      const double gi = double(g[i]) * hp.grad_scale;
      pd[i] *= 1.0 - double(hp.lr) * hp.weight_decay;
      md[i] = b1 * md[i] + (1 - b1) * gi;
      vd[i] = b2 * vd[i] + (1 - b2) * gi * gi;
      const double mhat = md[i] / (1 - std::pow(b1, step));
      const double vhat = vd[i] / (1 - std::pow(b2, step));
      pd[i] -= double(hp.lr) * mhat / (std::sqrt(vhat) + hp.eps);
    }
  }
  // A few float roundings per step on values ~1: ~1e-6.
  expect_close(p, pd, 1e-6, 1e-6, "params");
  expect_close(m, md, 1e-6, 1e-6, "m");
  expect_close(v, vd, 1e-7, 1e-6, "v");
}

// ---- reductions ----------------------------------------------------------------------------

TEST(Reductions, SumSquaresScaleZero) {
  VecF x = rand_vec(10007, 140);
  double ref = 0;
  for (float f : x) ref += double(f) * f;
  EXPECT_NEAR(sum_squares(x.data(), x.size()), ref, 1e-9 * ref);  // double accumulation
  EXPECT_EQ(sum_squares(x.data(), 0), 0.0);
  VecF y = x;
  scale_inplace(y.data(), y.size(), 0.5f);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(y[i], x[i] * 0.5f);
  zero(y.data(), y.size());
  for (float f : y) ASSERT_EQ(f, 0.0f);
}

// Every length through the vector body and the masked tail, from unaligned starts.
TEST(Reductions, SumSquaresShortAndUnaligned) {
  VecF x = rand_vec(200, 141);
  for (int off : {0, 1, 5}) {
    for (int n = 1; n <= 100; ++n) {
      double ref = 0;
      for (int i = 0; i < n; ++i) ref += double(x[size_t(off + i)]) * x[size_t(off + i)];
      ASSERT_NEAR(sum_squares(x.data() + off, n), ref, 1e-12 * ref) << off << " " << n;
    }
  }
}

// sum_squares' exact order, written out: the gradient norm, hence the clipping scale, must not
// move by a bit when the loop changes (its prefetch changes no sum). Per thread (ranges of whole
// 16-float units), four accumulators of 8 lanes take 32-float blocks with FMAs, the masked tail
// goes into the first, then (a0 + a1) + (a2 + a3) and the lanes in order; threads in order.
double sum_squares_in_order(const float* x, int64_t n, int nth) {
  double total = 0.0;
  const int64_t units = (n + 15) / 16, per = units / nth, rem = units % nth;
  for (int64_t t = 0; t < nth; ++t) {
    const int64_t u0 = t * per + std::min(t, rem), u1 = u0 + per + (t < rem ? 1 : 0);
    const int64_t i0 = std::min(n, u0 * 16), i1 = std::min(n, u1 * 16);
    double acc[4][8] = {};
    int64_t i = i0;
    for (; i + 32 <= i1; i += 32) {
      for (int k = 0; k < 4; ++k) {
        for (int l = 0; l < 8; ++l) {
          const double d = x[i + 8 * k + l];
          acc[k][l] = std::fma(d, d, acc[k][l]);
        }
      }
    }
    for (; i < i1; i += 8) {
      for (int64_t l = 0; l < std::min<int64_t>(8, i1 - i); ++l) {
        const double d = x[i + l];
        acc[0][l] = std::fma(d, d, acc[0][l]);
      }
    }
    double s = 0.0;
    for (int l = 0; l < 8; ++l) s += (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    total += s;
  }
  return total;
}

TEST(Reductions, SumSquaresBitsAreTheWrittenOutOrder) {
  if (!HR_AVX512_KERNELS) GTEST_SKIP() << "the order written out is the AVX-512 loop's";
  const int saved = omp_get_max_threads();
  VecF x = rand_vec(300011, 142, -3, 3);
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (int64_t n : {int64_t{37}, int64_t{4099}, int64_t{300000}}) {
      for (int off : {0, 3}) {
        EXPECT_EQ(sum_squares(x.data() + off, n), sum_squares_in_order(x.data() + off, n, threads))
            << threads << " threads, n " << n << ", offset " << off;
      }
    }
  }
  omp_set_num_threads(saved);
}

// Buffers of 64 MiB and more take the non-temporal path: every float of the range zeroed, from an
// unaligned start to an odd end, and nothing outside it.
TEST(Reductions, ZeroLargeBufferExactlyItsRange) {
  const int64_t n = (int64_t{64} << 20 >> 2) + 1001;
  std::vector<float> y(size_t(n) + 10, 1.5f);
  zero(y.data() + 3, n);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(y[size_t(i)], 1.5f);
  for (int64_t i = 3; i < n + 3; ++i) ASSERT_EQ(y[size_t(i)], 0.0f) << i;
  for (size_t i = size_t(n) + 3; i < y.size(); ++i) ASSERT_EQ(y[i], 1.5f);
}

// ---- thread-count invariance ---------------------------------------------------------------

// Runs a chain of kernels at GPT-like (small) shapes and returns every output.
std::vector<VecF> run_all_kernels() {
  const int B = 2, T = 24, C = 64, NH = 4, V = 301, N = B * T;
  std::vector<VecF> r;
  std::vector<int32_t> tok(N), tg(N);
  for (int i = 0; i < N; ++i) tok[i] = (i * 37) % V, tg[i] = i % 5 == 0 ? -1 : (i * 11) % V;
  VecF wte = rand_vec(V * C, 200), wpe = rand_vec(T * C, 201), lw = rand_vec(C, 202),
       lb = rand_vec(C, 203), w = rand_vec(C * 3 * C, 204), b = rand_vec(3 * C, 205);
  VecF x(N * C), ln(N * C), mean(N), rstd(N), qkv(N * 3 * C), att(B * NH * T * T), y(N * C),
      logits(size_t(N) * V), loss(N);
  embedding_forward(x.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
  layernorm_forward(ln.data(), mean.data(), rstd.data(), x.data(), lw.data(), lb.data(), N, C);
  matmul_forward(qkv.data(), ln.data(), w.data(), b.data(), N, C, 3 * C, WeightLayout::kInOut);
  attention_forward(y.data(), att.data(), qkv.data(), B, T, C, NH);
  gelu_forward(y.data(), y.data(), y.size());
  matmul_forward(logits.data(), y.data(), wte.data(), nullptr, N, C, V, WeightLayout::kOutIn);
  cross_entropy_forward(loss.data(), logits.data(), tg.data(), N, V);
  cross_entropy_backward(logits.data(), logits.data(), tg.data(), N, V, 1.0f / N);
  VecF dy(N * C), dwte(V * C, 0.0f), dqkv(N * 3 * C), dw(C * 3 * C, 0.0f), db(3 * C, 0.0f),
      dln(N * C), dx(N * C, 0.0f), dlw(C, 0.0f), dlb(C, 0.0f), dwpe(T * C, 0.0f),
      scratch(attention_backward_scratch_floats(B, T, NH));
  matmul_backward(dy.data(), dwte.data(), nullptr, logits.data(), y.data(), wte.data(), N, C, V,
                  WeightLayout::kOutIn);
  attention_backward(dqkv.data(), scratch.data(), dy.data(), qkv.data(), att.data(), B, T, C, NH);
  matmul_backward(dln.data(), dw.data(), db.data(), dqkv.data(), ln.data(), w.data(), N, C, 3 * C,
                  WeightLayout::kInOut);
  layernorm_backward(dx.data(), dlw.data(), dlb.data(), dln.data(), x.data(), lw.data(),
                     mean.data(), rstd.data(), N, C);
  embedding_backward(dwte.data(), dwpe.data(), dx.data(), tok.data(), B, T, C);
  VecF p = w, m(w.size(), 0.0f), v(w.size(), 0.0f);
  adamw_update(p.data(), dw.data(), m.data(), v.data(), p.size(),
               AdamWParams{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1, 1.0f});
  r = {x, ln, qkv, att, y, loss, logits, dy, dqkv, dw, db, dln, dx, dlw, dlb, dwte, dwpe, p};
  r.push_back(VecF{static_cast<float>(sum_squares(dw.data(), dw.size()))});
  return r;
}

TEST(Threads, OneAndTwoThreadsAgree) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto one = run_all_kernels();
  omp_set_num_threads(2);
  const auto two = run_all_kernels();
  const auto two_again = run_all_kernels();
  omp_set_num_threads(saved);
  ASSERT_EQ(one.size(), two.size());
  for (size_t i = 0; i < one.size(); ++i) {
    // Only GEMM blocking and the sum_squares partials depend on the thread count: rounding.
    expect_close(two[i], one[i], 1e-5, 1e-4, "output " + std::to_string(i));
    // Deterministic for a fixed thread count: bit-identical.
    EXPECT_EQ(two[i], two_again[i]) << "output " << i << " differs between two runs";
  }
}

}  // namespace
}  // namespace headroom::cpu
