// The AMX GEMM (amx_gemm.h) against a double-precision reference of the same bf16 inputs: both
// layouts of A and B, partial blocks at every edge, fp32 and bf16 C, bias and accumulation, K in
// several chunks (the last shorter), N in several packed chunks, padded strides whose padding must
// stay untouched; the same bits at 1, 2 and 3 threads and from inside a parallel region; and
// gemm_ex sending bf16 products to it (HEADROOM_BF16_GEMM=onednn sends them back to oneDNN, with
// results within rounding).
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cpu/amx_gemm.h"
#include "backend/cpu/bf16.h"
#include "backend/cpu/gemm.h"

namespace headroom::cpu {
namespace {

constexpr float kCanary = -12345.0f;

struct Shape {
  int M, N, K;
  bool trans_a, trans_b;
  DType c_type;
  bool bias, accumulate;
  int pad;  // extra elements on every leading dimension
};

std::string name(const Shape& s) {
  return std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K) +
         (s.trans_a ? " A^T" : " A") + (s.trans_b ? " B^T" : " B") +
         (s.c_type == DType::kBF16 ? " bf16 C" : " fp32 C") + (s.bias ? " +bias" : "") +
         (s.accumulate ? " C+=" : "") + " pad " + std::to_string(s.pad);
}

std::vector<bf16_t> random_bf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<bf16_t> v(n);
  for (auto& x : v) x = from_f32<bf16_t>(d(rng));
  return v;
}

struct Product {
  std::vector<float> c32;   // fp32 C [M, ldc], or
  std::vector<bf16_t> c16;  // bf16 C [M, ldc]
  float at(size_t i) const { return c32.empty() ? to_f32(c16[i]) : c32[i]; }
};

// Operands of a shape (fixed seeds) and C's starting values (canaries in the padding).
struct Operands {
  int lda, ldb, ldc;
  std::vector<bf16_t> a, b;
  std::vector<float> bias, c0;
  explicit Operands(const Shape& s)
      : lda((s.trans_a ? s.M : s.K) + s.pad),
        ldb((s.trans_b ? s.K : s.N) + s.pad),
        ldc(s.N + s.pad) {
    a = random_bf16(size_t(s.trans_a ? s.K : s.M) * lda, 1);
    b = random_bf16(size_t(s.trans_b ? s.N : s.K) * ldb, 2);
    // NaN in the padding of A's and B's rows: a kernel that read it would put NaN in C.
    const bf16_t nan{0x7fc0};
    const int a_cols = s.trans_a ? s.M : s.K, b_cols = s.trans_b ? s.K : s.N;
    for (size_t i = 0; i < a.size(); ++i) {
      if (int(i % lda) >= a_cols) a[i] = nan;
    }
    for (size_t i = 0; i < b.size(); ++i) {
      if (int(i % ldb) >= b_cols) b[i] = nan;
    }
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> d(-4.0f, 4.0f);
    bias.resize(s.N);
    for (auto& x : bias) x = d(rng);
    c0.assign(size_t(s.M) * ldc, kCanary);
    for (int i = 0; i < s.M; ++i) {
      for (int j = 0; j < s.N; ++j) {
        // bf16-exact starting values, so that a bf16 C starts from the same numbers
        c0[size_t(i) * ldc + j] = s.accumulate ? to_f32(from_f32<bf16_t>(d(rng))) : 0.0f;
      }
    }
  }
  float A(const Shape& s, int m, int k) const {
    return to_f32(s.trans_a ? a[size_t(k) * lda + m] : a[size_t(m) * lda + k]);
  }
  float B(const Shape& s, int k, int n) const {
    return to_f32(s.trans_b ? b[size_t(n) * ldb + k] : b[size_t(k) * ldb + n]);
  }
};

Product run_amx(const Shape& s, const Operands& o) {
  Product r;
  void* c;
  if (s.c_type == DType::kBF16) {
    r.c16.resize(o.c0.size());
    for (size_t i = 0; i < o.c0.size(); ++i) r.c16[i] = from_f32<bf16_t>(o.c0[i]);
    c = r.c16.data();
  } else {
    r.c32 = o.c0;
    c = r.c32.data();
  }
  amx_gemm(s.trans_a, s.trans_b, s.M, s.N, s.K, o.a.data(), o.lda, o.b.data(), o.ldb, s.c_type, c,
           o.ldc, s.bias ? o.bias.data() : nullptr, s.accumulate);
  return r;
}

