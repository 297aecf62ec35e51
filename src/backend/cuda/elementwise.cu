// STUB (to be replaced): the elementwise family of the CUDA op table (cuda_ops_impl.h).
#include "backend/cuda/cuda_ops_impl.h"

#define HR_CUDA_TODO(name) \
  ::headroom::backend::cuda::cuda_fail(name, "not implemented yet", __FILE__, __LINE__)

namespace headroom::backend::cuda {

void CudaOps::embedding_forward(float* out, const int32_t* tokens, const float* wte,
                                const float* wpe, int B, int T, int C) const {
  HR_CUDA_TODO("embedding_forward");
}
void CudaOps::embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                                 int B, int T, int C) const {
  HR_CUDA_TODO("embedding_backward");
}
void CudaOps::layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                                const float* weight, const float* bias, int N, int C) const {
  HR_CUDA_TODO("layernorm_forward");
}
void CudaOps::layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                 const float* inp, const float* weight, const float* mean,
                                 const float* rstd, int N, int C) const {
  HR_CUDA_TODO("layernorm_backward");
}
void CudaOps::rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int N,
                              int C, float eps) const {
  HR_CUDA_TODO("rmsnorm_forward");
}
void CudaOps::rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                               const float* weight, const float* rstd, int N, int C) const {
  HR_CUDA_TODO("rmsnorm_backward");
}
void CudaOps::layernorm_forward(bf16_t* out, float* mean, float* rstd, const float* inp,
                                const float* weight, const float* bias, int N, int C) const {
  HR_CUDA_TODO("layernorm_forward");
}
void CudaOps::layernorm_backward(float* dinp, float* dweight, float* dbias, const bf16_t* dout,
                                 const float* inp, const float* weight, const float* mean,
                                 const float* rstd, int N, int C) const {
  HR_CUDA_TODO("layernorm_backward");
}
void CudaOps::rmsnorm_forward(bf16_t* out, float* rstd, const float* inp, const float* weight,
                              int N, int C, float eps) const {
  HR_CUDA_TODO("rmsnorm_forward");
}
void CudaOps::rmsnorm_backward(float* dinp, float* dweight, const bf16_t* dout, const float* inp,
                               const float* weight, const float* rstd, int N, int C) const {
  HR_CUDA_TODO("rmsnorm_backward");
}
void CudaOps::layernorm_forward(f16_t* out, float* mean, float* rstd, const float* inp,
                                const float* weight, const float* bias, int N, int C) const {
  HR_CUDA_TODO("layernorm_forward");
}
void CudaOps::layernorm_backward(float* dinp, float* dweight, float* dbias, const f16_t* dout,
                                 const float* inp, const float* weight, const float* mean,
                                 const float* rstd, int N, int C) const {
  HR_CUDA_TODO("layernorm_backward");
}
void CudaOps::rmsnorm_forward(f16_t* out, float* rstd, const float* inp, const float* weight, int N,
                              int C, float eps) const {
  HR_CUDA_TODO("rmsnorm_forward");
}
void CudaOps::rmsnorm_backward(float* dinp, float* dweight, const f16_t* dout, const float* inp,
                               const float* weight, const float* rstd, int N, int C) const {
  HR_CUDA_TODO("rmsnorm_backward");
}
void CudaOps::layernorm_backward(float* dinp, bf16_t* dinp_low, float* dweight, float* dbias,
                                 const bf16_t* dout, const float* inp, const float* weight,
                                 const float* mean, const float* rstd, int N, int C) const {
  HR_CUDA_TODO("layernorm_backward");
}
void CudaOps::rmsnorm_backward(float* dinp, bf16_t* dinp_low, float* dweight, const bf16_t* dout,
                               const float* inp, const float* weight, const float* rstd, int N,
                               int C) const {
  HR_CUDA_TODO("rmsnorm_backward");
}
void CudaOps::layernorm_backward(float* dinp, f16_t* dinp_low, float* dweight, float* dbias,
                                 const f16_t* dout, const float* inp, const float* weight,
                                 const float* mean, const float* rstd, int N, int C) const {
  HR_CUDA_TODO("layernorm_backward");
}
void CudaOps::rmsnorm_backward(float* dinp, f16_t* dinp_low, float* dweight, const f16_t* dout,
                               const float* inp, const float* weight, const float* rstd, int N,
                               int C) const {
  HR_CUDA_TODO("rmsnorm_backward");
}
void CudaOps::gelu_forward(float* out, const float* inp, int64_t n) const {
  HR_CUDA_TODO("gelu_forward");
}
void CudaOps::gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) const {
  HR_CUDA_TODO("gelu_backward");
}
void CudaOps::swiglu_forward(float* out, const float* gu, int64_t N, int64_t I, int64_t ld_out,
                             int64_t ld_gu) const {
  HR_CUDA_TODO("swiglu_forward");
}
void CudaOps::swiglu_backward(float* dgu, const float* gu, const float* dout, int64_t N, int64_t I,
                              int64_t ld_gu, int64_t ld_dout) const {
  HR_CUDA_TODO("swiglu_backward");
}
void CudaOps::rope_forward(float* qkv, const float* cos, const float* sin, int B, int T_, int NH,
                           int NKV, int HS) const {
  HR_CUDA_TODO("rope_forward");
}
void CudaOps::rope_backward(float* dqkv, const float* cos, const float* sin, int B, int T_, int NH,
                            int NKV, int HS) const {
  HR_CUDA_TODO("rope_backward");
}
void CudaOps::gelu_forward(bf16_t* out, const bf16_t* inp, int64_t n) const {
  HR_CUDA_TODO("gelu_forward");
}
void CudaOps::gelu_backward(bf16_t* dinp, const bf16_t* inp, const bf16_t* dout, int64_t n) const {
  HR_CUDA_TODO("gelu_backward");
}
void CudaOps::swiglu_forward(bf16_t* out, const bf16_t* gu, int64_t N, int64_t I, int64_t ld_out,
                             int64_t ld_gu) const {
  HR_CUDA_TODO("swiglu_forward");
}
void CudaOps::swiglu_backward(bf16_t* dgu, const bf16_t* gu, const bf16_t* dout, int64_t N,
                              int64_t I, int64_t ld_gu, int64_t ld_dout) const {
  HR_CUDA_TODO("swiglu_backward");
}
void CudaOps::rope_forward(bf16_t* qkv, const float* cos, const float* sin, int B, int T_, int NH,
                           int NKV, int HS) const {
  HR_CUDA_TODO("rope_forward");
}
void CudaOps::rope_backward(bf16_t* dqkv, const float* cos, const float* sin, int B, int T_, int NH,
                            int NKV, int HS) const {
  HR_CUDA_TODO("rope_backward");
}
void CudaOps::gelu_forward(f16_t* out, const f16_t* inp, int64_t n) const {
  HR_CUDA_TODO("gelu_forward");
}
void CudaOps::gelu_backward(f16_t* dinp, const f16_t* inp, const f16_t* dout, int64_t n) const {
  HR_CUDA_TODO("gelu_backward");
}
void CudaOps::swiglu_forward(f16_t* out, const f16_t* gu, int64_t N, int64_t I, int64_t ld_out,
                             int64_t ld_gu) const {
  HR_CUDA_TODO("swiglu_forward");
}
void CudaOps::swiglu_backward(f16_t* dgu, const f16_t* gu, const f16_t* dout, int64_t N, int64_t I,
                              int64_t ld_gu, int64_t ld_dout) const {
  HR_CUDA_TODO("swiglu_backward");
}
void CudaOps::rope_forward(f16_t* qkv, const float* cos, const float* sin, int B, int T_, int NH,
                           int NKV, int HS) const {
  HR_CUDA_TODO("rope_forward");
}
void CudaOps::rope_backward(f16_t* dqkv, const float* cos, const float* sin, int B, int T_, int NH,
                            int NKV, int HS) const {
  HR_CUDA_TODO("rope_backward");
}
void CudaOps::rope_inv_freq(float* inv_freq, int HS, float theta,
                            const RopeScaling& scaling) const {
  HR_CUDA_TODO("rope_inv_freq");
}
void CudaOps::rope_table(float* cos, float* sin, const float* inv_freq, int HS, int pos0,
                         int T) const {
  HR_CUDA_TODO("rope_table");
}
void CudaOps::residual_forward(float* out, const float* a, const float* b, int64_t n) const {
  HR_CUDA_TODO("residual_forward");
}
void CudaOps::cross_entropy_forward(float* losses, float* lse, const float* logits,
                                    const int32_t* targets, int N, int V, int64_t ld) const {
  HR_CUDA_TODO("cross_entropy_forward");
}
void CudaOps::cross_entropy_backward_inplace(float* logits, const float* lse,
                                             const int32_t* targets, int N, int V, float dloss,
                                             DType storage, int64_t ld) const {
  HR_CUDA_TODO("cross_entropy_backward_inplace");
}
void CudaOps::cross_entropy_forward_backward_inplace(float* losses, float* lse, float* logits,
                                                     const int32_t* targets, int N, int V,
                                                     float dloss, DType storage, int64_t ld) const {
  HR_CUDA_TODO("cross_entropy_forward_backward_inplace");
}
void CudaOps::cast_to_bf16(bf16_t* out, const float* inp, int64_t n) const {
  HR_CUDA_TODO("cast_to_bf16");
}
void CudaOps::cast_to_f16(f16_t* out, const float* inp, int64_t n) const {
  HR_CUDA_TODO("cast_to_f16");
}
void CudaOps::round_to_f16_values(float* out, const float* inp, int64_t n) const {
  HR_CUDA_TODO("round_to_f16_values");
}
void CudaOps::zero(float* x, int64_t n) const { HR_CUDA_TODO("zero"); }
void CudaOps::adamw_update(float* params, float* grads, float* m, float* v, int64_t n,
                           const AdamWParams& p, bf16_t* params_bf16, bool zero_grads) const {
  HR_CUDA_TODO("adamw_update");
}
double CudaOps::sum_squares(const float* x, int64_t n) const {
  HR_CUDA_TODO("sum_squares");
  return {};
}
void CudaOps::scale_inplace(float* x, int64_t n, float s) const { HR_CUDA_TODO("scale_inplace"); }

}  // namespace headroom::backend::cuda
