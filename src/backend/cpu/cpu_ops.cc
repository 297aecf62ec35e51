// The CPU backend's op table: each op of backend/ops.h is the CPU kernel of the same name
// (kernels.h, fused_kernels.h, llama_kernels.h, distill_kernels.h), called as it is.
#include <cstring>

#include "backend/cpu/distill_kernels.h"
#include "backend/cpu/fused_kernels.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/kv_cache_kernels.h"
#include "backend/cpu/llama_kernels.h"
#include "backend/ops.h"

namespace headroom::backend {
namespace {

cpu::WeightLayout cpu_layout(WeightLayout l) {
  return l == WeightLayout::kInOut ? cpu::WeightLayout::kInOut : cpu::WeightLayout::kOutIn;
}
cpu::MatmulStrides cpu_strides(MatmulStrides s) { return {.inp = s.inp, .out = s.out}; }

class CpuOps final : public Ops {
 public:
  std::string_view name() const override { return "cpu"; }

  int64_t activation_row_stride(int64_t cols, int64_t elem_bytes) const override {
    return cpu::activation_row_stride(cols, elem_bytes);
  }
  int64_t logits_row_stride(int64_t V) const override { return cpu::logits_row_stride(V); }
  size_t attention_tiled_scratch_floats(int B, int T, int C, int NH, int NKV,
                                        DType storage) const override {
    return cpu::attention_tiled_scratch_floats(B, T, C, NH, NKV, storage);
  }
  size_t attention_tiled_backward_scratch_floats(int B, int T, int C, int NH, int NKV,
                                                 DType storage) const override {
    return cpu::attention_tiled_backward_scratch_floats(B, T, C, NH, NKV, storage);
  }
  size_t attention_backward_scratch_floats(int B, int T, int NH, int NKV) const override {
    return cpu::attention_backward_scratch_floats(B, T, NH, NKV);
  }
  size_t lm_head_ce_scratch_floats(int chunk, int V, DType storage) const override {
    return cpu::lm_head_ce_scratch_floats(chunk, V, storage);
  }
  size_t f16_matmul_staging_floats(int64_t N, int64_t IC, int64_t OC) const override {
    return cpu::f16_matmul_staging_floats(N, IC, OC);
  }
  bool bf16_wgrad_transposes(int N, int IC, int OC) const override {
    return cpu::bf16_wgrad_transposes(N, IC, OC);
  }

  void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                         int B, int T, int C) const override {
    cpu::embedding_forward(out, tokens, wte, wpe, B, T, C);
  }
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                          int T, int C) const override {
    cpu::embedding_backward(dwte, dwpe, dout, tokens, B, T, C);
  }

#define HR_CPU_NORM(T)                                                                            \
  void layernorm_forward(T* out, float* mean, float* rstd, const float* inp, const float* weight, \
                         const float* bias, int N, int C) const override {                        \
    cpu::layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);                             \
  }                                                                                               \
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const T* dout,               \
                          const float* inp, const float* weight, const float* mean,               \
                          const float* rstd, int N, int C) const override {                       \
    cpu::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);           \
  }                                                                                               \
  void rmsnorm_forward(T* out, float* rstd, const float* inp, const float* weight, int N, int C,  \
                       float eps) const override {                                                \
    cpu::rmsnorm_forward(out, rstd, inp, weight, N, C, eps);                                      \
  }                                                                                               \
  void rmsnorm_backward(float* dinp, float* dweight, const T* dout, const float* inp,             \
                        const float* weight, const float* rstd, int N, int C) const override {    \
    cpu::rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C);                          \
  }
  HR_CPU_NORM(float)
  HR_CPU_NORM(bf16_t)
  HR_CPU_NORM(f16_t)
#undef HR_CPU_NORM
#define HR_CPU_NORM_LOW(T)                                                                         \
  void layernorm_backward(float* dinp, T* dinp_low, float* dweight, float* dbias, const T* dout,   \
                          const float* inp, const float* weight, const float* mean,                \
                          const float* rstd, int N, int C) const override {                        \
    cpu::layernorm_backward(dinp, dinp_low, dweight, dbias, dout, inp, weight, mean, rstd, N, C);  \
  }                                                                                                \
  void rmsnorm_backward(float* dinp, T* dinp_low, float* dweight, const T* dout, const float* inp, \
                        const float* weight, const float* rstd, int N, int C) const override {     \
    cpu::rmsnorm_backward(dinp, dinp_low, dweight, dout, inp, weight, rstd, N, C);                 \
  }
  HR_CPU_NORM_LOW(bf16_t)
  HR_CPU_NORM_LOW(f16_t)
