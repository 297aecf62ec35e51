// Error checks for the CUDA runtime and cuBLASLt: a failed call is a bug or a broken device, so
// it aborts with the call, the file and line and the runtime's message (an out-of-memory in a
// planned allocation is reported by the memory resources instead, as a Status).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace headroom::backend::cuda {

[[noreturn]] inline void cuda_fail(const char* what, const char* msg, const char* file, int line) {
  std::fprintf(stderr, "headroom: CUDA error in %s at %s:%d: %s\n", what, file, line, msg);
  std::abort();
}

}  // namespace headroom::backend::cuda

#define HR_CUDA_CHECK(call)                                                              \
  do {                                                                                   \
    cudaError_t hr_err_ = (call);                                                        \
    if (hr_err_ != cudaSuccess)                                                          \
      ::headroom::backend::cuda::cuda_fail(#call, cudaGetErrorString(hr_err_), __FILE__, \
                                           __LINE__);                                    \
  } while (0)
#define HR_CUBLAS_CHECK(call)                                                                \
  do {                                                                                       \
    cublasStatus_t hr_st_ = (call);                                                          \
    if (hr_st_ != CUBLAS_STATUS_SUCCESS)                                                     \
      ::headroom::backend::cuda::cuda_fail(#call, cublasLtGetStatusString(hr_st_), __FILE__, \
                                           __LINE__);                                        \
  } while (0)
// After a kernel launch: the launch's own error (bad configuration), without synchronizing.
#define HR_CUDA_LAUNCH_CHECK() HR_CUDA_CHECK(cudaGetLastError())
