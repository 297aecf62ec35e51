// The pieces of gemm.cu's fused LM head that distill.cu reuses (internal to backend/cuda): the
// row stride of a chunk of logits and the chunk's GEMMs on cuBLASLt, defined in gemm.cu, so that
// the distillation head computes the student's logits and gradients with the CE head's calls.
#pragma once

#include <cstdint>

#include "backend/cuda/cuda_ops_impl.h"
#include "core/dtype.h"

namespace headroom::backend::cuda {

// The row stride of the fused head's chunk of logits (fp32) and of its bf16 dlogits
// (logits_row_stride).
int64_t head_ld(int64_t V);

// The chunk's logits [n, V] (row stride ld) = x[n, C] x w[V, C]^T, fp32 results (f16: w fp32
// holding f16 values, through the bound f16 staging).
void chunk_logits(const Context& ctx, float* logits, const float* x, const float* w, int n, int C,
                  int V, int64_t ld);
void chunk_logits(const Context& ctx, float* logits, const bf16_t* x, const bf16_t* w, int n, int C,
                  int V, int64_t ld);
void chunk_logits(const Context& ctx, float* logits, const f16_t* x, const float* w, int n, int C,
                  int V, int64_t ld);

// dx[n, C] = dlogits x w (overwritten; skipped if null); dw[V, C] += dlogits^T x x (skipped if
// null): the kOutIn matmul_backward.
void chunk_backward(const Context& ctx, float* dx, float* dw, const float* dlogits, const float* x,
                    const float* w, int n, int C, int V, int64_t ld);
void chunk_backward(const Context& ctx, bf16_t* dx, float* dw, const bf16_t* dlogits,
                    const bf16_t* x, const bf16_t* w, int n, int C, int V, int64_t ld);
void chunk_backward(const Context& ctx, f16_t* dx, float* dw, const float* dlogits, const f16_t* x,
                    const float* w, int n, int C, int V, int64_t ld);

}  // namespace headroom::backend::cuda
