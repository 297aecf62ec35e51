// The CUDA backend's build and runtime facts for `headroom --version` (build_info.h).
#include "backend/cuda/build_info.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/device_memory.h"

#ifndef HEADROOM_CUDA_ARCHS
#define HEADROOM_CUDA_ARCHS "unknown"
#endif

namespace headroom::backend::cuda {
namespace {

// 13000 -> "13.0", 12040 -> "12.4": CUDA's major * 1000 + minor * 10.
std::string cuda_version_words(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

}  // namespace

CudaBuildInfo build_info() {
  CudaBuildInfo b;
  b.toolkit_version = cuda_version_words(CUDART_VERSION);
  b.archs = HEADROOM_CUDA_ARCHS;
  int nccl = 0;
  if (ncclGetVersion(&nccl) == ncclSuccess) {
    // NCCL_VERSION_CODE since 2.9: major * 10000 + minor * 100 + patch.
    b.nccl_version = fmt::format("{}.{}.{}", nccl / 10000, (nccl / 100) % 100, nccl % 100);
  } else {
    b.nccl_version = fmt::format("{}.{}.{} (headers)", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
  }
  int v = 0;
  if (cudaRuntimeGetVersion(&v) == cudaSuccess) b.runtime_version = cuda_version_words(v);
  if (cudaDriverGetVersion(&v) == cudaSuccess && v > 0) b.driver_version = cuda_version_words(v);
  cudaGetLastError();
  b.device_usable = device_available(&b.why_not);
  if (b.device_usable) {
    if (cudaGetDeviceCount(&b.device_count) != cudaSuccess) b.device_count = 0;
    if (Result<int> dev = process_device(); dev.is_ok()) {
      cudaDeviceProp props{};
      if (cudaGetDeviceProperties(&props, *dev) == cudaSuccess) {
        b.device_name =
            fmt::format("{} (device {}, sm_{}{})", props.name, *dev, props.major, props.minor);
      }
    }
    cudaGetLastError();
  }
  return b;
}

}  // namespace headroom::backend::cuda
