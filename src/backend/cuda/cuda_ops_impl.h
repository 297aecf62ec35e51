// The CUDA op table's class (internal to backend/cuda: it includes CUDA's headers). Every op of
// backend/ops.h is declared here and defined in the .cu file of its family: elementwise.cu
// (embedding, norms, activations, RoPE, residual, losses over full logits, casts, optimizer),
// gemm.cu (cuBLASLt matmuls, the fused LM head), distill.cu (the LM head fused with a
// distillation loss), attention.cu (plain, tiled and cached
// attention). The linker proves that none is missing: the vtable needs them all.
//
// Execution model: every op is queued on the compute stream (stream()) and returns without
// waiting; synchronize() waits. Pointers are device pointers (or managed). No op allocates: the
// cuBLASLt workspace and the op workspace (deterministic partial sums, staging) are allocated
// once when the table is created, and ops queued on one stream use them one after another.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/ops.h"

namespace headroom::backend::cuda {

struct Context {
  int device = 0;
  cudaDeviceProp props{};
  cudaStream_t compute = nullptr;  // every op
  cudaStream_t h2d = nullptr;      // host -> device copies (offload reloads, data prefetch)
  cudaStream_t d2h = nullptr;      // device -> host copies (offload)
  cudaStream_t comm = nullptr;     // collectives (NCCL)
  cublasLtHandle_t lt = nullptr;
  void* lt_workspace = nullptr;
  size_t lt_workspace_bytes = 0;
  void* op_workspace = nullptr;  // ops' fixed scratch (sizes in each family's .cu)
  size_t op_workspace_bytes = 0;
};

// Sizes of the fixed workspaces (cuda_ops.cu).
inline constexpr size_t kCublasLtWorkspaceBytes = size_t(32) << 20;  // Hopper's suggested 32 MiB
inline constexpr size_t kOpWorkspaceBytes = size_t(64) << 20;

class CudaOps final : public Ops {
 public:
  explicit CudaOps(Context ctx) : ctx_(ctx) {}
  ~CudaOps() override;
  std::string_view name() const override { return "cuda"; }
  void synchronize() const override;

  // Device memory: reached through the ops and these copies, on the compute stream
  // (elementwise.cu).
  bool host_addressable() const override { return false; }
  // cudaPointerGetAttributes: device or managed memory (elementwise.cu).
  bool is_device_pointer(const void* p) const override;
  void copy_to_device(void* dst, const void* src, size_t bytes) const override;
  void copy_to_host(void* dst, const void* src, size_t bytes) const override;
  void fill_bytes(void* dst, int value, size_t bytes) const override;
  // On the d2h / h2d stream after an event recorded on the compute stream; the ticket names an
  // event recorded after the copy, which wait_copy synchronizes and makes the compute stream
  // wait for (cuda_ops.cu). Any thread, whatever its current device.
  uint64_t copy_to_host_async(void* dst, const void* src, size_t bytes) const override;
  uint64_t copy_to_device_async(void* dst, const void* src, size_t bytes) const override;
  void wait_copy(uint64_t ticket) const override;
  double masked_loss_sum(const float* losses, const int32_t* targets, int N,
                         int64_t* count) const override;
  const Context& context() const { return ctx_; }
  cudaStream_t stream() const { return ctx_.compute; }

  // ---- sizes the planner plans (elements or floats; functions of shapes only) -------------
  int64_t activation_row_stride(int64_t cols, int64_t elem_bytes) const override;
  int64_t logits_row_stride(int64_t V) const override;
  size_t attention_tiled_scratch_floats(int B, int T, int C, int NH, int NKV,
                                        DType storage) const override;
  size_t attention_tiled_backward_scratch_floats(int B, int T, int C, int NH, int NKV,
                                                 DType storage) const override;
  size_t attention_backward_scratch_floats(int B, int T, int NH, int NKV) const override;
  size_t lm_head_ce_scratch_floats(int chunk, int V, DType storage) const override;
  size_t f16_matmul_staging_floats(int64_t N, int64_t IC, int64_t OC) const override;
  // Whether the bf16 weight gradient of an [N, IC] x [IC, OC] matmul takes the staging.
  bool bf16_wgrad_transposes(int N, int IC, int OC) const override;

  // ---- embedding (fp32): out = wte[tokens] (+ wpe[t] when wpe is not null) -----------------
  void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                         int B, int T, int C) const override;
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                          int T, int C) const override;

  // ---- LayerNorm (eps 1e-5, as GPT-2) ------------------------------------------------------
#define HR_OPS_NORM(T)                                                                            \
  void layernorm_forward(T* out, float* mean, float* rstd, const float* inp, const float* weight, \
                         const float* bias, int N, int C) const override;                         \
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const T* dout,               \
                          const float* inp, const float* weight, const float* mean,               \
                          const float* rstd, int N, int C) const override;                        \
  void rmsnorm_forward(T* out, float* rstd, const float* inp, const float* weight, int N, int C,  \
                       float eps) const override;                                                 \
  void rmsnorm_backward(float* dinp, float* dweight, const T* dout, const float* inp,             \
                        const float* weight, const float* rstd, int N, int C) const override;
  HR_OPS_NORM(float)
  HR_OPS_NORM(bf16_t)
  HR_OPS_NORM(f16_t)
