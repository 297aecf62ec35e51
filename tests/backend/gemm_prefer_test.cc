// Which oneDNN implementation cpu::gemm takes (docs/gemm.md): fp32 prefers gemm:jit, and the
// measurement knob HEADROOM_GEMM_PREFER overrides that (set but empty: oneDNN's own order), with
// the same results whichever runs.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cpu/gemm.h"

namespace headroom::cpu {
namespace {

TEST(GemmPrefer, Fp32TakesJitGemmAndTheKnobOverridesItWithTheSameResult) {
  // Shapes no other test in this process creates (each row count is a new primitive, created
  // under the environment of the moment); oneDNN 2.6 ranks brgemm first for them here and also
  // offers gemm:jit.
  const int N = 80, K = 112, Mj = 96, Mo = 112, Mb = 128;
  std::vector<float> a(size_t(Mb) * K), b(size_t(K) * N);
  for (size_t i = 0; i < a.size(); ++i) a[i] = float(int(i % 13) - 6) / 8.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = float(int(i % 7) - 3) / 4.0f;
  auto run = [&](int M, std::string* impl) {
    *impl = gemm_impl_name(false, false, M, N, K, K, N, N, false, false);
    std::vector<float> c(size_t(M) * N);
    gemm(false, false, M, N, K, a.data(), K, b.data(), N, c.data(), N, nullptr, false);
    return c;
  };
  ::unsetenv("HEADROOM_GEMM_PREFER");
  std::string jit, own, brg;
  const std::vector<float> cj = run(Mj, &jit);
  ::setenv("HEADROOM_GEMM_PREFER", "", 1);
  const std::vector<float> co = run(Mo, &own);
  ::setenv("HEADROOM_GEMM_PREFER", "brg", 1);
  const std::vector<float> cb = run(Mb, &brg);
  ::unsetenv("HEADROOM_GEMM_PREFER");

  EXPECT_EQ(jit.rfind("gemm:jit", 0), 0u) << jit;
  if (own.rfind("gemm:jit", 0) == 0) GTEST_SKIP() << "oneDNN itself ranks gemm:jit first here";
  EXPECT_EQ(own.rfind("brg", 0), 0u) << own;
  EXPECT_EQ(brg.rfind("brg", 0), 0u) << brg;
  // Small integers over powers of two: every product and sum is exact in fp32, so any
  // implementation gives the same bits on the rows all three computed.
  for (size_t i = 0; i < cj.size(); ++i) {
    ASSERT_EQ(co[i], cj[i]) << i;
    ASSERT_EQ(cb[i], cj[i]) << i;
  }
}

}  // namespace
}  // namespace headroom::cpu
