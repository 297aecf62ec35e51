// The CUDA tests' shared helpers: the skip when no GPU is present (with the runtime's reason),
// device buffers filled from and read back to host vectors, and the CPU op table as the
// reference (ggml's test-backend-ops idea: the same inputs through both tables).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/device_memory.h"
#include "backend/ops.h"
#include "core/dtype.h"

namespace headroom::cudatest {

// The CUDA table, or a skip naming why there is none (call through HR_CUDA_OPS_OR_SKIP).
inline const backend::Ops* ops_or_reason(std::string* why) { return backend::cuda::cuda_ops(why); }

#define HR_CUDA_OPS_OR_SKIP(var)                                                            \
  std::string hr_skip_why_;                                                                 \
  const ::headroom::backend::Ops* var = ::headroom::cudatest::ops_or_reason(&hr_skip_why_); \
  if (var == nullptr) GTEST_SKIP() << "no CUDA device: " << hr_skip_why_

// The CUDA table and a cudaMalloc leaf on the process's device (the planned regions' memory),
// fp32 GEMMs without TF32 (the CPU's arithmetic); null with *why set when there is no GPU to
// skip for. A GPU whose device or leaf cannot be had is a failure (recorded), not a skip.
inline const backend::Ops* ops_and_leaf(std::unique_ptr<backend::cuda::CudaDeviceResource>* leaf,
                                        std::string* why) {
  const backend::Ops* ops = backend::cuda::cuda_ops(why);
  if (ops == nullptr) return nullptr;
  backend::cuda::set_allow_tf32(false);
  Result<int> device = backend::cuda::process_device();
  Result<std::unique_ptr<backend::cuda::CudaDeviceResource>> made =
      device.is_ok() ? backend::cuda::CudaDeviceResource::create(*device)
                     : Result<std::unique_ptr<backend::cuda::CudaDeviceResource>>(device.status());
  if (!made.is_ok()) {
    *why = made.status().to_string();
    ADD_FAILURE() << "the GPU's memory leaf: " << *why;
    return nullptr;
  }
  *leaf = std::move(made).value();
  return ops;
}

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

// Host-side inputs and storage conversions shared by the op tests (round to nearest even, as
// both backends store).
using VecF = std::vector<float>;
inline VecF rnd(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  VecF v(n);
  for (float& x : v) x = dist(rng);
  return v;
}
template <typename T>
T from_f(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    return bf16_t{f32_to_bf16_bits(x)};
  } else {
    return f16_t{f32_to_f16_bits(x)};
  }
}
template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, float>    ? DType::kF32
         : std::is_same_v<T, bf16_t> ? DType::kBF16
                                     : DType::kF16;
}
inline float to_f(float x) { return x; }
inline float to_f(bf16_t x) { return bf16_bits_to_f32(x.bits); }
inline float to_f(f16_t x) { return f16_bits_to_f32(x.bits); }
template <typename T>
std::vector<T> cast(const VecF& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_f<T>(v[i]);
  return out;
}
template <typename T>
VecF widen(const std::vector<T>& v) {
  VecF out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = to_f(v[i]);
  return out;
}

}  // namespace headroom::cudatest
