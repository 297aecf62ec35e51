// Grouped-query attention (the NKV overloads of kernels.h and fused_kernels.h): against the
// multi-head kernels run on K/V heads expanded to every query head (in the test only), against
// central differences of a double reference, the NKV == NH case against the old signatures, and
// thread-count invariance, on every path (fp32 plain and tiled, bf16 with its tile products and
// widened, f16).
#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/cpu/bf16.h"
#include "backend/cpu/fused_kernels.h"
#include "backend/cpu/kernels.h"
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

struct Bf16KernelScope {
  explicit Bf16KernelScope(AttentionBf16Kernel k) { set_attention_bf16_kernel(k); }
  ~Bf16KernelScope() { set_attention_bf16_kernel(AttentionBf16Kernel::kAuto); }
  Bf16KernelScope(const Bf16KernelScope&) = delete;
  Bf16KernelScope& operator=(const Bf16KernelScope&) = delete;
};

struct Shape {
  int B, T, C, NH, NKV;
  int HS() const { return C / NH; }
  int64_t W() const { return int64_t(NH + 2 * NKV) * HS(); }
  size_t n_qkv() const { return size_t(B) * T * W(); }
  size_t n_out() const { return size_t(B) * T * C; }
  size_t n_lse() const { return size_t(B) * NH * T; }
  std::string str() const {
    return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " C=" + std::to_string(C) +
           " NH=" + std::to_string(NH) + " NKV=" + std::to_string(NKV);
  }
};

// qkv[B, T, (NH + 2 NKV) HS] -> qkv[B, T, 3C] with kv head h / group copied to every query head h.
template <typename V>
V expand(const V& x, const Shape& s) {
  const int HS = s.HS(), G = s.NH / s.NKV;
  V y(size_t(s.B) * s.T * 3 * s.C);
  for (size_t r = 0; r < size_t(s.B) * s.T; ++r) {
    for (int h = 0; h < s.NH; ++h) {
      const int j = h / G;
      for (int d = 0; d < HS; ++d) {
        y[r * 3 * s.C + size_t(h) * HS + d] = x[r * s.W() + size_t(h) * HS + d];
        y[r * 3 * s.C + s.C + size_t(h) * HS + d] = x[r * s.W() + size_t(s.NH + j) * HS + d];
        y[r * 3 * s.C + 2 * s.C + size_t(h) * HS + d] =
            x[r * s.W() + size_t(s.NH + s.NKV + j) * HS + d];
      }
    }
  }
  return y;
}

// The gradient w.r.t. GQA's qkv from the expanded one's: dq as it is, dk and dv of kv head j
// summed (in double) over its query heads.
VecD contract(const VecF& dx, const Shape& s) {
  const int HS = s.HS(), G = s.NH / s.NKV;
  VecD y(s.n_qkv(), 0.0);
  for (size_t r = 0; r < size_t(s.B) * s.T; ++r) {
    for (int h = 0; h < s.NH; ++h) {
      const int j = h / G;
      for (int d = 0; d < HS; ++d) {
        y[r * s.W() + size_t(h) * HS + d] = dx[r * 3 * s.C + size_t(h) * HS + d];
        y[r * s.W() + size_t(s.NH + j) * HS + d] += dx[r * 3 * s.C + s.C + size_t(h) * HS + d];
        y[r * s.W() + size_t(s.NH + s.NKV + j) * HS + d] +=
            dx[r * 3 * s.C + 2 * s.C + size_t(h) * HS + d];
      }
    }
  }
  return y;
}

// The q entries of a qkv-shaped vector (the part each query head computes alone).
template <typename V>
V q_part(const V& x, const Shape& s) {
  V y;
  for (size_t r = 0; r < size_t(s.B) * s.T; ++r) {
    y.insert(y.end(), x.begin() + r * s.W(), x.begin() + r * s.W() + s.C);
  }
  return y;
}

struct Result {
  VecF out, lse, dqkv;
};

// The same bits everywhere (NaN included); reports the first differences.
void expect_same_bits(const VecF& a, const VecF& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  int misses = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i]) && ++misses <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << a[i] << " vs " << b[i];
    }
  }
  EXPECT_EQ(misses, 0) << what << ": " << misses << " of " << a.size() << " differ";
}

