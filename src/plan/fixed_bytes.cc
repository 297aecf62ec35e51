// The backend's fixed device bytes (fixed_bytes.h): the CUDA backend's own figures when it is
// built in, the same constants when it is not.
#include "plan/fixed_bytes.h"

#include <fmt/format.h>

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

std::string describe_fixed_bytes(const BackendFixedBytes& f) {
  if (f.total() == 0) return "";
  return fmt::format("CUDA context {}{}, cuBLASLt workspace {}, op workspace {}",
                     format_bytes(f.context),
                     f.context_source.empty() ? "" : " (" + f.context_source + ")",
                     format_bytes(f.cublaslt_workspace), format_bytes(f.op_workspace));
}

}  // namespace headroom::plan
