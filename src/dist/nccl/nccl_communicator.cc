// The NCCL communicator (nccl_communicator.h): collectives queued on the op table's comm stream,
// ordered against the compute stream by events, bootstrapped over MPI (or any communicator).
#include "dist/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_ops_impl.h"
#include "core/check.h"

namespace headroom::dist {
namespace {

// Host data (agree()'s values) goes through this much device memory at a time.
constexpr size_t kHostStagingBytes = size_t(1) << 20;

// The calling thread's current device set to the communicator's for the call (the runtime's
// current device is per thread; the communication thread's may be another).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    HR_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) HR_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

Status nccl_status(const char* call, ncclResult_t r, ncclComm_t comm) {
  std::string detail;
  if (const char* last = ncclGetLastError(comm); last != nullptr && *last != '\0') {
    detail = std::string("; ") + last;
  }
  return Status::internal(fmt::format("{} failed: {}{}", call, ncclGetErrorString(r), detail));
}

#define HR_NCCL(call)                                                            \
  do {                                                                           \
    const ncclResult_t hr_nccl_r_ = (call);                                      \
    if (hr_nccl_r_ != ncclSuccess) return nccl_status(#call, hr_nccl_r_, comm_); \
  } while (0)

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, const backend::cuda::Context& ctx)
      : comm_(comm),
        rank_(rank),
        size_(size),
        device_(ctx.device),
        compute_(ctx.compute),
        stream_(ctx.comm) {
    DeviceGuard guard(device_);
    HR_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    HR_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    HR_CUDA_CHECK(cudaMalloc(&staging_, kHostStagingBytes));
  }
  ~NcclCommunicator() override {
    // Destroyed before exit (the usual case: the trainer owns it): wait for what is queued, then
    // release. ncclCommDestroy waits for the communicator's pending operations itself.
    DeviceGuard guard(device_);
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
    cudaFree(staging_);
    cudaEventDestroy(ready_);
    cudaEventDestroy(done_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "nccl"; }
  bool takes_device_memory() const override { return true; }

  Status all_reduce(float* data, int64_t n) override {
    return reduce_in_place(data, n, ncclFloat, sizeof(float), ncclSum, "all_reduce");
  }
  Status all_reduce(double* data, int64_t n) override {
    return reduce_in_place(data, n, ncclDouble, sizeof(double), ncclSum, "all_reduce");
  }
  Status all_reduce_min(int64_t* data, int64_t n) override {
    return reduce_in_place(data, n, ncclInt64, sizeof(int64_t), ncclMin, "all_reduce_min");
  }

  Status reduce_scatter(const float* send, float* recv, std::span<const int64_t> counts) override {
    std::vector<int64_t> displs;
    const int64_t total = check_counts(counts, size_, &displs);
    const int64_t mine = counts[size_t(rank_)];
    HR_CHECK_MSG(mine == 0 || total == 0 || recv + mine <= send || send + total <= recv,
                 "reduce_scatter: recv overlaps send");
    if (total == 0) return Status::ok();
    std::lock_guard<std::mutex> lock(mu_);
    DeviceGuard guard(device_);
    HR_RETURN_IF_ERROR(check_device_pointer(send, "reduce_scatter's send"));
    if (mine > 0) HR_RETURN_IF_ERROR(check_device_pointer(recv, "reduce_scatter's recv"));
    begin();
    if (equal(counts)) {
      HR_NCCL(ncclReduceScatter(send, recv, size_t(mine), ncclFloat, ncclSum, comm_, stream_));
    } else {
      // One reduce per segment, rooted at its owner, in one group (one launch). recvbuff is
      // used only on the root; NCCL takes null on the others.
      HR_NCCL(ncclGroupStart());
      for (int r = 0; r < size_; ++r) {
        if (counts[size_t(r)] == 0) continue;
        const ncclResult_t res =
            ncclReduce(send + displs[size_t(r)], r == rank_ ? recv : nullptr,
                       size_t(counts[size_t(r)]), ncclFloat, ncclSum, r, comm_, stream_);
        if (res != ncclSuccess) {
          ncclGroupEnd();
          return nccl_status("ncclReduce", res, comm_);
        }
      }
      HR_NCCL(ncclGroupEnd());
    }
    end();
    return Status::ok();
  }

  Status all_gather(const float* send, float* recv, std::span<const int64_t> counts) override {
    std::vector<int64_t> displs;
    const int64_t total = check_counts(counts, size_, &displs);
    const int64_t mine = counts[size_t(rank_)];
    if (total == 0) return Status::ok();
    std::lock_guard<std::mutex> lock(mu_);
    DeviceGuard guard(device_);
    HR_RETURN_IF_ERROR(check_device_pointer(recv, "all_gather's recv"));
    if (mine > 0) HR_RETURN_IF_ERROR(check_device_pointer(send, "all_gather's send"));
    begin();
    if (equal(counts)) {
      // In place when send == recv + rank * count: NCCL's own in-place convention.
      HR_NCCL(ncclAllGather(send, recv, size_t(mine), ncclFloat, comm_, stream_));
    } else {
      // One broadcast per segment from its owner, in one group; the owner's is in place when
      // send already sits at its segment.
      HR_NCCL(ncclGroupStart());
      for (int r = 0; r < size_; ++r) {
        if (counts[size_t(r)] == 0) continue;
        float* seg = recv + displs[size_t(r)];
        const ncclResult_t res = ncclBroadcast(
            r == rank_ ? send : seg, seg, size_t(counts[size_t(r)]), ncclFloat, r, comm_, stream_);
        if (res != ncclSuccess) {
          ncclGroupEnd();
          return nccl_status("ncclBroadcast", res, comm_);
        }
      }
      HR_NCCL(ncclGroupEnd());
    }
    end();
    return Status::ok();
  }

  Status broadcast(void* data, int64_t bytes, int root) override {
    HR_CHECK(bytes >= 0 && root >= 0 && root < size_);
    if (bytes == 0) return Status::ok();
    std::lock_guard<std::mutex> lock(mu_);
    DeviceGuard guard(device_);
    char* p = static_cast<char*>(data);
    if (!is_host(p)) {
      HR_RETURN_IF_ERROR(check_device_pointer(p, "broadcast's data"));
      begin();
      HR_NCCL(ncclBroadcast(p, p, size_t(bytes), ncclUint8, root, comm_, stream_));
      end();
      return Status::ok();
    }
    return staged(p, bytes, 1, [&](void* dev, size_t count) {
      return ncclBroadcast(dev, dev, count, ncclUint8, root, comm_, stream_);
    });
  }

  uint64_t device_bytes_held() const override { return device_bytes_; }

  // The first collectives, which make NCCL connect its channels and allocate their buffers: a
  // 1 MiB all-reduce on the staging buffer (ring, Simple protocol) and the barrier's one-float
  // one (LL), waited for on the host.
  Status warm_up() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      DeviceGuard guard(device_);
      HR_CUDA_CHECK(cudaMemsetAsync(staging_, 0, kHostStagingBytes, stream_));
      begin();
      HR_NCCL(ncclAllReduce(staging_, staging_, kHostStagingBytes / sizeof(float), ncclFloat,
                            ncclSum, comm_, stream_));
      end();
      HR_RETURN_IF_ERROR(wait());
    }
    return barrier();
  }
  void set_device_bytes(uint64_t b) { device_bytes_ = b; }

