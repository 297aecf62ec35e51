// The CUDA op table's creation (backend/cuda/cuda_ops.h): the process's device, its four streams,
// the cuBLASLt handle and the fixed workspaces, made once per process on first use.
#include <mutex>
#include <string>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_ops_impl.h"
#include "backend/cuda/device_memory.h"

namespace headroom::backend::cuda {

bool device_available(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why) *why = std::string("CUDA runtime: ") + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error of the failed query
    return false;
  }
  if (count == 0) {
    if (why) *why = "CUDA runtime: no CUDA-capable device is detected";
    return false;
  }
  return true;
}

CudaOps::~CudaOps() {
  // The table lives until the process exits, when the driver may already be unloading: the
  // resources go with the context, so nothing is released here.
}

void CudaOps::synchronize() const { HR_CUDA_CHECK(cudaStreamSynchronize(ctx_.compute)); }

namespace {

Context make_context() {
  Context c;
  // The process's device (local rank % devices: one GPU per rank of a node), and the context's
  // own bytes measured before the workspaces below are allocated (device_memory.h).
  Result<int> dev = process_device();
  if (!dev.is_ok())
    cuda_fail("process_device()", dev.status().message().c_str(), __FILE__, __LINE__);
  c.device = *dev;
  HR_CUDA_CHECK(cudaSetDevice(c.device));
  if (Result<uint64_t> ctx = context_bytes(); !ctx.is_ok()) {
    cuda_fail("context_bytes()", ctx.status().message().c_str(), __FILE__, __LINE__);
  }
  HR_CUDA_CHECK(cudaGetDeviceProperties(&c.props, c.device));
  HR_CUDA_CHECK(cudaStreamCreateWithFlags(&c.compute, cudaStreamNonBlocking));
  HR_CUDA_CHECK(cudaStreamCreateWithFlags(&c.h2d, cudaStreamNonBlocking));
  HR_CUDA_CHECK(cudaStreamCreateWithFlags(&c.d2h, cudaStreamNonBlocking));
  HR_CUDA_CHECK(cudaStreamCreateWithFlags(&c.comm, cudaStreamNonBlocking));
  HR_CUBLAS_CHECK(cublasLtCreate(&c.lt));
  c.lt_workspace_bytes = kCublasLtWorkspaceBytes;
  HR_CUDA_CHECK(cudaMalloc(&c.lt_workspace, c.lt_workspace_bytes));
  c.op_workspace_bytes = kOpWorkspaceBytes;
  HR_CUDA_CHECK(cudaMalloc(&c.op_workspace, c.op_workspace_bytes));
  return c;
}

}  // namespace

const Ops* cuda_ops(std::string* why) {
  static std::once_flag once;
  static const CudaOps* ops = nullptr;
  static std::string reason;
  std::call_once(once, [] {
    if (device_available(&reason)) ops = new CudaOps(make_context());
  });
  if (!ops && why) *why = reason;
  return ops;
}

FixedDeviceBytes fixed_device_bytes() {
  return {.cublaslt_workspace = kCublasLtWorkspaceBytes, .op_workspace = kOpWorkspaceBytes};
}

}  // namespace headroom::backend::cuda