#undef HR_OPS_NORM
  // 16-bit: also the updated dinp rounded into dinp_low[N, C], in the same pass.
#define HR_OPS_NORM_LOW(T)                                                                         \
  void layernorm_backward(float* dinp, T* dinp_low, float* dweight, float* dbias, const T* dout,   \
                          const float* inp, const float* weight, const float* mean,                \
                          const float* rstd, int N, int C) const override;                         \
  void rmsnorm_backward(float* dinp, T* dinp_low, float* dweight, const T* dout, const float* inp, \
                        const float* weight, const float* rstd, int N, int C) const override;
  HR_OPS_NORM_LOW(bf16_t)
  HR_OPS_NORM_LOW(f16_t)
#undef HR_OPS_NORM_LOW

  // ---- matmul: out[N,OC] = inp[N,IC] x weight (+ bias) --------------------------------------
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                      int IC, int OC, WeightLayout layout, MatmulStrides strides) const override;
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, int N, int IC, int OC,
                       WeightLayout layout, MatmulStrides strides) const override;
  void matmul_forward(float* out, const bf16_t* inp, const bf16_t* weight, const float* bias, int N,
                      int IC, int OC, WeightLayout layout, MatmulStrides strides) const override;
  void matmul_forward(bf16_t* out, const bf16_t* inp, const bf16_t* weight, const float* bias,
                      int N, int IC, int OC, WeightLayout layout,
                      MatmulStrides strides) const override;
  // An empty staging: no transposed operands.
  void matmul_backward(bf16_t* dinp, float* dweight, float* dbias, const bf16_t* dout,
                       const bf16_t* inp, const bf16_t* weight, int N, int IC, int OC,
                       WeightLayout layout, MatmulStrides strides,
                       const WgradStaging& staging) const override;
  void matmul_forward(float* out, const f16_t* inp, const float* weight, const float* bias, int N,
                      int IC, int OC, WeightLayout layout, MatmulStrides strides) const override;
  void matmul_forward(f16_t* out, const f16_t* inp, const float* weight, const float* bias, int N,
                      int IC, int OC, WeightLayout layout, MatmulStrides strides) const override;
  void matmul_backward(f16_t* dinp, float* dweight, float* dbias, const f16_t* dout,
                       const f16_t* inp, const float* weight, int N, int IC, int OC,
                       WeightLayout layout, MatmulStrides strides) const override;
  // The LM head's backward in f16: dout is fp32 holding f16 values.
  void matmul_backward(f16_t* dinp, float* dweight, float* dbias, const float* dout,
                       const f16_t* inp, const float* weight, int N, int IC, int OC,
                       WeightLayout layout, MatmulStrides strides) const override;
  // The f16 GEMMs' staging area for the ops that follow on this thread (0 floats: unbind);
  // returns the previous binding through prev/prev_floats.
  void bind_f16_staging(float* area, size_t floats, float** prev,
                        size_t* prev_floats) const override;

  // ---- causal self-attention ----------------------------------------------------------------
  // qkv[B,T,(NH+2 NKV) HS]: q heads, then k heads, then v heads; query head h reads kv head
  // h / (NH / NKV); out[B,T,C], HS = C / NH. Plain (fp32): att[B,NH,T,T] keeps the probabilities.
  void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                         int NKV) const override;
  void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                          const float* att, int B, int T, int C, int NH, int NKV) const override;
  // Generation with a KV cache (fp32): appends the k and v heads of qkv[rows, (NH + 2 NKV) HS]
  // (positions pos0 .. pos0 + rows - 1) to k_cache / v_cache[NKV, context, HS], then attends
  // each row over every cached position up to its own; out[rows, NH HS].
  void attention_cached_forward(float* out, float* k_cache, float* v_cache, const float* qkv,
                                int rows, int pos0, int context, int NH, int NKV,
                                int HS) const override;
  int max_cached_head_size() const override;
  // Tiled (online softmax): lse[B,NH,T] instead of the probabilities.
