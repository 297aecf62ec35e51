// The backend's fixed device bytes (fixed_bytes.h): the CUDA backend's own figures when it is
// built in, the same constants when it is not.
#include "plan/fixed_bytes.h"

#include <fmt/format.h>

#include <cstdlib>
#include <string>

#include "core/units.h"
#if defined(HEADROOM_HAVE_CUDA)
#include "backend/cuda/cuda_ops.h"
#endif

namespace headroom::plan {

BackendFixedBytes cuda_fixed_bytes(uint64_t context, std::string source) {
  BackendFixedBytes f;
  f.context = context;
  f.context_source = std::move(source);
#if defined(HEADROOM_HAVE_CUDA)
  const backend::cuda::FixedDeviceBytes b = backend::cuda::fixed_device_bytes();
  f.cublaslt_workspace = b.cublaslt_workspace;
  f.op_workspace = b.op_workspace;
#else
  f.cublaslt_workspace = kCudaCublasLtWorkspaceBytes;
  f.op_workspace = kCudaOpWorkspaceBytes;
#endif
  return f;
}

BackendFixedBytes with_collective_buffers(BackendFixedBytes f) {
  constexpr uint64_t kChannels = 16, kConnectionsPerChannel = 2;
  constexpr uint64_t kLl128 = uint64_t(4792320);  // 120 elements x 640 threads x 8 steps x 8 B
  constexpr uint64_t kLl = uint64_t(512) << 10;
  uint64_t simple = uint64_t(4) << 20;
  std::string source = "estimate: 16 channels x 2 connections x NCCL's default buffers";
  if (const char* env = std::getenv("NCCL_BUFFSIZE"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 0);
    if (end != env && *end == '\0' && v > 0) {
      simple = v;
      source = fmt::format("estimate: 16 channels x 2 connections, NCCL_BUFFSIZE={}", env);
    }
  }
  f.collective = kChannels * kConnectionsPerChannel * (simple + kLl128 + kLl);
  f.collective_source = std::move(source);
  return f;
}

std::string describe_fixed_bytes(const BackendFixedBytes& f) {
  if (f.total() == 0) return "";
  std::string s = fmt::format("CUDA context {}{}, cuBLASLt workspace {}, op workspace {}",
                              format_bytes(f.context),
                              f.context_source.empty() ? "" : " (" + f.context_source + ")",
                              format_bytes(f.cublaslt_workspace), format_bytes(f.op_workspace));
  if (f.collective > 0) {
    s += fmt::format(", NCCL buffers {}{}", format_bytes(f.collective),
                     f.collective_source.empty() ? "" : " (" + f.collective_source + ")");
  }
  return s;
}

}  // namespace headroom::plan
