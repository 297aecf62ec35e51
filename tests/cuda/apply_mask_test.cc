// The CUDA sparsity mask (Ops::apply_mask, elementwise.cu) against the CPU table on the same
// inputs, bit for bit: +0.0f where the mask is 0 (a -0.0 and a NaN there too), every other
// element's bits kept (NaN, -0.0, infinities), misaligned offsets, odd lengths, nothing written
// outside [0, n).
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"

namespace headroom {
namespace {

using cudatest::DeviceBuffer;
using VecF = std::vector<float>;

TEST(CudaApplyMask, EqualsTheCpuBitForBit) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const float edges[] = {-0.0f, std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::infinity(), -1e-40f};
  for (int64_t n : {int64_t(1), int64_t(13), int64_t(4096), int64_t(1000003)}) {
    for (int64_t off : {int64_t(0), int64_t(1), int64_t(3)}) {
      const std::string at = "n=" + std::to_string(n) + " offset=" + std::to_string(off);
      std::mt19937 rng(uint32_t(n + off));
      std::uniform_real_distribution<float> d(-2.0f, 2.0f);
      VecF x(size_t(n + off + 5));
      std::vector<uint8_t> mask(x.size());
      for (size_t i = 0; i < x.size(); i++) {
        x[i] = d(rng);
        mask[i] = uint8_t(rng() % 3 != 0 ? 1 + rng() % 255 : 0);  // any non-zero byte keeps
      }
      for (size_t i = 0; i + 8 < x.size(); i += 97) {
        for (size_t e = 0; e < 4; e++) {
          x[i + 2 * e] = x[i + 2 * e + 1] = edges[e];
          mask[i + 2 * e] = 0;
          mask[i + 2 * e + 1] = 1;
        }
      }
      DeviceBuffer<float> d_x(x);
      DeviceBuffer<uint8_t> d_mask(mask);
      ops->apply_mask(d_mask.get() + off, d_x.get() + off, n);
      backend::cpu_ops().apply_mask(mask.data() + off, x.data() + off, n);
      const VecF got = d_x.download();
      ASSERT_EQ(got.size(), x.size());
      EXPECT_EQ(std::memcmp(got.data(), x.data(), x.size() * sizeof(float)), 0) << at;
    }
  }
}

}  // namespace
}  // namespace headroom
