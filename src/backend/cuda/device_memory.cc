// The CUDA leaves (device, pinned host, managed), the elastic budget and the context's bytes.
// The runtime's out-of-memory is a Status here (a planned control path: the trainer re-plans on
// it); every other runtime failure is a broken device and aborts (cuda_check.h).
#include "backend/cuda/device_memory.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "core/units.h"

namespace headroom::backend::cuda {
namespace {

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Runs the calls of its scope on `device` and restores the calling thread's current device: the
// runtime's current device is per thread, and a resource may be called from the loader's or the
// communication thread.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    // A failed query (the runtime unloading at exit) leaves the device alone: the call that
    // follows reports the runtime's state itself.
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    if (previous_ != device) HR_CUDA_CHECK(cudaSetDevice(device));
    switched_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// "12.3 GiB free of 139.8 GiB on device 0 (NVIDIA H200)", read now.
std::string device_memory_words(int device) {
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    cudaGetLastError();
    return fmt::format("device {} (free memory unknown)", device);
  }
  cudaDeviceProp props{};
  const bool named = cudaGetDeviceProperties(&props, device) == cudaSuccess;
  if (!named) cudaGetLastError();
  return fmt::format("{} free of {} on device {}{}", format_bytes(free_b), format_bytes(total_b),
                     device, named ? fmt::format(" ({})", props.name) : std::string());
}

Status no_device_status() {
  std::string why;
  if (device_available(&why)) return Status::ok();
  return Status::unsupported("no CUDA device can be used: " + why);
}

Status check_device_number(int device) {
  HR_RETURN_IF_ERROR(no_device_status());
  int count = 0;
  HR_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count) {
    return Status::invalid_argument(
        fmt::format("CUDA device {} does not exist: this process sees {} device{} (0-{}; "
                    "CUDA_VISIBLE_DEVICES narrows them)",
                    device, count, count == 1 ? "" : "s", count - 1));
  }
  return Status::ok();
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (end != nullptr && *end == '\0' && x >= 0 && x < (1 << 20)) ? int(x) : fallback;
}

int launcher_local_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    const int r = env_int(var, -1);
    if (r >= 0) return r;
  }
  return 0;
}

}  // namespace

Result<int> process_device() {
  HR_RETURN_IF_ERROR(no_device_status());
  int count = 0;
  HR_CUDA_CHECK(cudaGetDeviceCount(&count));
  return launcher_local_rank() % count;
}

// ---- the context's bytes ------------------------------------------------------------------

Result<uint64_t> context_bytes() {
  // Measured once: the first caller creates the context (cudaFree(0) is the runtime's idiom for
  // "initialise now") on the process's device and reads total - free before anything of ours is
  // allocated; every allocating path of this backend calls this first (see the header).
  static std::once_flag once;
  static Status status;
  static uint64_t bytes = 0;
  std::call_once(once, [] {
    Result<int> dev = process_device();
    if (!dev.is_ok()) {
      status = dev.status();
      return;
    }
    HR_CUDA_CHECK(cudaSetDevice(*dev));
    HR_CUDA_CHECK(cudaFree(nullptr));
    size_t free_b = 0, total_b = 0;
    HR_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    bytes = uint64_t(total_b - free_b);
  });
  if (!status.is_ok()) return status;
  return bytes;
}

// ---- CudaDeviceResource -------------------------------------------------------------------

Result<std::unique_ptr<CudaDeviceResource>> CudaDeviceResource::create(int device) {
  HR_RETURN_IF_ERROR(check_device_number(device));
  HR_RETURN_IF_ERROR(context_bytes().status());
  return std::unique_ptr<CudaDeviceResource>(new CudaDeviceResource(device));
}