  Status barrier() override {
    std::lock_guard<std::mutex> lock(mu_);
    DeviceGuard guard(device_);
    // A one-element all-reduce on the staging buffer, waited for on the host: no rank leaves
    // before every rank has entered.
    begin();
    HR_NCCL(ncclAllReduce(staging_, staging_, 1, ncclFloat, ncclSum, comm_, stream_));
    end();
    return wait();
  }

 private:
  // The event pair around a collective on device memory: the comm stream waits for the compute
  // work queued so far, and the compute stream for the collective.
  void begin() {
    HR_CUDA_CHECK(cudaEventRecord(ready_, compute_));
    HR_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
  }
  void end() {
    HR_CUDA_CHECK(cudaEventRecord(done_, stream_));
    HR_CUDA_CHECK(cudaStreamWaitEvent(compute_, done_, 0));
  }
  // Waits for the comm stream on the host and reports an asynchronous NCCL failure.
  Status wait() {
    HR_CUDA_CHECK(cudaStreamSynchronize(stream_));
    ncclResult_t async = ncclSuccess;
    HR_NCCL(ncclCommGetAsyncError(comm_, &async));
    if (async != ncclSuccess) return nccl_status("NCCL (asynchronous)", async, comm_);
    return Status::ok();
  }

  Status reduce_in_place(void* data, int64_t n, ncclDataType_t type, size_t elem, ncclRedOp_t op,
                         const char* what) {
    HR_CHECK(n >= 0);
    if (n == 0) return Status::ok();
    std::lock_guard<std::mutex> lock(mu_);
    DeviceGuard guard(device_);
    if (!is_host(data)) {
      HR_RETURN_IF_ERROR(check_device_pointer(data, what));
      begin();
      HR_NCCL(ncclAllReduce(data, data, size_t(n), type, op, comm_, stream_));
      end();
      return Status::ok();
    }
    return staged(data, n, elem, [&](void* dev, size_t count) {
      return ncclAllReduce(dev, dev, count, type, op, comm_, stream_);
    });
  }