// The plain kernels, GQA overloads.
Result run_plain(const Shape& s, const VecF& qkv, const VecF& dout) {
  Result r;
  r.out.assign(s.n_out(), NAN);
  r.dqkv.assign(s.n_qkv(), NAN);
  VecF att(size_t(s.B) * s.NH * s.T * s.T, NAN);
  VecF scratch(attention_backward_scratch_floats(s.B, s.T, s.NH, s.NKV), NAN);
  attention_forward(r.out.data(), att.data(), qkv.data(), s.B, s.T, s.C, s.NH, s.NKV);
  attention_backward(r.dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), s.B, s.T,
                     s.C, s.NH, s.NKV);
  r.lse = att;  // (the probabilities, for comparison)
  return r;
}

// The tiled kernels in storage T, GQA overloads; the scratch sized by the planner's functions,
// NaN-filled and followed by a guard that must survive. Results widened to fp32.
template <typename T>
Result run_tiled(const Shape& s, const VecF& qkv, const VecF& dout) {
  const DType st = dtype_of<T>();
  const std::vector<T> qkvl = narrow_vec<T>(qkv), doutl = narrow_vec<T>(dout);
  std::vector<T> out(s.n_out(), from_f32<T>(NAN)), dqkv(s.n_qkv(), from_f32<T>(NAN));
  Result r;
  r.lse.assign(s.n_lse(), NAN);
  constexpr size_t kGuard = 64;
  const size_t nf = attention_tiled_scratch_floats(s.B, s.T, s.C, s.NH, s.NKV, st);
  const size_t nb = attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH, s.NKV, st);
  VecF fs(nf + kGuard, NAN), bs(nb + kGuard, NAN);
  std::fill(fs.begin() + nf, fs.end(), 12345.0f);
  std::fill(bs.begin() + nb, bs.end(), 12345.0f);
  attention_tiled_forward(out.data(), r.lse.data(), qkvl.data(), s.B, s.T, s.C, s.NH, s.NKV,
                          fs.data());
  attention_tiled_backward(dqkv.data(), doutl.data(), qkvl.data(), out.data(), r.lse.data(), s.B,
                           s.T, s.C, s.NH, s.NKV, bs.data());
  for (size_t i = nf; i < fs.size(); ++i) EXPECT_EQ(fs[i], 12345.0f) << "forward scratch overrun";
  for (size_t i = nb; i < bs.size(); ++i) EXPECT_EQ(bs[i], 12345.0f) << "backward scratch overrun";
  r.out = widen_vec(out);
  r.dqkv = widen_vec(dqkv);
  return r;
}

// The multi-head tiled kernel (old signature) in storage T on expanded inputs; `out_for_bwd`
// (when not empty) replaces its own output in the backward.
template <typename T>
Result run_tiled_mha(const Shape& s, const VecF& qkv3, const VecF& dout,
                     const VecF& out_for_bwd = {}) {
  const DType st = dtype_of<T>();
  const std::vector<T> qkvl = narrow_vec<T>(qkv3), doutl = narrow_vec<T>(dout);
  std::vector<T> out(s.n_out()), dqkv(qkv3.size());
  Result r;
  r.lse.assign(s.n_lse(), NAN);
  VecF fs(attention_tiled_scratch_floats(s.B, s.T, s.C, s.NH, st));
  VecF bs(attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH, st));
  attention_tiled_forward(out.data(), r.lse.data(), qkvl.data(), s.B, s.T, s.C, s.NH, fs.data());
  r.out = widen_vec(out);
  const std::vector<T> ob = out_for_bwd.empty() ? out : narrow_vec<T>(out_for_bwd);
  attention_tiled_backward(dqkv.data(), doutl.data(), qkvl.data(), ob.data(), r.lse.data(), s.B,
                           s.T, s.C, s.NH, bs.data());
  r.dqkv = widen_vec(dqkv);
  return r;
}

const Shape kShapes[] = {
    {2, 37, 64, 4, 1},                         // HS = 16, one partial block, one kv head
    {2, 37, 64, 4, 2},                         // two groups of two
    {2, 37, 64, 4, 4},                         // multi-head
    {1, 130, 128, 4, 1},                       // HS = 32, T = 2 * 64 + 2
    {1, 130, 128, 4, 2}, {1, 100, 256, 4, 2},  // HS = 64
};

