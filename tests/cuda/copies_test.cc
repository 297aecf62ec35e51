// The CUDA table's asynchronous copies (Ops::copy_to_host_async / copy_to_device_async /
// wait_copy, the offload copy thread's): the bytes round-trip, a copy is ordered after the ops
// queued before it and the ops queued after its wait are ordered after it, from another thread
// too. Each test skips, saying why, without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "cuda_test_util.h"

namespace headroom::cudatest {
namespace {

TEST(CudaCopies, AsynchronousCopiesRoundTrip) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const VecF src = rnd(1 << 20, 7);
  DeviceBuffer<float> dev(src.size());
  const size_t bytes = src.size() * sizeof(float);
  const uint64_t in = ops->copy_to_device_async(dev.get(), src.data(), bytes);
  EXPECT_GT(in, 0u);
  ops->wait_copy(in);
  VecF back(src.size(), 0.0f);
  const uint64_t out = ops->copy_to_host_async(back.data(), dev.get(), bytes);
  ops->wait_copy(out);
  EXPECT_EQ(0, std::memcmp(src.data(), back.data(), bytes));
  EXPECT_EQ(ops->copy_to_host_async(back.data(), dev.get(), 0), 0u);  // nothing to copy
  ops->wait_copy(0);
}

TEST(CudaCopies, OrderedAfterTheOpsBeforeAndBeforeTheOpsAfterTheWait) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const size_t n = size_t(1) << 22;
  const VecF src = rnd(n, 3);
  DeviceBuffer<float> dev(src.size());
  const size_t bytes = n * sizeof(float);
  // Queued on the compute stream before the copy out: the copy sees the fill.
  ops->fill_bytes(dev.get(), 0x3F, bytes);
  std::vector<unsigned char> out(bytes, 0);
  ops->wait_copy(ops->copy_to_host_async(out.data(), dev.get(), bytes));
  for (size_t i = 0; i < bytes; i += 4097) ASSERT_EQ(out[i], 0x3F) << i;
  // Copied in, waited for, then scaled on the compute stream: the op reads the landed values.
  ops->wait_copy(ops->copy_to_device_async(dev.get(), src.data(), bytes));
  ops->scale_inplace(dev.get(), int64_t(n), 2.0f);
  VecF got(n, 0.0f);
  ops->copy_to_host(got.data(), dev.get(), bytes);
  for (size_t i = 0; i < n; i += 997) ASSERT_EQ(got[i], src[i] * 2.0f) << i;
}

TEST(CudaCopies, FromAnotherThread) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const VecF src = rnd(1 << 18, 5);
  DeviceBuffer<float> dev(src.size());
  const size_t bytes = src.size() * sizeof(float);
  VecF back(src.size(), 0.0f);
  std::thread copier([&] {
    ops->wait_copy(ops->copy_to_device_async(dev.get(), src.data(), bytes));
    const uint64_t t = ops->copy_to_host_async(back.data(), dev.get(), bytes);
    ops->wait_copy(t);
  });
  copier.join();
  EXPECT_EQ(0, std::memcmp(src.data(), back.data(), bytes));
}

}  // namespace
}  // namespace headroom::cudatest
