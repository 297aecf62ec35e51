// The CUDA table's is_device_pointer, and dist::StagingCommunicator on GPU memory (the trainer's
// communicator on a CUDA build without NCCL, and on one rank): the same results as the local
// communicator on host copies. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "cuda_test_util.h"
#include "dist/communicator.h"
#include "dist/staging_communicator.h"

namespace headroom {
namespace {

using cudatest::DeviceBuffer;

TEST(CudaStaging, IsDevicePointerTellsDeviceFromHostMemory) {
  HR_CUDA_OPS_OR_SKIP(ops);
  DeviceBuffer<float> device(16);
  std::vector<float> pageable(16);
  float* pinned = nullptr;
  float* managed = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 16 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMallocManaged(&managed, 16 * sizeof(float)), cudaSuccess);
  EXPECT_TRUE(ops->is_device_pointer(device.get()));
  EXPECT_TRUE(ops->is_device_pointer(device.get() + 5));
  EXPECT_TRUE(ops->is_device_pointer(managed));
  EXPECT_FALSE(ops->is_device_pointer(pageable.data()));
  EXPECT_FALSE(ops->is_device_pointer(pinned));
  EXPECT_FALSE(backend::cpu_ops().is_device_pointer(pageable.data()));
  cudaFreeHost(pinned);
  cudaFree(managed);
}

TEST(CudaStaging, OneRankCollectivesOnDeviceMemoryEqualTheLocalOnes) {
  HR_CUDA_OPS_OR_SKIP(ops);
  dist::LocalCommunicator local;
  dist::StagingCommunicator sc(&local, ops);
  std::vector<float> x(1000);
  for (size_t i = 0; i < x.size(); i++) x[i] = float(i) / 3.0f;
  const std::vector<int64_t> counts = {int64_t(x.size())};
  DeviceBuffer<float> send(x), recv(x.size()), gathered(x.size());
  ASSERT_TRUE(sc.all_reduce(send.get(), int64_t(x.size())).is_ok());
  ASSERT_TRUE(sc.reduce_scatter(send.get(), recv.get(), counts).is_ok());
  ASSERT_TRUE(sc.all_gather(recv.get(), gathered.get(), counts).is_ok());
  ASSERT_TRUE(sc.all_gather(gathered.get(), gathered.get(), counts).is_ok());  // in place
  ASSERT_TRUE(sc.broadcast(send.get(), int64_t(x.size()), 0).is_ok());
  EXPECT_EQ(send.download(), x);
  EXPECT_EQ(recv.download(), x);
  EXPECT_EQ(gathered.download(), x);
  // The scatter's send and the two gathers' shards; one rank's all-reduce and broadcast: none.
  EXPECT_EQ(sc.bytes_to_host(), int64_t(3 * x.size() * sizeof(float)));
}

}  // namespace
}  // namespace headroom