#define HR_OPS_T(T)                                                                               \
  void attention_tiled_forward(T* out, float* lse, const T* qkv, int B, int T_, int C, int NH,    \
                               int NKV, float* scratch) const override;                           \
  void attention_tiled_backward(T* dqkv, const T* dout, const T* qkv, const T* out,               \
                                const float* lse, int B, int T_, int C, int NH, int NKV,          \
                                float* scratch) const override;                                   \
  /* GELU (tanh); dinp may alias dout */                                                          \
  void gelu_forward(T* out, const T* inp, int64_t n) const override;                              \
  void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) const override;             \
  /* SwiGLU: gu[N, 2I] = gate | up (row stride ld_gu); out = silu(gate) * up; dgu may alias gu */ \
  void swiglu_forward(T* out, const T* gu, int64_t N, int64_t I, int64_t ld_out, int64_t ld_gu)   \
      const override;                                                                             \
  void swiglu_backward(T* dgu, const T* gu, const T* dout, int64_t N, int64_t I, int64_t ld_gu,   \
                       int64_t ld_dout) const override;                                           \
  /* Rotary embeddings in place on qkv's q and k heads (rotate_half pairs); cos/sin [T, HS/2] */  \
  void rope_forward(T* qkv, const float* cos, const float* sin, int B, int T_, int NH, int NKV,   \
                    int HS) const override;                                                       \
  void rope_backward(T* dqkv, const float* cos, const float* sin, int B, int T_, int NH, int NKV, \
                     int HS) const override;                                                      \
  /* The LM head fused with cross-entropy, in chunks of tokens (fused_kernels.h) */               \
  void lm_head_ce_forward(float* losses, float* lse, const T* x, const GemmWeight<T>* w,          \
                          const int32_t* targets, int N, int C, int V, int chunk, float* scratch, \
                          int w_rows) const override;                                             \
  void lm_head_ce_backward(T* dx, float* dw, const T* x, const GemmWeight<T>* w,                  \
                           const int32_t* targets, const float* lse, int N, int C, int V,         \
                           int chunk, float dloss, float* scratch, int w_rows) const override;
  HR_OPS_T(float)
  HR_OPS_T(bf16_t)
  HR_OPS_T(f16_t)
#undef HR_OPS_T
  // The LM head fused with CE + KL against a teacher, in chunks of tokens (distill.cu;
  // backend/cpu/distill_kernels.h is the reference).
#define HR_OPS_KD(T)                                                                               \
  void lm_head_kd_forward(float* losses, float* stats, const T* x, const GemmWeight<T>* w,         \
                          const KdTeacher& teacher, const int32_t* targets, int N, int C, int V,   \
                          int chunk, KdLoss kd, float* scratch, int w_rows) const override;        \
  void lm_head_kd_backward(T* dx, float* dw, const T* x, const GemmWeight<T>* w,                   \
                           const KdTeacher& teacher, const int32_t* targets, const float* stats,   \
                           int N, int C, int V, int chunk, KdLoss kd, float dloss, float* scratch, \
                           int w_rows) const override;
  HR_OPS_KD(float)
  HR_OPS_KD(bf16_t)
  HR_OPS_KD(f16_t)
#undef HR_OPS_KD
  // inv_freq[HS/2] and the cos/sin tables [T, HS/2] of positions pos0 .. pos0 + T - 1.
  void rope_inv_freq(float* inv_freq, int HS, float theta,
                     const RopeScaling& scaling) const override;
  void rope_table(float* cos, float* sin, const float* inv_freq, int HS, int pos0,
                  int T) const override;

  // ---- residual, loss over full logits, casts ----------------------------------------------
  void residual_forward(float* out, const float* a, const float* b, int64_t n) const override;
  void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                             int N, int V, int64_t ld) const override;
  void cross_entropy_backward_inplace(float* logits, const float* lse, const int32_t* targets,
                                      int N, int V, float dloss, DType storage,
                                      int64_t ld) const override;
  void cross_entropy_forward_backward_inplace(float* losses, float* lse, float* logits,
                                              const int32_t* targets, int N, int V, float dloss,
                                              DType storage, int64_t ld) const override;
  void cast_to_bf16(bf16_t* out, const float* inp, int64_t n) const override;
  void cast_to_f16(f16_t* out, const float* inp, int64_t n) const override;
  void round_to_f16_values(float* out, const float* inp, int64_t n) const override;
  void zero(float* x, int64_t n) const override;

  // ---- optimizer (fp32 master, m, v, grads) ------------------------------------------------
  // params, m, v updated in place from grads; with params_bf16 also the updated parameters
  // rounded to bf16 there; with zero_grads, grads[0, n) zeroed in the same pass.
  void adamw_update(float* params, float* grads, float* m, float* v, int64_t n,
                    const AdamWParams& p, bf16_t* params_bf16, bool zero_grads) const override;
  // Sum of squares in double precision (the global gradient norm), the same for any thread
  // count; a stream backend synchronizes to return it.
  double sum_squares(const float* x, int64_t n) const override;
  void scale_inplace(float* x, int64_t n, float s) const override;
  // x[i] = +0.0f where mask[i] == 0 (a sparsity mask; elementwise.cu).
  void apply_mask(const uint8_t* mask, float* x, int64_t n) const override;

 private:
  uint64_t copy_async(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                      cudaStream_t copy_stream) const;
  // REQUIRES: copy_mu_ held, the calling thread's current device ctx_.device.
  cudaEvent_t take_event_locked() const;

  Context ctx_;
  // The asynchronous copies' events: a free list, and the one recorded after each copy whose
  // ticket is not waited for yet.
  mutable std::mutex copy_mu_;
  mutable std::vector<cudaEvent_t> free_events_;
  mutable std::unordered_map<uint64_t, cudaEvent_t> pending_copies_;
  mutable uint64_t next_copy_ticket_ = 1;
};

}  // namespace headroom::backend::cuda