// The forward of each query head is the multi-head kernel's on its kv head: out, the
// probabilities and dq are the same bits as on the expanded inputs; dk and dv are sums over the
// group of the expanded kernel's (in another order: fp32 rounding, 1e-6 absolute at |dk| ~ 1).
TEST(GqaAttention, PlainMatchesExpandedMultiHead) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(s.str());
    const VecF qkv = rand_vec(s.n_qkv(), 1), dout = rand_vec(s.n_out(), 2);
    const Result g = run_plain(s, qkv, dout);
    const VecF qkv3 = expand(qkv, s);
    VecF out(s.n_out()), att(size_t(s.B) * s.NH * s.T * s.T), dqkv3(qkv3.size());
    VecF scratch(attention_backward_scratch_floats(s.B, s.T, s.NH));
    attention_forward(out.data(), att.data(), qkv3.data(), s.B, s.T, s.C, s.NH);
    attention_backward(dqkv3.data(), scratch.data(), dout.data(), qkv3.data(), att.data(), s.B, s.T,
                       s.C, s.NH);
    EXPECT_EQ(g.out, out);
    EXPECT_EQ(g.lse, att);
    const VecD want = contract(dqkv3, s);
    expect_same_bits(q_part(g.dqkv, s), q_part(VecF(want.begin(), want.end()), s), "dq");
    expect_close(g.dqkv, want, 1e-6, 1e-5, "dqkv");
  }
}

TEST(GqaAttention, TiledFp32MatchesExpandedMultiHead) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(s.str());
    const VecF qkv = rand_vec(s.n_qkv(), 3), dout = rand_vec(s.n_out(), 4);
    const Result g = run_tiled<float>(s, qkv, dout);
    const Result m = run_tiled_mha<float>(s, expand(qkv, s), dout);
    EXPECT_EQ(g.out, m.out);
    EXPECT_EQ(g.lse, m.lse);
    const VecD want = contract(m.dqkv, s);
    expect_same_bits(q_part(g.dqkv, s), q_part(VecF(want.begin(), want.end()), s), "dq");
    expect_close(g.dqkv, want, 1e-6, 1e-5, "dqkv");
    // And the plain GQA kernel (checked above against the expanded one): fp32 orders apart.
    const Result p = run_plain(s, qkv, dout);
    expect_close(g.out, p.out, 1e-6, 1e-6, "out vs plain");
    expect_close(g.dqkv, p.dqkv, 2e-6, 1e-5, "dqkv vs plain");
  }
}

// The gradient of L = sum(out * dout) w.r.t. GQA's qkv against central differences of the double
// reference on the expanded inputs (h = 1e-5; the tolerance is fp32 rounding, as the multi-head
// test's), through the tiled and the plain kernels.
TEST(GqaAttention, BackwardMatchesFiniteDifferences) {
  const Shape s{2, 9, 16, 4, 2};
  const VecF qkv = rand_vec(s.n_qkv(), 5), dout = rand_vec(s.n_out(), 6);
  auto loss = [&](const VecD& x) {
    const VecD o = attention_ref(expand(x, s), s.B, s.T, s.C, s.NH);
    double l = 0;
    for (size_t j = 0; j < o.size(); ++j) l += o[j] * dout[j];
    return l;
  };
  VecD x = to_d(qkv), g(x.size());
  const double h = 1e-5;
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double lp = loss(x);
    x[i] = x0 - h;
    const double lm = loss(x);
    x[i] = x0;
    g[i] = (lp - lm) / (2 * h);
  }
  const Result t = run_tiled<float>(s, qkv, dout), p = run_plain(s, qkv, dout);
  expect_close(t.out, attention_ref(expand(x, s), s.B, s.T, s.C, s.NH), 1e-6, 1e-6, "out");
  expect_close(t.dqkv, g, 1e-6, 1e-5, "tiled dqkv vs finite differences");
  expect_close(p.dqkv, g, 1e-6, 1e-5, "plain dqkv vs finite differences");
}

