// STUB (to be replaced): the attention family of the CUDA op table (cuda_ops_impl.h).
#include "backend/cuda/cuda_ops_impl.h"

#define HR_CUDA_TODO(name) \
  ::headroom::backend::cuda::cuda_fail(name, "not implemented yet", __FILE__, __LINE__)

namespace headroom::backend::cuda {

size_t CudaOps::attention_tiled_scratch_floats(int B, int T, int C, int NH, int NKV,
                                               DType storage) const {
  HR_CUDA_TODO("attention_tiled_scratch_floats");
  return {};
}
size_t CudaOps::attention_tiled_backward_scratch_floats(int B, int T, int C, int NH, int NKV,
                                                        DType storage) const {
  HR_CUDA_TODO("attention_tiled_backward_scratch_floats");
  return {};
}
size_t CudaOps::attention_backward_scratch_floats(int B, int T, int NH, int NKV) const {
  HR_CUDA_TODO("attention_backward_scratch_floats");
  return {};
}
void CudaOps::attention_forward(float* out, float* att, const float* qkv, int B, int T, int C,
                                int NH, int NKV) const {
  HR_CUDA_TODO("attention_forward");
}
void CudaOps::attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                                 const float* att, int B, int T, int C, int NH, int NKV) const {
  HR_CUDA_TODO("attention_backward");
}
void CudaOps::attention_cached_forward(float* out, float* k_cache, float* v_cache, const float* qkv,
                                       int rows, int pos0, int context, int NH, int NKV,
                                       int HS) const {
  HR_CUDA_TODO("attention_cached_forward");
}
int CudaOps::max_cached_head_size() const {
  HR_CUDA_TODO("max_cached_head_size");
  return {};
}
void CudaOps::attention_tiled_forward(float* out, float* lse, const float* qkv, int B, int T_,
                                      int C, int NH, int NKV, float* scratch) const {
  HR_CUDA_TODO("attention_tiled_forward");
}
void CudaOps::attention_tiled_backward(float* dqkv, const float* dout, const float* qkv,
                                       const float* out, const float* lse, int B, int T_, int C,
                                       int NH, int NKV, float* scratch) const {
  HR_CUDA_TODO("attention_tiled_backward");
}
void CudaOps::attention_tiled_forward(bf16_t* out, float* lse, const bf16_t* qkv, int B, int T_,
                                      int C, int NH, int NKV, float* scratch) const {
  HR_CUDA_TODO("attention_tiled_forward");
}
void CudaOps::attention_tiled_backward(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv,
                                       const bf16_t* out, const float* lse, int B, int T_, int C,
                                       int NH, int NKV, float* scratch) const {
  HR_CUDA_TODO("attention_tiled_backward");
}
void CudaOps::attention_tiled_forward(f16_t* out, float* lse, const f16_t* qkv, int B, int T_,
                                      int C, int NH, int NKV, float* scratch) const {
  HR_CUDA_TODO("attention_tiled_forward");
}
void CudaOps::attention_tiled_backward(f16_t* dqkv, const f16_t* dout, const f16_t* qkv,
                                       const f16_t* out, const float* lse, int B, int T_, int C,
                                       int NH, int NKV, float* scratch) const {
  HR_CUDA_TODO("attention_tiled_backward");
}

}  // namespace headroom::backend::cuda
