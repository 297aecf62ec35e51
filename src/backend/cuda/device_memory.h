// The CUDA memory resources (leaves under memory/'s adaptors), the elastic budget and the CUDA
// context's own bytes. Plain types only, no CUDA headers, so that train/ and cli/ can use them.
// Compiled only with -DHEADROOM_CUDA=ON (HEADROOM_HAVE_CUDA). See docs/notes/cuda.md,
// "Infrastructure".
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "memory/resource.h"

namespace headroom::backend::cuda {

// The alignment cudaMalloc guarantees (the runtime documents "at least 256 bytes"). The device
// and managed leaves serve any power-of-two alignment: a larger one (the arenas ask for 4096) is
// taken from the runtime's pointer when it already has it (large blocks start on the driver's 2
// MiB pages), else from a block padded by alignment - 256 bytes whose raw pointer is kept.
inline constexpr size_t kDeviceAlignment = 256;

namespace detail {
// The raw pointers of over-aligned blocks, by the aligned pointer handed out. Thread safe.
class AlignedBlocks {
 public:
  void remember(void* aligned, void* raw);
  // The raw pointer of `aligned`, or `aligned` itself when it was not padded.
  void* forget(void* aligned);

 private:
  std::mutex mu_;
  std::unordered_map<void*, void*> raw_;
};
}  // namespace detail

// The device this process uses: local_rank % device_count, with the local rank from the MPI
// launcher (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID; 0 when not launched by
// one), so that the ranks of one node take different GPUs (CUDA_VISIBLE_DEVICES narrows the
// choice as usual). Unsupported when no device is usable, with the runtime's reason.
Result<int> process_device();

// The device leaf: cudaMalloc / cudaFree on `device`. An allocation the driver refuses for lack of
// memory returns OutOfMemory naming the bytes asked for and the device's free and total memory
// (cudaMemGetInfo), and clears the runtime's error, so the caller can recover (re-plan) and the
// next CUDA call does not see a stale error. Thread safe (the runtime is); the allocation is made
// on `device` whatever the calling thread's current device, which is restored afterwards.
// Note: cudaFree synchronizes the device; the arenas free only at the end of a run.
class CudaDeviceResource final : public memory::MemoryResource {
 public:
  // Unsupported when no device is usable; InvalidArgument for a device number out of range.
  static Result<std::unique_ptr<CudaDeviceResource>> create(int device);
  int device() const { return device_; }

 private:
  explicit CudaDeviceResource(int device) : device_(device) {}
  Result<void*> do_allocate(size_t bytes, size_t alignment, memory::Category category) override;
  void do_deallocate(void* p, size_t bytes, size_t alignment, memory::Category category) override;

  int device_;
  detail::AlignedBlocks padded_;
};

// Page-locked host memory (cudaHostAlloc, portable across devices): the staging buffers of the
// data loader and the offload tier on a GPU, which copies on the h2d/d2h streams need to run
// asynchronously. OutOfMemory when the host refuses to pin that much (RLIMIT_MEMLOCK in a
// container, or the host's memory), with the bytes asked for.
class PinnedHostResource final : public memory::MemoryResource {
 public:
  static Result<std::unique_ptr<PinnedHostResource>> create();

 private:
  PinnedHostResource() = default;
  Result<void*> do_allocate(size_t bytes, size_t alignment, memory::Category category) override;
  void do_deallocate(void* p, size_t bytes, size_t alignment, memory::Category category) override;
};

// Managed (unified) memory, cudaMallocManaged: an explicit option, never the default. It never
// oversubscribes: the resource reads the device's free memory when it is created, and refuses
// with OutOfMemory any allocation that would take the managed bytes it holds beyond that figure
// (each allocation counted with its alignment padding, rounded up to 2 MiB, the granularity of
// managed memory on the device, so that the count bounds what the pages take). Paging managed
// memory in and out of the device inside a step would make a step's time depend on the driver's
// migrations; the planner prices none of that, so the resource refuses instead.
class ManagedResource final : public memory::MemoryResource {
 public:
  // Unsupported when the device has no managed memory (cudaDevAttrManagedMemory).
  static Result<std::unique_ptr<ManagedResource>> create(int device);
  int device() const { return device_; }
  uint64_t capacity() const { return capacity_; }  // the device's free bytes at creation
  uint64_t in_use() const { return in_use_.load(); }

  static constexpr uint64_t kGranularity = uint64_t(2) << 20;

 private:
  ManagedResource(int device, uint64_t capacity) : device_(device), capacity_(capacity) {}
  Result<void*> do_allocate(size_t bytes, size_t alignment, memory::Category category) override;
  void do_deallocate(void* p, size_t bytes, size_t alignment, memory::Category category) override;

  int device_;
  uint64_t capacity_;
  std::atomic<uint64_t> in_use_{0};
  detail::AlignedBlocks padded_;
};

// The elastic budget (read before each step): cudaMemGetInfo's free bytes on `device` less
// `margin` (0 when free is below the margin). Free memory includes what other processes on the
// GPU leave, which is the point: the budget shrinks when a neighbour grows.
Result<uint64_t> device_budget_bytes(uint64_t margin, int device);

// The CUDA context's own device bytes on the process's device: total - free (cudaMemGetInfo)
// right after the context is created (cudaFree(0)) and before any allocation of ours. Measured
// once per process, by the first of: this call, the op table's creation (cuda_ops), a
// CudaDeviceResource's or ManagedResource's creation; so every path that allocates on the device
// measures first. An upper bound on a shared GPU (other processes' memory counts as used), and a
// lower bound of what the context grows to (lazy module loading, CUDA_MODULE_LOADING=LAZY, the
// default since CUDA 12.2, loads kernels on their first launch). Unsupported without a device.
Result<uint64_t> context_bytes();

}  // namespace headroom::backend::cuda