// 16-bit storage. The widened path (f16 always, bf16 under kWidenFp32) runs the fp32 code on
// widened copies: out and lse the bits of the multi-head path on expanded inputs (each query head
// computes alone), dk and dv summed over the group in fp32 and rounded once: within one rounding
// of the fp32 GQA kernel's on the same inputs. The AVX512-BF16 tile products: out and dq the bits
// of the expanded multi-head run, dk and dv within bf16 tolerances (Note in fused_kernels_test:
// 2^-5 for one head's sums; a group of G sums G of them, each rounded P and dS: G 2^-5).
template <typename T>
void check_low(AttentionBf16Kernel kernel, double round) {
  Bf16KernelScope scope(kernel);
  if (std::is_same_v<T, bf16_t> && attention_bf16_kernel() != kernel) {
    GTEST_SKIP() << "this CPU lacks the kernel";
  }
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(s.str());
    const VecF qkv = exact_rand<T>(s.n_qkv(), 7, -2, 2), dout = exact_rand<T>(s.n_out(), 8);
    const Result g = run_tiled<T>(s, qkv, dout);
    const Result m = run_tiled_mha<T>(s, expand(qkv, s), dout);
    EXPECT_EQ(g.out, m.out);
    EXPECT_EQ(g.lse, m.lse);
    const VecD summed = contract(m.dqkv, s);  // (dq as it is)
    expect_same_bits(q_part(g.dqkv, s), q_part(VecF(summed.begin(), summed.end()), s), "dq");
    // The fp32 GQA kernel on the same inputs, its backward on the 16-bit output.
    VecF out32(s.n_out()), lse32(s.n_lse()), dqkv32(s.n_qkv());
    VecF fs(attention_tiled_scratch_floats(s.B, s.T, s.C, s.NH, s.NKV));
    VecF bs(attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH, s.NKV));
    attention_tiled_forward(out32.data(), lse32.data(), qkv.data(), s.B, s.T, s.C, s.NH, s.NKV,
                            fs.data());
    attention_tiled_backward(dqkv32.data(), dout.data(), qkv.data(), g.out.data(), g.lse.data(),
                             s.B, s.T, s.C, s.NH, s.NKV, bs.data());
    const bool products =
        std::is_same_v<T, bf16_t> && kernel != AttentionBf16Kernel::kWidenFp32 && s.HS() >= 32;
    if (!products) {
      EXPECT_EQ(g.lse, lse32);
      expect_close(g.out, out32, 1e-7, round, "out vs fp32");
      expect_close(g.dqkv, dqkv32, 1e-7, round, "dqkv vs fp32");
      // And the group's sum itself (not one head's): against the expanded run's per-head results,
      // each rounded to T, summed (|dk| < 2 here: G roundings of 2 round at most).
      expect_close(g.dqkv, summed, 2 * (s.NH / s.NKV) * round, round, "dqkv vs expanded, summed");
    } else {
      const int G = s.NH / s.NKV;
      expect_close(g.out, out32, 1.0 / 128, 0, "out vs fp32");
      expect_close(g.dqkv, dqkv32, G / 32.0, 0, "dqkv vs fp32");
      // A group's dk is the sum of its heads' (not the last head's alone): against the expanded
      // run's per-head results summed, within the same tolerance.
      expect_close(g.dqkv, summed, G / 32.0, 0, "dqkv vs expanded, summed");
    }
  }
}
TEST(GqaAttention, Bf16TileProductsMatchExpandedAndFp32) {
  check_low<bf16_t>(AttentionBf16Kernel::kAvx512Bf16, 1.0 / 256);
}
TEST(GqaAttention, Bf16AmxMatchesExpandedAndFp32) {
  check_low<bf16_t>(AttentionBf16Kernel::kAmx, 1.0 / 256);
}
TEST(GqaAttention, Bf16WidenedMatchesExpandedAndFp32) {
  check_low<bf16_t>(AttentionBf16Kernel::kWidenFp32, 1.0 / 256);
}
TEST(GqaAttention, F16MatchesExpandedAndFp32) {
  check_low<f16_t>(AttentionBf16Kernel::kAuto, 1.0 / 2048);
}

