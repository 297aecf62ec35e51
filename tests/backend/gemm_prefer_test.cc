// HEADROOM_GEMM_PREFER, the measurement knob of cpu::gemm (docs/gemm.md): a shape created while
// it names an implementation prefix runs on that implementation, with the same results.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cpu/gemm.h"

namespace headroom::cpu {
namespace {

TEST(GemmPrefer, PicksTheNamedImplementationWithTheSameResult) {
  // A shape no other test in this process creates; oneDNN 2.6 runs it on brgemm by default here
  // and has gemm:jit among its implementations.
  const int M = 96, M2 = 112, N = 80, K = 112;
  std::vector<float> a(size_t(M2) * K), b(size_t(K) * N), c0(size_t(M) * N);
  for (size_t i = 0; i < a.size(); ++i) a[i] = float(int(i % 13) - 6) / 8.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = float(int(i % 7) - 3) / 4.0f;
  const std::string plain = gemm_impl_name(false, false, M, N, K, K, N, N, false, false);
  if (plain.rfind("gemm:jit", 0) == 0) GTEST_SKIP() << "oneDNN already picks gemm:jit here";
  gemm(false, false, M, N, K, a.data(), K, b.data(), N, c0.data(), N, nullptr, false);

  ::setenv("HEADROOM_GEMM_PREFER", "gemm:jit", 1);
  // More rows (dense strides, as above): a new primitive, created under the knob.
  const std::string preferred = gemm_impl_name(false, false, M2, N, K, K, N, N, false, false);
  std::vector<float> c1(size_t(M2) * N);
  gemm(false, false, M2, N, K, a.data(), K, b.data(), N, c1.data(), N, nullptr, false);
  ::unsetenv("HEADROOM_GEMM_PREFER");

  EXPECT_EQ(preferred.rfind("gemm:jit", 0), 0u) << preferred << " (default: " << plain << ")";
  // Small integers over powers of two: every product and sum is exact in fp32, so any
  // implementation gives the same bits on the rows both computed.
  for (size_t i = 0; i < c0.size(); ++i) ASSERT_EQ(c1[i], c0[i]) << i;
}

}  // namespace
}  // namespace headroom::cpu
