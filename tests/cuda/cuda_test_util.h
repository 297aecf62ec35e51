// The CUDA tests' shared helpers: the skip when no GPU is present (with the runtime's reason),
// device buffers filled from and read back to host vectors, and the CPU op table as the
// reference (ggml's test-backend-ops idea: the same inputs through both tables).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/ops.h"

namespace headroom::cudatest {

// The CUDA table, or a skip naming why there is none (call through HR_CUDA_OPS_OR_SKIP).
inline const backend::Ops* ops_or_reason(std::string* why) { return backend::cuda::cuda_ops(why); }

#define HR_CUDA_OPS_OR_SKIP(var)                                                            \
  std::string hr_skip_why_;                                                                 \
  const ::headroom::backend::Ops* var = ::headroom::cudatest::ops_or_reason(&hr_skip_why_); \
  if (var == nullptr) GTEST_SKIP() << "no CUDA device: " << hr_skip_why_

// A device copy of a host vector, freed at scope exit.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    HR_CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return p_; }
  size_t size() const { return n_; }
  // Complete when it returns: a copy from pageable memory may return before its DMA ends, and
  // the ops' non-blocking stream does not wait for the legacy default stream.
  void upload(const std::vector<T>& host) {
    HR_CUDA_CHECK(cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    HR_CUDA_CHECK(cudaDeviceSynchronize());
  }
  // Waits for every queued op (the ops run on their own stream).
  std::vector<T> download() const {
    HR_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> host(n_);
    HR_CUDA_CHECK(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace headroom::cudatest
