// The NCCL communicator across the ranks of `mpirun -np 2` (ctest cuda_nccl_2ranks): every
// collective on device memory against the MPI communicator's result on the same host data, with
// equal and unequal counts. Skips, saying why, outside mpirun or with fewer GPUs than ranks
// (NCCL needs a GPU per rank), so the program exits 0 on a machine without them.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "dist/communicator.h"
#include "dist/nccl/nccl_communicator.h"

namespace headroom {
namespace {

#if defined(HEADROOM_HAVE_NCCL)

template <typename T>
class Dev {
 public:
  explicit Dev(const std::vector<T>& h) : n_(h.size()) {
    HR_CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(n_, 1) * sizeof(T)));
    if (n_) HR_CUDA_CHECK(cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~Dev() { cudaFree(p_); }
  T* get() { return p_; }
  std::vector<T> host() const {
    HR_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> h(n_);
    if (n_) HR_CUDA_CHECK(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

// Rank-dependent data whose sums over 2 ranks are exact in any order (one addition).
std::vector<float> data_of(int rank, size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i++) v[i] = scale * float(int(i % 97) - 48) * (rank + 1) + 0.25f * rank;
  return v;
}

struct World {
  std::unique_ptr<dist::Communicator> mpi, nccl;
};

// The MPI world and the NCCL communicator over it, or why the test cannot run here.
std::string make_world(World* w) {
  if (!dist::launched_by_mpi()) return "not started by mpirun (ctest runs it as cuda_nccl_2ranks)";
  Result<std::unique_ptr<dist::Communicator>> mpi = dist::make_world_communicator();
  if (!mpi.is_ok()) return mpi.status().to_string();
  std::string why;
  int devices = 0;
  if (!backend::cuda::device_available(&why)) {
    why = "no CUDA device: " + why;
  } else if (cudaGetDeviceCount(&devices) == cudaSuccess && devices < (*mpi)->size()) {
    why = std::to_string((*mpi)->size()) + " ranks need " + std::to_string((*mpi)->size()) +
          " GPUs (NCCL needs a GPU per rank); this machine has " + std::to_string(devices);
  }
  // Every rank sees the same machine; agree anyway, so that no rank waits in NCCL's init alone.
  const Status together = dist::agree(**mpi, why.empty() ? Status::ok() : Status::unsupported(why));
  if (!together.is_ok()) return together.message();
  Result<std::unique_ptr<dist::Communicator>> nccl = dist::make_nccl_communicator(**mpi);
  if (!nccl.is_ok()) return "FAIL " + nccl.status().to_string();
  w->mpi = std::move(mpi).value();
  w->nccl = std::move(nccl).value();
  return "";
}

// Made once and never destroyed: MPI is finalized at exit before static destructors would run,
// and tearing NCCL down while the other rank may already be gone buys a test nothing.
World& world(std::string* why) {
  static World* w = new World;
  static std::string reason = make_world(w);
  *why = reason;
  return *w;
}

#define HR_WORLD_OR_SKIP(w)                                           \
  std::string hr_why_;                                                \
  World& w = world(&hr_why_);                                         \
  ASSERT_EQ(hr_why_.rfind("FAIL ", 0), std::string::npos) << hr_why_; \
  if (!w.nccl) GTEST_SKIP() << hr_why_

TEST(NcclTwoRanks, AllReducesMatchMpi) {
  HR_WORLD_OR_SKIP(w);
  const int rank = w.mpi->rank();
  for (size_t n : {size_t(1), size_t(4097), size_t(5) << 20}) {
    std::vector<float> f = data_of(rank, n, 0.5f);
    Dev<float> df(f);
    ASSERT_TRUE(w.nccl->all_reduce(df.get(), int64_t(n)).is_ok());
    ASSERT_TRUE(w.mpi->all_reduce(f.data(), int64_t(n)).is_ok());
    EXPECT_EQ(df.host(), f);
    std::vector<double> d(n);
    for (size_t i = 0; i < n; i++) d[i] = double(f[i]) / 3.0 + rank;
    Dev<double> dd(d);
    ASSERT_TRUE(w.nccl->all_reduce(dd.get(), int64_t(n)).is_ok());
    ASSERT_TRUE(w.mpi->all_reduce(d.data(), int64_t(n)).is_ok());
    EXPECT_EQ(dd.host(), d);
    std::vector<int64_t> m(n);
    for (size_t i = 0; i < n; i++) m[i] = int64_t((i * 7919 + size_t(rank) * 104729) % 65537);
    Dev<int64_t> dm(m);
    ASSERT_TRUE(w.nccl->all_reduce_min(dm.get(), int64_t(n)).is_ok());
    ASSERT_TRUE(w.mpi->all_reduce_min(m.data(), int64_t(n)).is_ok());
    EXPECT_EQ(dm.host(), m);
  }
}

// Equal counts (ncclReduceScatter / ncclAllGather) and unequal ones (the grouped path), with a
// rank holding nothing among them.
TEST(NcclTwoRanks, ReduceScatterAndAllGatherMatchMpi) {
  HR_WORLD_OR_SKIP(w);
  const int rank = w.mpi->rank();
  const std::vector<std::vector<int64_t>> cases = {
      {1000, 1000}, {1001, 999}, {7, 0}, {3 << 20, (3 << 20) - 16}};
  for (const std::vector<int64_t>& counts : cases) {
    const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0));
    const int64_t mine = counts[size_t(rank)];
    const int64_t displ = rank == 0 ? 0 : counts[0];
    std::vector<float> send = data_of(rank, size_t(total), 0.125f);
    std::vector<float> recv(size_t(std::max<int64_t>(mine, 1)), -1.0f);
    Dev<float> dsend(send), drecv(recv);
    ASSERT_TRUE(w.nccl->reduce_scatter(dsend.get(), drecv.get(), counts).is_ok());
    ASSERT_TRUE(w.mpi->reduce_scatter(send.data(), recv.data(), counts).is_ok());
    EXPECT_EQ(drecv.host(), recv) << counts[0] << "," << counts[1];

    std::vector<float> gathered(size_t(total), 9.0f);
    std::vector<float> mine_data = data_of(rank + 5, size_t(mine), 1.0f);
    Dev<float> dmine(mine_data), dgathered(gathered);
    ASSERT_TRUE(w.nccl->all_gather(dmine.get(), dgathered.get(), counts).is_ok());
    ASSERT_TRUE(w.mpi->all_gather(mine_data.data(), gathered.data(), counts).is_ok());
    EXPECT_EQ(dgathered.host(), gathered) << counts[0] << "," << counts[1];
    // In place: this rank's segment already in recv.
    std::vector<float> inplace(size_t(total), 0.0f);
    std::copy(mine_data.begin(), mine_data.end(), inplace.begin() + displ);
    Dev<float> dinplace(inplace);
    ASSERT_TRUE(w.nccl->all_gather(dinplace.get() + displ, dinplace.get(), counts).is_ok());
    EXPECT_EQ(dinplace.host(), gathered) << counts[0] << "," << counts[1];
  }
}

TEST(NcclTwoRanks, BroadcastBarrierAndAgree) {
  HR_WORLD_OR_SKIP(w);
  const int rank = w.mpi->rank();
  for (int root : {0, 1}) {
    std::vector<float> v = data_of(rank, 12345, 2.0f), expect = data_of(root, 12345, 2.0f);
    Dev<float> dv(v);
    ASSERT_TRUE(w.nccl->broadcast(dv.get(), 12345, root).is_ok());
    EXPECT_EQ(dv.host(), expect);
  }
  ASSERT_TRUE(w.nccl->barrier().is_ok());
  // agree() over NCCL (host data through the staging buffer): rank 1's failure reaches both.
  const Status local =
      rank == 1 ? Status::out_of_memory("micro-batch 8 does not fit") : Status::ok();
  const Status agreed = dist::agree(*w.nccl, local);
  EXPECT_EQ(agreed.code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(agreed.message(), "rank 1: micro-batch 8 does not fit");
}

#else

TEST(NcclTwoRanks, NotInThisBuild) {
  GTEST_SKIP() << "the NCCL communicator is built with both CUDA and MPI";
}

#endif

}  // namespace
}  // namespace headroom
