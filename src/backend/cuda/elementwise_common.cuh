// Device helpers shared by the elementwise family's .cu files (elementwise.cu, embedding.cu,
// norm.cu, loss.cu): storage-type conversions, 128-bit packs, fixed-order block reductions and
// launch shapes. Internal to backend/cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "backend/cuda/cuda_ops_impl.h"
#include "core/dtype.h"

namespace headroom::backend::cuda::elem {

// ---- storage types: bf16_t / f16_t are the host's 16-bit structs; the device converts through
// their bits with CUDA's round-to-nearest-even intrinsics (the CPU's rounding).
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16_t x) {
  return __uint_as_float(uint32_t(x.bits) << 16);
}
__device__ __forceinline__ float to_f32(f16_t x) { return __half2float(__ushort_as_half(x.bits)); }
template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16_t from_f32<bf16_t>(float x) {
  return bf16_t{__bfloat16_as_ushort(__float2bfloat16_rn(x))};
}
template <>
__device__ __forceinline__ f16_t from_f32<f16_t>(float x) {
  return f16_t{__half_as_ushort(__float2half_rn(x))};
}
// x rounded to the nearest f16 value, kept as fp32.
__device__ __forceinline__ float round_f16(float x) { return __half2float(__float2half_rn(x)); }

// ---- packs: K elements of T as floats, through 16-byte loads when K * sizeof(T) is a multiple
// of 16 (the caller guarantees the address is 16-byte aligned), else element by element.
template <int K, typename T>
__device__ __forceinline__ void load_pack(const T* p, float (&v)[K]) {
  if constexpr (K > 1 && (K * sizeof(T)) % 16 == 0) {
    constexpr int kWords = int(K * sizeof(T) / 16);
    union {
      int4 w[kWords];
      T e[K];
    } u;
#pragma unroll
    for (int j = 0; j < kWords; ++j) u.w[j] = reinterpret_cast<const int4*>(p)[j];
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = to_f32(u.e[k]);
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = to_f32(p[k]);
  }
}
template <int K, typename T>
__device__ __forceinline__ void store_pack(T* p, const float (&v)[K]) {
  if constexpr (K > 1 && (K * sizeof(T)) % 16 == 0) {
    constexpr int kWords = int(K * sizeof(T) / 16);
    union {
      int4 w[kWords];
      T e[K];
    } u;
#pragma unroll
    for (int k = 0; k < K; ++k) u.e[k] = from_f32<T>(v[k]);
#pragma unroll
    for (int j = 0; j < kWords; ++j) reinterpret_cast<int4*>(p)[j] = u.w[j];
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) p[k] = from_f32<T>(v[k]);
  }
}

// Elements per thread step of the vectorised maps: 8 (one 16-byte pack of 16-bit values, two of
// fp32), so every storage type of one op moves whole packs.
constexpr int kPack = 8;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// ---- reductions: fixed trees (shuffles by halving distance, then the warps' results in warp
// order), so a result depends on the inputs only, never on scheduling.
template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Every thread of the block gets the result. REQUIRES: blockDim.x a multiple of 32, <= 1024;
// every thread of the block calls it (it synchronizes); `shared` holds 32 V.
template <typename V, typename Op>
__device__ __forceinline__ V block_reduce(V v, Op op, V* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_reduce(v, op);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  V r = shared[0];
  for (int w = 1; w < warps; ++w) r = op(r, shared[w]);  // warp order, the same in every thread
  return r;
}
struct Sum {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const {
    return a + b;
  }
};
struct Max {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// ---- launch shapes ---------------------------------------------------------------------------
// Blocks for a grid-stride loop over `work` items, blocks of `threads`: enough to fill the device
// several times over, never more than the work needs, and at least one.
inline unsigned grid_for(const CudaOps& ops, int64_t work, int threads) {
  const int64_t need = (work + threads - 1) / threads;
  const int64_t cap = int64_t(ops.context().props.multiProcessorCount) * 32;
  return unsigned(std::max<int64_t>(1, std::min(need, cap)));
}
// gridDim.y and gridDim.z are at most 65535; rows beyond it are covered by a grid-stride loop.
constexpr int64_t kMaxGridY = 65535;

// The op workspace for `bytes`, or a clear abort naming the op and the shape's need.
inline void* op_workspace(const CudaOps& ops, size_t bytes, const char* op) {
  const Context& c = ops.context();
  if (bytes > c.op_workspace_bytes) {
    const std::string msg = std::string("needs ") + std::to_string(bytes) +
                            " bytes of op workspace, the table has " +
                            std::to_string(c.op_workspace_bytes) +
                            " (kOpWorkspaceBytes in backend/cuda/cuda_ops_impl.h): raise it or "
                            "split the call";
    cuda_fail(op, msg.c_str(), __FILE__, __LINE__);
  }
  return c.op_workspace;
}

// A host-side precondition of an op: aborts naming the op, what is wrong and the values (`what`
// is evaluated only on failure) (the op table
// assumes the model validated its shapes; this catches a caller's bug, not user input).
#define HR_ELEM_REQUIRE(cond, op, what)                                                        \
  do {                                                                                         \
    if (!(cond))                                                                               \
      ::headroom::backend::cuda::cuda_fail(op, std::string(what).c_str(), __FILE__, __LINE__); \
  } while (0)

}  // namespace headroom::backend::cuda::elem