namespace {

bool power_of_two(size_t a) { return a != 0 && (a & (a - 1)) == 0; }
bool aligned_to(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// What a leaf's allocation asks of the runtime: `bytes` (one pointer's worth for 0: the
// interface promises a unique non-null pointer) and, when the runtime's pointer lacks the
// alignment, that plus the padding that lets an aligned pointer fit inside.
size_t request_bytes(size_t bytes) { return bytes == 0 ? sizeof(void*) : bytes; }
size_t padding_for(size_t alignment) {
  return alignment > kDeviceAlignment ? alignment - kDeviceAlignment : 0;
}

// Allocates through `alloc` (cudaMalloc or cudaMallocManaged) with `alignment`: the runtime's
// pointer when it is aligned, else a padded block, remembered in `padded`. The runtime's error on
// failure (the caller turns out-of-memory into a Status).
template <typename Alloc>
cudaError_t allocate_aligned(Alloc&& alloc, size_t bytes, size_t alignment,
                             detail::AlignedBlocks* padded, void** out) {
  void* p = nullptr;
  cudaError_t err = alloc(&p, bytes);
  if (err != cudaSuccess || aligned_to(p, alignment)) {
    *out = p;
    return err;
  }
  HR_CUDA_CHECK(cudaFree(p));
  if (bytes > SIZE_MAX - padding_for(alignment)) return cudaErrorMemoryAllocation;
  err = alloc(&p, bytes + padding_for(alignment));
  if (err != cudaSuccess) return err;
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  void* a = reinterpret_cast<void*>((u + alignment - 1) / alignment * alignment);
  padded->remember(a, p);
  *out = a;
  return cudaSuccess;
}

}  // namespace

void detail::AlignedBlocks::remember(void* aligned, void* raw) {
  std::lock_guard<std::mutex> lock(mu_);
  raw_[aligned] = raw;
}

void* detail::AlignedBlocks::forget(void* aligned) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = raw_.find(aligned);
  if (it == raw_.end()) return aligned;
  void* raw = it->second;
  raw_.erase(it);
  return raw;
}

Result<void*> CudaDeviceResource::do_allocate(size_t bytes, size_t alignment,
                                              memory::Category category) {
  if (!power_of_two(alignment)) {
    return Status::invalid_argument(
        fmt::format("device allocation of {} for {}: alignment {} is not a power of two",
                    format_bytes(bytes), memory::category_name(category), alignment));
  }
  DeviceGuard guard(device_);
  void* p = nullptr;
  const cudaError_t err = allocate_aligned([](void** q, size_t n) { return cudaMalloc(q, n); },
                                           request_bytes(bytes), alignment, &padded_, &p);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear it: the caller recovers, and the next call must not see it
    return Status::out_of_memory(fmt::format(
        "cudaMalloc of {} for {} failed: {} (lower the micro-batch or --device-memory, "
        "or let the planner choose: --batch auto)",
        format_bytes(bytes), memory::category_name(category), device_memory_words(device_)));
  }
  HR_CUDA_CHECK(err);
  return p;
}

void CudaDeviceResource::do_deallocate(void* p, size_t, size_t, memory::Category) {
  if (p == nullptr) return;
  DeviceGuard guard(device_);
  const cudaError_t err = cudaFree(padded_.forget(p));
  // At process exit the runtime may unload before a static owner frees: nothing to release.
  if (err == cudaErrorCudartUnloading) return;
  HR_CUDA_CHECK(err);
}

// ---- PinnedHostResource -------------------------------------------------------------------

Result<std::unique_ptr<PinnedHostResource>> PinnedHostResource::create() {
  HR_RETURN_IF_ERROR(no_device_status());
  HR_RETURN_IF_ERROR(context_bytes().status());
  return std::unique_ptr<PinnedHostResource>(new PinnedHostResource());
}

Result<void*> PinnedHostResource::do_allocate(size_t bytes, size_t alignment,
                                              memory::Category category) {
  // cudaHostAlloc returns page-aligned memory (it maps whole pages to pin them).
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > 4096) {
    return Status::invalid_argument(fmt::format(
        "pinned host allocation of {} for {}: alignment {} is not a power of two up to 4096 "
        "(the page cudaHostAlloc aligns to)",
        format_bytes(bytes), memory::category_name(category), alignment));
  }
  void* p = nullptr;
  const cudaError_t err =
      cudaHostAlloc(&p, bytes == 0 ? sizeof(void*) : bytes, cudaHostAllocPortable);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return Status::out_of_memory(fmt::format(
        "cudaHostAlloc (pinned host memory) of {} for {} failed: the host refused to pin that "
        "much (its memory, or the locked-memory limit: `ulimit -l`); lower --offload-memory",
        format_bytes(bytes), memory::category_name(category)));
  }
  HR_CUDA_CHECK(err);
  return p;
}

