// The bytes a backend holds on the device outside the plan's arenas: on a CUDA device the
// context, the cuBLASLt workspace and the ops' fixed workspace. The planner counts them in every
// plan for such a device (persistent bytes and the peak), so that a plan that fits the label's
// memory fits what a process can actually allocate. See docs/notes/cuda.md, "Infrastructure".
#pragma once

#include <cstdint>
#include <string>

namespace headroom::plan {

struct BackendFixedBytes {
  uint64_t context = 0;             // the CUDA context's own device memory
  uint64_t cublaslt_workspace = 0;  // cuBLASLt's GEMM workspace
  uint64_t op_workspace = 0;        // the ops' fixed scratch (deterministic partial sums)
  std::string context_source;       // where the context figure comes from
  uint64_t total() const { return context + cublaslt_workspace + op_workspace; }
};

// The CUDA backend's workspaces (backend/cuda/cuda_ops_impl.h). A CPU-only build plans a GPU
// with these constants; a CUDA build takes backend::cuda::fixed_device_bytes(), and a test
// checks that the two agree.
inline constexpr uint64_t kCudaCublasLtWorkspaceBytes = uint64_t(32) << 20;
inline constexpr uint64_t kCudaOpWorkspaceBytes = uint64_t(64) << 20;

// The fixed bytes of the CUDA backend on a GPU whose context takes `context` bytes (the spec
// table's figure for the GPU's kind; `source` says where it comes from).
BackendFixedBytes cuda_fixed_bytes(uint64_t context, std::string source);

// "CUDA context 512 MiB (estimate: ...), cuBLASLt workspace 32.0 MiB, op workspace 64.0 MiB";
// "" when there are none (the CPU backend).
std::string describe_fixed_bytes(const BackendFixedBytes& f);

}  // namespace headroom::plan
