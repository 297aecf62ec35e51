// The CUDA op table's creation (backend/cuda/cuda_ops.h): device 0, its four streams, the
// cuBLASLt handle and the fixed workspaces, made once per process on first use.
#include <mutex>
#include <string>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_ops_impl.h"

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
  c.device = 0;
  HR_CUDA_CHECK(cudaSetDevice(c.device));
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
