// The NCCL communicator with one rank (bootstrapped over the local communicator): every
// collective's result against LocalCommunicator's on the same data, host data through the
// staging path (agree()), and the stream order the events give. The 2-rank run against MPI's
// results is tests/cuda/nccl_mpi.cc (ctest cuda_nccl_2ranks).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "backend/cuda/cuda_ops_impl.h"
#include "cuda_test_util.h"
#include "dist/communicator.h"
#include "dist/nccl/nccl_communicator.h"

namespace headroom {
namespace {

#if defined(HEADROOM_HAVE_NCCL)

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// The one-rank NCCL communicator, or a skip naming why there is none.
#define HR_NCCL_OR_SKIP(var)                                                                     \
  HR_CUDA_OPS_OR_SKIP(hr_ops_);                                                                  \
  dist::LocalCommunicator hr_boot_;                                                              \
  Result<std::unique_ptr<dist::Communicator>> hr_made_ = dist::make_nccl_communicator(hr_boot_); \
  ASSERT_TRUE(hr_made_.is_ok()) << hr_made_.status().to_string();                                \
  dist::Communicator& var = **hr_made_

TEST(NcclCommunicator, OneRankMatchesTheLocalCommunicator) {
  HR_NCCL_OR_SKIP(nccl);
  EXPECT_EQ(nccl.rank(), 0);
  EXPECT_EQ(nccl.size(), 1);
  EXPECT_EQ(nccl.name(), "nccl");
  dist::LocalCommunicator local;
  for (size_t n : {size_t(1), size_t(1000), size_t(12345), size_t(3) << 20}) {
    // all_reduce (float, double) and all_reduce_min: device data, compared with the local one.
    std::vector<float> f = random_floats(n, uint32_t(n));
    cudatest::DeviceBuffer<float> df(f);
    ASSERT_TRUE(nccl.all_reduce(df.get(), int64_t(n)).is_ok());
    ASSERT_TRUE(local.all_reduce(f.data(), int64_t(n)).is_ok());
    EXPECT_EQ(df.download(), f);
    std::vector<double> d(n);
    for (size_t i = 0; i < n; i++) d[i] = double(f[i]) * 1e-3 + double(i);
    cudatest::DeviceBuffer<double> dd(d);
    ASSERT_TRUE(nccl.all_reduce(dd.get(), int64_t(n)).is_ok());
    ASSERT_TRUE(local.all_reduce(d.data(), int64_t(n)).is_ok());
    EXPECT_EQ(dd.download(), d);
    std::vector<int64_t> m(n);
    for (size_t i = 0; i < n; i++) m[i] = int64_t(i * 2654435761u % 1000003) - 500000;
    cudatest::DeviceBuffer<int64_t> dm(m);
    ASSERT_TRUE(nccl.all_reduce_min(dm.get(), int64_t(n)).is_ok());
    ASSERT_TRUE(local.all_reduce_min(m.data(), int64_t(n)).is_ok());
    EXPECT_EQ(dm.download(), m);

    // reduce_scatter: recv := the (one-rank) sum of the segment.
    const std::vector<int64_t> counts = {int64_t(n)};
    std::vector<float> recv(n, -7.0f);
    cudatest::DeviceBuffer<float> dsend(f), drecv(recv);
    ASSERT_TRUE(nccl.reduce_scatter(dsend.get(), drecv.get(), counts).is_ok());
    ASSERT_TRUE(local.reduce_scatter(f.data(), recv.data(), counts).is_ok());
    EXPECT_EQ(drecv.download(), recv);

    // all_gather, out of place and in place.
    std::vector<float> g(n, 3.0f);
    cudatest::DeviceBuffer<float> dg(g);
    ASSERT_TRUE(nccl.all_gather(dsend.get(), dg.get(), counts).is_ok());
    ASSERT_TRUE(local.all_gather(f.data(), g.data(), counts).is_ok());
    EXPECT_EQ(dg.download(), g);
    ASSERT_TRUE(nccl.all_gather(dg.get(), dg.get(), counts).is_ok());
    EXPECT_EQ(dg.download(), g);

    // broadcast from the root (bytes, not a multiple of 4).
    const int64_t bytes = int64_t(n * sizeof(float)) - 1;
    ASSERT_TRUE(nccl.broadcast(static_cast<void*>(dsend.get()), bytes, 0).is_ok());
    EXPECT_EQ(dsend.download(), f);
  }
  ASSERT_TRUE(nccl.barrier().is_ok());
  hr_ops_->synchronize();
}

// Host memory (agree()'s header and message) goes through the staging buffer, in pieces when
// larger than it; agree() itself then works over NCCL.
TEST(NcclCommunicator, HostDataIsStagedAndAgreeWorks) {
  HR_NCCL_OR_SKIP(nccl);
  std::vector<float> f = random_floats((size_t(3) << 18) + 17, 5);  // 3 MiB + 68 B: 4 pieces
  std::vector<float> before = f;
  ASSERT_TRUE(nccl.all_reduce(f.data(), int64_t(f.size())).is_ok());
  EXPECT_EQ(f, before);
  int64_t v[3] = {5, -9, 1};
  ASSERT_TRUE(nccl.all_reduce_min(v, 3).is_ok());
  EXPECT_EQ(v[1], -9);
  char text[] = "a message of a failing rank";
  ASSERT_TRUE(nccl.broadcast(text, sizeof(text), 0).is_ok());
  EXPECT_STREQ(text, "a message of a failing rank");
  EXPECT_TRUE(dist::agree(nccl, Status::ok()).is_ok());
  const Status bad = dist::agree(nccl, Status::out_of_memory("step 3: 2 GiB short"));
  EXPECT_EQ(bad.code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(bad.message(), "rank 0: step 3: 2 GiB short");
  // reduce_scatter and all_gather need device memory: a clear error, not a crash.
  std::vector<float> recv(f.size());
  const std::vector<int64_t> counts = {int64_t(f.size())};
  const Status host = nccl.reduce_scatter(f.data(), recv.data(), counts);
  EXPECT_EQ(host.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(host.message().find("host memory"), std::string::npos) << host.to_string();
}

// The events order a collective after the compute work queued before it and the compute work
// queued after it behind the collective: fill a buffer on the compute stream, gather it on the
// comm stream into another, copy that back on the compute stream. Without the events the copy
// could read the destination before the gather wrote it (64 MiB widens that window).
TEST(NcclCommunicator, CollectivesAreOrderedWithTheComputeStream) {
  HR_NCCL_OR_SKIP(nccl);
  const auto* cuda = static_cast<const backend::cuda::CudaOps*>(hr_ops_);
  const cudaStream_t compute = cuda->stream();
  const size_t n = size_t(16) << 20;
  cudatest::DeviceBuffer<float> src(n), dst(n);
  std::vector<unsigned char> host(n * 4, 0);
  for (unsigned char value : {0x11, 0x5a, 0x7f}) {
    HR_CUDA_CHECK(cudaMemsetAsync(dst.get(), 0, n * 4, compute));
    HR_CUDA_CHECK(cudaMemsetAsync(src.get(), value, n * 4, compute));
    const std::vector<int64_t> counts = {int64_t(n)};
    ASSERT_TRUE(nccl.all_gather(src.get(), dst.get(), counts).is_ok());
    HR_CUDA_CHECK(cudaMemcpyAsync(host.data(), dst.get(), n * 4, cudaMemcpyDeviceToHost, compute));
    HR_CUDA_CHECK(cudaStreamSynchronize(compute));
    EXPECT_EQ(host.front(), value);
    EXPECT_EQ(host[n * 2], value);
    EXPECT_EQ(host.back(), value);
  }
}

#else

TEST(NcclCommunicator, NotInThisBuild) {
  GTEST_SKIP() << "the NCCL communicator is built with both CUDA and MPI; this build has no MPI";
}

#endif

}  // namespace
}  // namespace headroom