#undef HR_CPU_NORM_LOW

  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                      int IC, int OC, WeightLayout layout, MatmulStrides st) const override {
    cpu::matmul_forward(out, inp, weight, bias, N, IC, OC, cpu_layout(layout), cpu_strides(st));
  }
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, int N, int IC, int OC,
                       WeightLayout layout, MatmulStrides st) const override {
    cpu::matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, cpu_layout(layout),
                         cpu_strides(st));
  }
  void matmul_forward(float* out, const bf16_t* inp, const bf16_t* weight, const float* bias, int N,
                      int IC, int OC, WeightLayout layout, MatmulStrides st) const override {
    cpu::matmul_forward(out, inp, weight, bias, N, IC, OC, cpu_layout(layout), cpu_strides(st));
  }
  void matmul_forward(bf16_t* out, const bf16_t* inp, const bf16_t* weight, const float* bias,
                      int N, int IC, int OC, WeightLayout layout, MatmulStrides st) const override {
    cpu::matmul_forward(out, inp, weight, bias, N, IC, OC, cpu_layout(layout), cpu_strides(st));
  }
  void matmul_backward(bf16_t* dinp, float* dweight, float* dbias, const bf16_t* dout,
                       const bf16_t* inp, const bf16_t* weight, int N, int IC, int OC,
                       WeightLayout layout, MatmulStrides st,
                       const WgradStaging& staging) const override {
    if (!staging.inp_t && !staging.out_t) {
      cpu::matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, cpu_layout(layout),
                           cpu_strides(st));
      return;
    }
    cpu::matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, cpu_layout(layout),
                         cpu_strides(st),
                         cpu::Bf16WgradStaging{staging.inp_t, staging.inp_t_elems, staging.out_t,
                                               staging.out_t_elems});
  }
  void matmul_forward(float* out, const f16_t* inp, const float* weight, const float* bias, int N,
                      int IC, int OC, WeightLayout layout, MatmulStrides st) const override {
    cpu::matmul_forward(out, inp, weight, bias, N, IC, OC, cpu_layout(layout), cpu_strides(st));
  }
  void matmul_forward(f16_t* out, const f16_t* inp, const float* weight, const float* bias, int N,
                      int IC, int OC, WeightLayout layout, MatmulStrides st) const override {
    cpu::matmul_forward(out, inp, weight, bias, N, IC, OC, cpu_layout(layout), cpu_strides(st));
  }
  void matmul_backward(f16_t* dinp, float* dweight, float* dbias, const f16_t* dout,
                       const f16_t* inp, const float* weight, int N, int IC, int OC,
                       WeightLayout layout, MatmulStrides st) const override {
    cpu::matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, cpu_layout(layout),
                         cpu_strides(st));
  }
  void matmul_backward(f16_t* dinp, float* dweight, float* dbias, const float* dout,
                       const f16_t* inp, const float* weight, int N, int IC, int OC,
                       WeightLayout layout, MatmulStrides st) const override {
    cpu::matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, cpu_layout(layout),
                         cpu_strides(st));
  }
  void bind_f16_staging(float* area, size_t floats, float** prev,
                        size_t* prev_floats) const override {
    cpu::bind_f16_gemm_staging(area, floats, prev, prev_floats);
  }

  void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                         int NKV) const override {
    cpu::attention_forward(out, att, qkv, B, T, C, NH, NKV);
  }
  void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                          const float* att, int B, int T, int C, int NH, int NKV) const override {
    cpu::attention_backward(dqkv, scratch, dout, qkv, att, B, T, C, NH, NKV);
  }
  void attention_cached_forward(float* out, float* k_cache, float* v_cache, const float* qkv,
                                int rows, int pos0, int context, int NH, int NKV,
                                int HS) const override {
    cpu::attention_cached_forward(out, k_cache, v_cache, qkv, rows, pos0, context, NH, NKV, HS);
  }
  int max_cached_head_size() const override { return cpu::kMaxCachedHeadSize; }