void check_against_reference(const Shape& s) {
  SCOPED_TRACE(name(s));
  ASSERT_TRUE(amx_gemm_takes(s.K, s.c_type));
  const Operands o(s);
  const Product r = run_amx(s, o);
  int bad = 0;
  for (int i = 0; i < s.M; ++i) {
    for (int j = 0; j < o.ldc; ++j) {
      const size_t at = size_t(i) * o.ldc + j;
      if (j >= s.N) {  // padding: untouched
        if (r.at(at) != (s.c_type == DType::kBF16 ? to_f32(from_f32<bf16_t>(kCanary)) : kCanary) &&
            bad++ < 5) {
          ADD_FAILURE() << "padding C[" << i << "][" << j << "] written: " << r.at(at);
        }
        continue;
      }
      double want = o.c0[at] + (s.bias ? o.bias[j] : 0.0), mag = std::abs(want);
      for (int k = 0; k < s.K; ++k) {
        const double p = double(o.A(s, i, k)) * o.B(s, k, j);
        want += p;
        mag += std::abs(p);
      }
      // fp32 sums in another order: a few ulps of the terms' magnitude; bf16 C: one rounding.
      const double tol = 1e-6 * mag + (s.c_type == DType::kBF16 ? std::abs(want) / 256 : 0.0);
      if (!(std::abs(r.at(at) - want) <= tol) && bad++ < 5) {
        ADD_FAILURE() << "C[" << i << "][" << j << "] = " << r.at(at) << ", want " << want;
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

bool amx_here() {
  if (!amx_usable()) return false;
  ::unsetenv("HEADROOM_BF16_GEMM");
  return true;
}

TEST(AmxGemm, MatchesTheReferenceOnEveryLayoutAndEpilogue) {
  if (!amx_here()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  for (bool trans_a : {false, true}) {
    for (bool trans_b : {false, true}) {
      for (DType c_type : {DType::kF32, DType::kBF16}) {
        for (bool bias : {false, true}) {
          for (bool acc : {false, true}) {
            check_against_reference({64, 96, 128, trans_a, trans_b, c_type, bias, acc, 0});
          }
        }
        check_against_reference({96, 64, 64, trans_a, trans_b, c_type, true, false, 3});  // padded
      }
    }
  }
}

// Partial blocks: C's last rows and columns, K not a multiple of 32 (the last pair half empty
// too), and all three at once in one block; with padded strides whose padding must stay
// untouched in C (and whose NaNs in A and B never reach C).
TEST(AmxGemm, PartialBlocksAtEveryEdge) {
  if (!amx_here()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  for (bool trans_a : {false, true}) {
    for (bool trans_b : {false, true}) {
      for (DType c_type : {DType::kF32, DType::kBF16}) {
        check_against_reference({50, 64, 96, trans_a, trans_b, c_type, true, true, 0});
        check_against_reference({64, 45, 96, trans_a, trans_b, c_type, true, false, 5});
        check_against_reference({64, 64, 77, trans_a, trans_b, c_type, false, true, 2});
        check_against_reference({7, 9, 5, trans_a, trans_b, c_type, true, true, 1});
        check_against_reference({97, 81, 161, trans_a, trans_b, c_type, true, false, 0});
      }
    }
  }
}

// fp32 C with K = 4160: three K chunks of 44, 44 and 42 blocks (C's tiles reloaded between
// them); K = 2080: two of 33 and 32 blocks; K = 2100: two of 33, the last partial. N = 2112 at
// K = 512: three packed chunks of 1024, 1024 and 64 columns. bf16 C takes K up to 4096 in one
// chunk.
TEST(AmxGemm, KAndNInSeveralChunks) {
  if (!amx_here()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  check_against_reference({32, 64, 4160, false, false, DType::kF32, true, true, 0});
  check_against_reference({64, 32, 2080, false, true, DType::kF32, false, false, 1});
  check_against_reference({40, 32, 2100, true, true, DType::kF32, true, true, 0});
  check_against_reference({64, 2112, 512, false, false, DType::kF32, true, false, 0});
  check_against_reference({32, 2112, 512, false, true, DType::kBF16, false, true, 0});
  check_against_reference({32, 64, 4096, false, true, DType::kBF16, true, false, 0});
}

TEST(AmxGemm, SameBitsAtAnyThreadCountAndInsideAParallelRegion) {
  if (!amx_here()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  const int saved = omp_get_max_threads();
  for (const Shape& s : {Shape{160, 2112, 512, false, false, DType::kF32, true, true, 0},
                         Shape{96, 96, 2080, false, true, DType::kF32, false, false, 0},
                         Shape{150, 90, 250, true, true, DType::kBF16, true, true, 0}}) {
    SCOPED_TRACE(name(s));
    const Operands o(s);
    omp_set_num_threads(1);
    const Product one = run_amx(s, o);
    for (int t : {2, 3}) {
      omp_set_num_threads(t);
      const Product r = run_amx(s, o);
      for (size_t i = 0; i < o.c0.size(); ++i)
        ASSERT_EQ(r.at(i), one.at(i)) << t << " threads, " << i;
    }
    omp_set_num_threads(2);
    Product inside;
#pragma omp parallel num_threads(2)
    {
#pragma omp single
      inside = run_amx(s, o);
    }
    for (size_t i = 0; i < o.c0.size(); ++i) ASSERT_EQ(inside.at(i), one.at(i)) << i;
  }
  omp_set_num_threads(saved);
}

TEST(AmxGemm, TakesOnlyWhatItCanAndTheKnobSendsBf16BackToOneDnn) {
  if (!amx_here()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  EXPECT_TRUE(amx_gemm_takes(1, DType::kF32));
  EXPECT_TRUE(amx_gemm_takes(50257, DType::kF32));
  EXPECT_TRUE(amx_gemm_takes(4096, DType::kBF16));
  EXPECT_FALSE(amx_gemm_takes(4097, DType::kBF16));  // its sums would leave the tiles

  // gemm_ex: the same product through our kernel and through oneDNN.
  const Shape s{64, 64, 256, false, true, DType::kF32, true, false, 0};
  const Operands o(s);
  auto via_gemm_ex = [&] {
    std::vector<float> c(o.c0);
    gemm_ex(false, true, s.M, s.N, s.K, DType::kBF16, o.a.data(), o.lda, o.b.data(), o.ldb,
            DType::kF32, c.data(), o.ldc, o.bias.data(), false);
    return c;
  };
  EXPECT_STREQ(gemm_impl_name(false, true, s.M, s.N, s.K, o.lda, o.ldb, o.ldc, true, false,
                              DType::kBF16, DType::kF32),
               "headroom:amx");
  // A transposed stays on oneDNN's strided kernel (faster than staging A^T here).
  const std::string transposed_a =
      gemm_impl_name(true, false, 64, 64, 256, 64, 64, 64, false, true, DType::kBF16, DType::kF32);
  EXPECT_EQ(transposed_a.find("headroom"), std::string::npos) << transposed_a;
  const std::vector<float> ours = via_gemm_ex();
  ::setenv("HEADROOM_BF16_GEMM", "onednn", 1);
  EXPECT_FALSE(amx_gemm_takes(32, DType::kF32));
  const std::string impl = gemm_impl_name(false, true, s.M, s.N, s.K, o.lda, o.ldb, o.ldc, true,
                                          false, DType::kBF16, DType::kF32);
  EXPECT_EQ(impl.find("headroom"), std::string::npos) << impl;
  const std::vector<float> theirs = via_gemm_ex();
  for (size_t i = 0; i < ours.size(); ++i) {
    ASSERT_NEAR(ours[i], theirs[i], 1e-4 * (1.0 + std::abs(theirs[i]))) << i;
  }
  ::setenv("HEADROOM_BF16_GEMM", "amx-please", 1);
  try {
    amx_gemm_takes(32, DType::kF32);
    ADD_FAILURE() << "a bad HEADROOM_BF16_GEMM was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("HEADROOM_BF16_GEMM=amx-please"), std::string::npos);
  }
  ::unsetenv("HEADROOM_BF16_GEMM");
  EXPECT_GE(amx_gemm_buffer_bytes(), size_t{2} << 20);
}

}  // namespace
}  // namespace headroom::cpu