// With NKV == NH, the GQA overloads and the multi-head signatures give the same bits on every
// path (the latter call the former; this pins it).
TEST(GqaAttention, MultiHeadIsTheOldSignatureBitForBit) {
  const Shape s{2, 70, 128, 4, 4};
  const VecF qkv = bf_rand(s.n_qkv(), 9, -2, 2), dout = bf_rand(s.n_out(), 10);
  {
    const Result g = run_plain(s, qkv, dout);
    VecF out(s.n_out()), att(g.lse.size()), dqkv(s.n_qkv());
    VecF scratch(attention_backward_scratch_floats(s.B, s.T, s.NH));
    EXPECT_EQ(scratch.size(), attention_backward_scratch_floats(s.B, s.T, s.NH, s.NKV));
    attention_forward(out.data(), att.data(), qkv.data(), s.B, s.T, s.C, s.NH);
    attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), s.B, s.T,
                       s.C, s.NH);
    EXPECT_EQ(g.out, out);
    EXPECT_EQ(g.lse, att);
    EXPECT_EQ(g.dqkv, dqkv);
  }
  auto same = [&](auto tag, AttentionBf16Kernel kernel) {
    using T = decltype(tag);
    Bf16KernelScope scope(kernel);
    const DType st = dtype_of<T>();
    EXPECT_EQ(attention_tiled_scratch_floats(s.B, s.T, s.C, s.NH, st),
              attention_tiled_scratch_floats(s.B, s.T, s.C, s.NH, s.NKV, st));
    EXPECT_EQ(attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH, st),
              attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH, s.NKV, st));
    const Result g = run_tiled<T>(s, qkv, dout);
    const Result m = run_tiled_mha<T>(s, qkv, dout);
    EXPECT_EQ(g.out, m.out);
    EXPECT_EQ(g.lse, m.lse);
    EXPECT_EQ(g.dqkv, m.dqkv);
  };
  same(float{}, AttentionBf16Kernel::kAuto);
  same(bf16_t{}, AttentionBf16Kernel::kAuto);
  same(bf16_t{}, AttentionBf16Kernel::kWidenFp32);
  same(f16_t{}, AttentionBf16Kernel::kAuto);
}

// Bit-identical for 1, 2 and 3 threads on every path, with two groups of four query heads and
// T not a multiple of 64.
TEST(GqaAttention, ThreadCountInvariant) {
  const Shape s{2, 150, 256, 8, 2};
  const VecF qkv = bf_rand(s.n_qkv(), 11, -2, 2), dout = bf_rand(s.n_out(), 12);
  auto check = [&](auto run) {
    Result one, two, three;
    with_threads(1, [&] { one = run(); });
    with_threads(2, [&] { two = run(); });
    with_threads(3, [&] { three = run(); });
    EXPECT_EQ(one.out, two.out);
    EXPECT_EQ(one.lse, two.lse);
    EXPECT_EQ(one.dqkv, two.dqkv);
    EXPECT_EQ(one.out, three.out);
    EXPECT_EQ(one.dqkv, three.dqkv);
  };
  check([&] { return run_plain(s, qkv, dout); });
  check([&] { return run_tiled<float>(s, qkv, dout); });
  check([&] { return run_tiled<f16_t>(s, qkv, dout); });
  for (AttentionBf16Kernel k : {AttentionBf16Kernel::kAuto, AttentionBf16Kernel::kWidenFp32}) {
    Bf16KernelScope scope(k);
    check([&] { return run_tiled<bf16_t>(s, qkv, dout); });
  }
}

// The backward's tasks are (b, kv head) pairs: min(B NKV, 64) slots, sized as multi-head's; the
// forward's are query heads, whatever NKV.
TEST(GqaAttention, ScratchFollowsTheTasks) {
  EXPECT_EQ(attention_tiled_scratch_floats(2, 256, 512, 8, 2),
            attention_tiled_scratch_floats(2, 256, 512, 8));
  EXPECT_EQ(attention_tiled_backward_scratch_floats(2, 256, 512, 8, 2),
            attention_tiled_backward_scratch_floats(2, 256, 512, 8) / 16 * 4);
  EXPECT_EQ(attention_tiled_backward_scratch_floats(2, 256, 512, 8, 1, DType::kF16),
            attention_tiled_backward_scratch_floats(2, 256, 512, 8, DType::kF16) / 16 * 2);
  EXPECT_EQ(attention_backward_scratch_floats(2, 256, 8, 2), size_t{2} * 8 * 256);
}

}  // namespace
}  // namespace headroom::cpu