#define HR_CPU_T(T)                                                                               \
  void attention_tiled_forward(T* out, float* lse, const T* qkv, int B, int T_, int C, int NH,    \
                               int NKV, float* scratch) const override {                          \
    cpu::attention_tiled_forward(out, lse, qkv, B, T_, C, NH, NKV, scratch);                      \
  }                                                                                               \
  void attention_tiled_backward(T* dqkv, const T* dout, const T* qkv, const T* out,               \
                                const float* lse, int B, int T_, int C, int NH, int NKV,          \
                                float* scratch) const override {                                  \
    cpu::attention_tiled_backward(dqkv, dout, qkv, out, lse, B, T_, C, NH, NKV, scratch);         \
  }                                                                                               \
  void gelu_forward(T* out, const T* inp, int64_t n) const override {                             \
    cpu::gelu_forward(out, inp, n);                                                               \
  }                                                                                               \
  void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) const override {            \
    cpu::gelu_backward(dinp, inp, dout, n);                                                       \
  }                                                                                               \
  void swiglu_forward(T* out, const T* gu, int64_t N, int64_t I, int64_t ld_out, int64_t ld_gu)   \
      const override {                                                                            \
    cpu::swiglu_forward(out, gu, N, I, ld_out, ld_gu);                                            \
  }                                                                                               \
  void swiglu_backward(T* dgu, const T* gu, const T* dout, int64_t N, int64_t I, int64_t ld_gu,   \
                       int64_t ld_dout) const override {                                          \
    cpu::swiglu_backward(dgu, gu, dout, N, I, ld_gu, ld_dout);                                    \
  }                                                                                               \
  void rope_forward(T* qkv, const float* cos, const float* sin, int B, int T_, int NH, int NKV,   \
                    int HS) const override {                                                      \
    cpu::rope_forward(qkv, cos, sin, B, T_, NH, NKV, HS);                                         \
  }                                                                                               \
  void rope_backward(T* dqkv, const float* cos, const float* sin, int B, int T_, int NH, int NKV, \
                     int HS) const override {                                                     \
    cpu::rope_backward(dqkv, cos, sin, B, T_, NH, NKV, HS);                                       \
  }                                                                                               \
  void lm_head_ce_forward(float* losses, float* lse, const T* x, const GemmWeight<T>* w,          \
                          const int32_t* targets, int N, int C, int V, int chunk, float* scratch, \
                          int w_rows) const override {                                            \
    cpu::lm_head_ce_forward(losses, lse, x, w, targets, N, C, V, chunk, scratch, w_rows);         \
  }                                                                                               \
  void lm_head_ce_backward(T* dx, float* dw, const T* x, const GemmWeight<T>* w,                  \
                           const int32_t* targets, const float* lse, int N, int C, int V,         \
                           int chunk, float dloss, float* scratch, int w_rows) const override {   \
    cpu::lm_head_ce_backward(dx, dw, x, w, targets, lse, N, C, V, chunk, dloss, scratch, w_rows); \
  }
  HR_CPU_T(float)
  HR_CPU_T(bf16_t)
  HR_CPU_T(f16_t)
#undef HR_CPU_T

  // Knowledge distillation (distill_kernels.h).
#define HR_CPU_KD(T)                                                                               \
  void lm_head_kd_forward(float* losses, float* stats, const T* x, const GemmWeight<T>* w,         \
                          const KdTeacher& teacher, const int32_t* targets, int N, int C, int V,   \
                          int chunk, KdLoss kd, float* scratch, int w_rows) const override {       \
    cpu::lm_head_kd_forward(losses, stats, x, w, teacher, targets, N, C, V, chunk, kd, scratch,    \
                            w_rows);                                                               \
  }                                                                                                \
  void lm_head_kd_backward(T* dx, float* dw, const T* x, const GemmWeight<T>* w,                   \
                           const KdTeacher& teacher, const int32_t* targets, const float* stats,   \
                           int N, int C, int V, int chunk, KdLoss kd, float dloss, float* scratch, \
                           int w_rows) const override {                                            \
    cpu::lm_head_kd_backward(dx, dw, x, w, teacher, targets, stats, N, C, V, chunk, kd, dloss,     \
                             scratch, w_rows);                                                     \
  }
  HR_CPU_KD(float)
  HR_CPU_KD(bf16_t)
  HR_CPU_KD(f16_t)
