// STUB (to be replaced): the gemm family of the CUDA op table (cuda_ops_impl.h).
#include "backend/cuda/cuda_ops_impl.h"

#define HR_CUDA_TODO(name) \
  ::headroom::backend::cuda::cuda_fail(name, "not implemented yet", __FILE__, __LINE__)

namespace headroom::backend::cuda {

int64_t CudaOps::activation_row_stride(int64_t cols, int64_t elem_bytes) const {
  HR_CUDA_TODO("activation_row_stride");
  return {};
}
int64_t CudaOps::logits_row_stride(int64_t V) const {
  HR_CUDA_TODO("logits_row_stride");
  return {};
}
size_t CudaOps::lm_head_ce_scratch_floats(int chunk, int V, DType storage) const {
  HR_CUDA_TODO("lm_head_ce_scratch_floats");
  return {};
}
size_t CudaOps::f16_matmul_staging_floats(int64_t N, int64_t IC, int64_t OC) const {
  HR_CUDA_TODO("f16_matmul_staging_floats");
  return {};
}
bool CudaOps::bf16_wgrad_transposes(int N, int IC, int OC) const {
  HR_CUDA_TODO("bf16_wgrad_transposes");
  return {};
}
void CudaOps::matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                             int N, int IC, int OC, WeightLayout layout,
                             MatmulStrides strides) const {
  HR_CUDA_TODO("matmul_forward");
}
void CudaOps::matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                              const float* inp, const float* weight, int N, int IC, int OC,
                              WeightLayout layout, MatmulStrides strides) const {
  HR_CUDA_TODO("matmul_backward");
}
void CudaOps::matmul_forward(float* out, const bf16_t* inp, const bf16_t* weight, const float* bias,
                             int N, int IC, int OC, WeightLayout layout,
                             MatmulStrides strides) const {
  HR_CUDA_TODO("matmul_forward");
}
void CudaOps::matmul_forward(bf16_t* out, const bf16_t* inp, const bf16_t* weight,
                             const float* bias, int N, int IC, int OC, WeightLayout layout,
                             MatmulStrides strides) const {
  HR_CUDA_TODO("matmul_forward");
}
void CudaOps::matmul_backward(bf16_t* dinp, float* dweight, float* dbias, const bf16_t* dout,
                              const bf16_t* inp, const bf16_t* weight, int N, int IC, int OC,
                              WeightLayout layout, MatmulStrides strides,
                              const WgradStaging& staging) const {
  HR_CUDA_TODO("matmul_backward");
}
void CudaOps::matmul_forward(float* out, const f16_t* inp, const float* weight, const float* bias,
                             int N, int IC, int OC, WeightLayout layout,
                             MatmulStrides strides) const {
  HR_CUDA_TODO("matmul_forward");
}
void CudaOps::matmul_forward(f16_t* out, const f16_t* inp, const float* weight, const float* bias,
                             int N, int IC, int OC, WeightLayout layout,
                             MatmulStrides strides) const {
  HR_CUDA_TODO("matmul_forward");
}
void CudaOps::matmul_backward(f16_t* dinp, float* dweight, float* dbias, const f16_t* dout,
                              const f16_t* inp, const float* weight, int N, int IC, int OC,
                              WeightLayout layout, MatmulStrides strides) const {
  HR_CUDA_TODO("matmul_backward");
}
void CudaOps::matmul_backward(f16_t* dinp, float* dweight, float* dbias, const float* dout,
                              const f16_t* inp, const float* weight, int N, int IC, int OC,
                              WeightLayout layout, MatmulStrides strides) const {
  HR_CUDA_TODO("matmul_backward");
}
void CudaOps::bind_f16_staging(float* area, size_t floats, float** prev,
                               size_t* prev_floats) const {
  HR_CUDA_TODO("bind_f16_staging");
}
void CudaOps::lm_head_ce_forward(float* losses, float* lse, const float* x,
                                 const GemmWeight<float>* w, const int32_t* targets, int N, int C,
                                 int V, int chunk, float* scratch, int w_rows) const {
  HR_CUDA_TODO("lm_head_ce_forward");
}
void CudaOps::lm_head_ce_backward(float* dx, float* dw, const float* x, const GemmWeight<float>* w,
                                  const int32_t* targets, const float* lse, int N, int C, int V,
                                  int chunk, float dloss, float* scratch, int w_rows) const {
  HR_CUDA_TODO("lm_head_ce_backward");
}
void CudaOps::lm_head_ce_forward(float* losses, float* lse, const bf16_t* x,
                                 const GemmWeight<bf16_t>* w, const int32_t* targets, int N, int C,
                                 int V, int chunk, float* scratch, int w_rows) const {
  HR_CUDA_TODO("lm_head_ce_forward");
}
void CudaOps::lm_head_ce_backward(bf16_t* dx, float* dw, const bf16_t* x,
                                  const GemmWeight<bf16_t>* w, const int32_t* targets,
                                  const float* lse, int N, int C, int V, int chunk, float dloss,
                                  float* scratch, int w_rows) const {
  HR_CUDA_TODO("lm_head_ce_backward");
}
void CudaOps::lm_head_ce_forward(float* losses, float* lse, const f16_t* x,
                                 const GemmWeight<f16_t>* w, const int32_t* targets, int N, int C,
                                 int V, int chunk, float* scratch, int w_rows) const {
  HR_CUDA_TODO("lm_head_ce_forward");
}
void CudaOps::lm_head_ce_backward(f16_t* dx, float* dw, const f16_t* x, const GemmWeight<f16_t>* w,
                                  const int32_t* targets, const float* lse, int N, int C, int V,
                                  int chunk, float dloss, float* scratch, int w_rows) const {
  HR_CUDA_TODO("lm_head_ce_backward");
}

}  // namespace headroom::backend::cuda
