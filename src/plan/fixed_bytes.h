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
  // NCCL's own buffers (per channel and peer) when the plan has several ranks on GPUs; 0 for one
  // rank or the CPU backend.
  uint64_t collective = 0;
  std::string collective_source;  // where that figure comes from
  uint64_t total() const { return context + cublaslt_workspace + op_workspace + collective; }
};

// The CUDA backend's workspaces (backend/cuda/cuda_ops_impl.h). A CPU-only build plans a GPU
// with these constants; a CUDA build takes backend::cuda::fixed_device_bytes(), and a test
// checks that the two agree.
inline constexpr uint64_t kCudaCublasLtWorkspaceBytes = uint64_t(32) << 20;
inline constexpr uint64_t kCudaOpWorkspaceBytes = uint64_t(64) << 20;

// The fixed bytes of the CUDA backend on a GPU whose context takes `context` bytes (the spec
// table's figure for the GPU's kind; `source` says where it comes from).
BackendFixedBytes cuda_fixed_bytes(uint64_t context, std::string source);

// NCCL's device buffers for one rank of a job of several on GPUs, with NCCL's default sizes: per
// channel, each ring or tree connection's receive buffers for its three protocols (Simple:
// NCCL_BUFFSIZE, 4 MiB unless set; LL128 about 4.7 MiB; LL 512 KiB), two connections per
// channel, 16 channels: about 300 MiB. An estimate (NCCL picks the channels from the topology);
// a run measures what its communicator took (the device's free memory before and after it
// connected) and its budget follows the device's free memory (docs/notes/cuda.md, "NCCL's
// buffers"). NCCL_BUFFSIZE in the environment replaces the Simple protocol's 4 MiB.
BackendFixedBytes with_collective_buffers(BackendFixedBytes f);

// "CUDA context 512 MiB (estimate: ...), cuBLASLt workspace 32.0 MiB, op workspace 64.0 MiB";
// "" when there are none (the CPU backend).
std::string describe_fixed_bytes(const BackendFixedBytes& f);

}  // namespace headroom::plan
