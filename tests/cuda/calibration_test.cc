// `headroom calibrate --device cuda`'s measurement (plan/device_calibration.h) on the GPU, at its
// full sizes: every figure measured, in the order a GPU's units imply (tensor-core bf16 above
// CUDA-core fp32; HBM far above the host link), printed for the device check's log. Skips,
// saying why, without a GPU.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>

#include "backend/cuda/build_info.h"
#include "cuda_test_util.h"
#include "plan/device_calibration.h"

namespace headroom::cudatest {
namespace {

TEST(CudaCalibration, MeasuresTheGpuThroughItsTable) {
  std::unique_ptr<backend::cuda::CudaDeviceResource> leaf;
  std::string why;
  const backend::Ops* ops = ops_and_leaf(&leaf, &why);
  if (ops == nullptr) GTEST_SKIP() << "no CUDA device: " << why;
  Result<std::unique_ptr<backend::cuda::PinnedHostResource>> pinned =
      backend::cuda::PinnedHostResource::create();
  ASSERT_TRUE(pinned.is_ok()) << pinned.status().to_string();
  const std::string name = backend::cuda::build_info().device_name;
  Result<plan::DeviceCalibration> c =
      plan::run_device_calibration(*ops, leaf.get(), pinned->get(), name);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  std::printf("%s\n", plan::describe_device_calibration(*c).c_str());
  EXPECT_EQ(c->device, name);
  EXPECT_GT(c->gemm_flops_bf16, c->gemm_flops_fp32);  // tensor cores (no TF32 for fp32 here)
  EXPECT_GE(c->gemm_peak_bf16, c->gemm_flops_bf16);
  EXPECT_GT(c->mem_bandwidth, 100e9);  // any GPU this backend targets (sm_80+) has > 1 TB/s
  EXPECT_GT(c->h2d_bandwidth, 1e9);
  EXPECT_GT(c->d2h_bandwidth, 1e9);
  EXPECT_GT(c->mem_bandwidth, c->h2d_bandwidth);
}

}  // namespace
}  // namespace headroom::cudatest