#undef HR_CPU_KD

  void rope_inv_freq(float* inv_freq, int HS, float theta, const RopeScaling& s) const override {
    cpu::RopeScaling c;
    c.kind = s.kind == RopeScaling::Kind::kLlama3 ? cpu::RopeScaling::Kind::kLlama3
                                                  : cpu::RopeScaling::Kind::kNone;
    c.factor = s.factor;
    c.low_freq_factor = s.low_freq_factor;
    c.high_freq_factor = s.high_freq_factor;
    c.original_max_position_embeddings = s.original_max_position_embeddings;
    cpu::rope_inv_freq(inv_freq, HS, theta, c);
  }
  void rope_table(float* cos, float* sin, const float* inv_freq, int HS, int pos0,
                  int T) const override {
    cpu::rope_table(cos, sin, inv_freq, HS, pos0, T);
  }

  void residual_forward(float* out, const float* a, const float* b, int64_t n) const override {
    cpu::residual_forward(out, a, b, n);
  }
  void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                             int N, int V, int64_t ld) const override {
    cpu::cross_entropy_forward(losses, lse, logits, targets, N, V, ld);
  }
  void cross_entropy_backward_inplace(float* logits, const float* lse, const int32_t* targets,
                                      int N, int V, float dloss, DType storage,
                                      int64_t ld) const override {
    cpu::cross_entropy_backward_inplace(logits, lse, targets, N, V, dloss, storage, ld);
  }
  void cross_entropy_forward_backward_inplace(float* losses, float* lse, float* logits,
                                              const int32_t* targets, int N, int V, float dloss,
                                              DType storage, int64_t ld) const override {
    cpu::cross_entropy_forward_backward_inplace(losses, lse, logits, targets, N, V, dloss, storage,
                                                ld);
  }
  void cast_to_bf16(bf16_t* out, const float* inp, int64_t n) const override {
    cpu::cast_to_bf16(out, inp, n);
  }
  void cast_to_f16(f16_t* out, const float* inp, int64_t n) const override {
    cpu::cast_to_f16(out, inp, n);
  }
  void round_to_f16_values(float* out, const float* inp, int64_t n) const override {
    cpu::round_to_f16_values(out, inp, n);
  }
  void zero(float* x, int64_t n) const override { cpu::zero(x, n); }

  void adamw_update(float* params, float* grads, float* m, float* v, int64_t n,
                    const AdamWParams& p, bf16_t* params_bf16, bool zero_grads) const override {
    const cpu::AdamWParams ap{p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, p.step, p.grad_scale};
    if (zero_grads) {
      cpu::adamw_update_and_zero(params, grads, m, v, n, ap, params_bf16);
    } else {
      cpu::adamw_update(params, grads, m, v, n, ap, params_bf16);
    }
  }
  double sum_squares(const float* x, int64_t n) const override { return cpu::sum_squares(x, n); }

  bool host_addressable() const override { return true; }
  bool is_device_pointer(const void*) const override { return false; }
  void copy_to_device(void* dst, const void* src, size_t bytes) const override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) const override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void fill_bytes(void* dst, int value, size_t bytes) const override {
    if (bytes > 0) std::memset(dst, value, bytes);
  }
  double masked_loss_sum(const float* losses, const int32_t* targets, int N,
                         int64_t* count) const override {
    double sum = 0.0;
    int64_t n = 0;
    for (int i = 0; i < N; i++) {
      if (targets[i] >= 0) {
        sum += losses[i];
        n++;
      }
    }
    if (count) *count = n;
    return sum;
  }
  void scale_inplace(float* x, int64_t n, float s) const override { cpu::scale_inplace(x, n, s); }
  void apply_mask(const uint8_t* mask, float* x, int64_t n) const override {
    cpu::apply_mask(mask, x, n);
  }
};

}  // namespace

const Ops& cpu_ops() {
  static const CpuOps ops;
  return ops;
}

}  // namespace headroom::backend