  // Host data through the staging buffer, a piece at a time (the operations split by element),
  // each piece waited for: agree()'s few bytes, never a training buffer.
  template <typename F>
  Status staged(void* data, int64_t n, size_t elem, F&& collective) {
    char* host = static_cast<char*>(data);
    const int64_t per_piece = int64_t(kHostStagingBytes / elem);
    for (int64_t off = 0; off < n; off += per_piece) {
      const int64_t count = std::min(per_piece, n - off);
      const size_t bytes = size_t(count) * elem;
      begin();
      HR_CUDA_CHECK(cudaMemcpyAsync(staging_, host + size_t(off) * elem, bytes,
                                    cudaMemcpyHostToDevice, stream_));
      if (ncclResult_t r = collective(staging_, size_t(count)); r != ncclSuccess) {
        return nccl_status("NCCL collective on staged host data", r, comm_);
      }
      HR_CUDA_CHECK(cudaMemcpyAsync(host + size_t(off) * elem, staging_, bytes,
                                    cudaMemcpyDeviceToHost, stream_));
      end();
      HR_RETURN_IF_ERROR(wait());
    }
    return Status::ok();
  }

  // Host memory, pinned or not: NCCL's kernels need device (or managed) memory.
  static bool is_host(const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();
      return true;  // an unknown pointer: not the runtime's, so host memory
    }
    return a.type == cudaMemoryTypeHost || a.type == cudaMemoryTypeUnregistered;
  }
  Status check_device_pointer(const void* p, const char* what) const {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();
      return Status::invalid_argument(
          fmt::format("NCCL communicator: {} ({}) is not memory the CUDA runtime knows", what, p));
    }
    if (a.type == cudaMemoryTypeManaged) return Status::ok();
    if (a.type != cudaMemoryTypeDevice) {
      return Status::invalid_argument(fmt::format(
          "NCCL communicator: {} ({}) is host memory; this collective needs device memory "
          "(only all_reduce, all_reduce_min and broadcast stage host data)",
          what, p));
    }
    if (a.device != device_) {
      return Status::invalid_argument(
          fmt::format("NCCL communicator: {} is on device {}, the communicator on device {}", what,
                      a.device, device_));
    }
    return Status::ok();
  }

  static bool equal(std::span<const int64_t> counts) {
    return std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; });
  }

  ncclComm_t comm_;
  int rank_, size_;
  int device_;
  cudaStream_t compute_, stream_;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  uint64_t device_bytes_ = 0;  // measured by make_nccl_communicator
  void* staging_ = nullptr;
  std::mutex mu_;  // one collective at a time (Communicator's thread-safety contract)
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_nccl_communicator(Communicator& bootstrap) {
  std::string why;
  const backend::Ops* ops = backend::cuda::cuda_ops(&why);
  // Every rank learns whether every rank has a device before any waits in NCCL's init.
  Status local = ops != nullptr ? Status::ok()
                                : Status::unsupported("NCCL communicator: no CUDA device: " + why);
  ncclUniqueId id{};
  if (local.is_ok() && bootstrap.rank() == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      local = Status::internal(std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(r));
    }
  }
  HR_RETURN_IF_ERROR(agree(bootstrap, local));
  HR_RETURN_IF_ERROR(bootstrap.broadcast(&id, int64_t(sizeof(id)), 0));
  const auto& ctx = static_cast<const backend::cuda::CudaOps*>(ops)->context();
  DeviceGuard guard(ctx.device);
  // What NCCL takes of the device (its channels' buffers, our staging buffer): the free memory
  // before it joins and after its first collectives connected it.
  size_t free_before = 0, free_after = 0, total_bytes = 0;
  HR_CUDA_CHECK(cudaMemGetInfo(&free_before, &total_bytes));
  ncclComm_t comm = nullptr;
  if (ncclResult_t r = ncclCommInitRank(&comm, bootstrap.size(), id, bootstrap.rank());
      r != ncclSuccess) {
    const char* last = ncclGetLastError(nullptr);
    return Status::internal(fmt::format(
        "ncclCommInitRank (rank {} of {}, device {}) failed: {}{}{} (NCCL needs one GPU per rank)",
        bootstrap.rank(), bootstrap.size(), ctx.device, ncclGetErrorString(r),
        last && *last ? "; " : "", last ? last : ""));
  }
  std::unique_ptr<NcclCommunicator> c(
      new NcclCommunicator(comm, bootstrap.rank(), bootstrap.size(), ctx));
  HR_RETURN_IF_ERROR(c->warm_up());
  HR_CUDA_CHECK(cudaMemGetInfo(&free_after, &total_bytes));
  c->set_device_bytes(free_before > free_after ? uint64_t(free_before - free_after) : 0);
  return std::unique_ptr<Communicator>(std::move(c));
}

}  // namespace headroom::dist