void PinnedHostResource::do_deallocate(void* p, size_t, size_t, memory::Category) {
  if (p == nullptr) return;
  const cudaError_t err = cudaFreeHost(p);
  if (err == cudaErrorCudartUnloading) return;
  HR_CUDA_CHECK(err);
}

// ---- ManagedResource ----------------------------------------------------------------------

Result<std::unique_ptr<ManagedResource>> ManagedResource::create(int device) {
  HR_RETURN_IF_ERROR(check_device_number(device));
  HR_RETURN_IF_ERROR(context_bytes().status());
  int managed = 0;
  HR_CUDA_CHECK(cudaDeviceGetAttribute(&managed, cudaDevAttrManagedMemory, device));
  if (!managed) {
    return Status::unsupported(
        fmt::format("CUDA device {} has no managed memory (cudaDevAttrManagedMemory is 0); use "
                    "the device resource",
                    device));
  }
  DeviceGuard guard(device);
  size_t free_b = 0, total_b = 0;
  HR_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return std::unique_ptr<ManagedResource>(new ManagedResource(device, uint64_t(free_b)));
}

// The bytes a managed allocation is counted as: with the padding an over-aligned one may take,
// in whole granules. The same on allocation and deallocation (a function of the request only).
static uint64_t managed_counted(size_t bytes, size_t alignment) {
  return round_up(uint64_t(request_bytes(bytes)) + padding_for(alignment),
                  ManagedResource::kGranularity);
}

Result<void*> ManagedResource::do_allocate(size_t bytes, size_t alignment,
                                           memory::Category category) {
  if (!power_of_two(alignment)) {
    return Status::invalid_argument(
        fmt::format("managed allocation of {} for {}: alignment {} is not a power of two",
                    format_bytes(bytes), memory::category_name(category), alignment));
  }
  const uint64_t counted = managed_counted(bytes, alignment);
  // Reserve first, so that two threads cannot both pass the check.
  uint64_t used = in_use_.load();
  do {
    if (used + counted > capacity_) {
      return Status::out_of_memory(fmt::format(
          "managed allocation of {} for {} refused: it would take managed memory to {}, beyond "
          "the {} device {} had free when the resource was created (managed memory never "
          "oversubscribes the device here; lower the micro-batch or use the device resource)",
          format_bytes(bytes), memory::category_name(category), format_bytes(used + counted),
          format_bytes(capacity_), device_));
    }
  } while (!in_use_.compare_exchange_weak(used, used + counted));
  DeviceGuard guard(device_);
  void* p = nullptr;
  const cudaError_t err = allocate_aligned(
      [](void** q, size_t n) { return cudaMallocManaged(q, n, cudaMemAttachGlobal); },
      request_bytes(bytes), alignment, &padded_, &p);
  if (err != cudaSuccess) in_use_.fetch_sub(counted);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return Status::out_of_memory(fmt::format("cudaMallocManaged of {} for {} failed: {}",
                                             format_bytes(bytes), memory::category_name(category),
                                             device_memory_words(device_)));
  }
  HR_CUDA_CHECK(err);
  return p;
}

void ManagedResource::do_deallocate(void* p, size_t bytes, size_t alignment, memory::Category) {
  if (p == nullptr) return;
  DeviceGuard guard(device_);
  const cudaError_t err = cudaFree(padded_.forget(p));
  if (err == cudaErrorCudartUnloading) return;
  HR_CUDA_CHECK(err);
  in_use_.fetch_sub(managed_counted(bytes, alignment));
}

// ---- the elastic budget -------------------------------------------------------------------

Result<uint64_t> device_budget_bytes(uint64_t margin, int device) {
  HR_RETURN_IF_ERROR(check_device_number(device));
  DeviceGuard guard(device);
  size_t free_b = 0, total_b = 0;
  HR_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return uint64_t(free_b) > margin ? uint64_t(free_b) - margin : 0;
}

}  // namespace headroom::backend::cuda
