// The backend op table: every kernel the transformer calls, as one interface over device pointers
// (the ggml-backend / llm.c idea: a small table of forward/backward ops, plus stream hooks). The
// model (src/model) calls kernels only through it and includes no backend's headers; backend/cpu
// implements it (cpu_ops()), backend/cuda will.
//
// Conventions are the CPU kernels' (backend/cpu/kernels.h, whose comments are the reference for
// each op's mathematics): parameter gradients ACCUMULATE, activation gradients are OVERWRITTEN
// unless stated, no op allocates (scratch comes from the caller, sized by the size functions
// below, which the planner calls), results do not depend on the thread count. Activations come
// in three storage types T: float, bf16_t and f16_t (mixed precision; docs/notes/
// mixed-precision.md); the residual stream, statistics, losses and parameter gradients are fp32.
// With T = f16_t, GEMM weights are fp32 holding f16 values (GemmWeight<f16_t> = float).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "core/check.h"
#include "core/dtype.h"

namespace headroom::backend {

enum class WeightLayout {
  kInOut,  // weight[IC, OC] row-major (GPT-2's Conv1D): out = inp @ weight
  kOutIn,  // weight[OC, IC] row-major (torch.nn.Linear, the LM head): out = inp @ weight^T
};
// Row strides (elements) of a matmul's activation operands; 0: dense. `inp` is inp's and dinp's,
// `out` out's and dout's.
struct MatmulStrides {
  int64_t inp = 0;
  int64_t out = 0;
};
// bf16 weight gradients through transposed operands (backend/cpu/kernels.h Bf16WgradStaging).
struct WgradStaging {
  bf16_t* inp_t = nullptr;
  size_t inp_t_elems = 0;
  bf16_t* out_t = nullptr;
  size_t out_t_elems = 0;
};
// Rotary embeddings' frequency scaling: none, or Llama 3's.
struct RopeScaling {
  enum class Kind { kNone, kLlama3 } kind = Kind::kNone;
  float factor = 1, low_freq_factor = 1, high_freq_factor = 4;
  int original_max_position_embeddings = 8192;
};

// ---- knowledge distillation (docs/notes/distillation.md) ----------------------------------
// The teacher's side of the fused LM head with a KD loss (Ops::lm_head_kd_*): its final hidden
// states (after its final norm) and its head's weight, both read only, in the teacher's own
// precision (independent of the student's storage type).
struct KdTeacher {
  const void* x = nullptr;    // [N, C] hidden states
  const void* w = nullptr;    // [V, C] head weight (kOutIn; the tied embedding)
  DType dtype = DType::kF32;  // of x and w: kF32 or kBF16
  int C = 0;                  // the teacher's width (may differ from the student's)
  int w_rows = 0;             // rows of w that may be read (>= V; 0 = V), as lm_head_ce's w_rows
  // Scratch: the teacher's chunk of logits, chunk x logits_row_stride(V) floats (the student's
  // chunk and its dlogits take lm_head_ce_scratch_floats in `scratch`, as the CE head's).
  float* logits_chunk = nullptr;
};
// loss = alpha * temperature^2 * KL(softmax(teacher / T) || softmax(student / T))
//        + (1 - alpha) * cross-entropy, per token with a target.
struct KdLoss {
  float alpha = 0.5f;
  float temperature = 2.0f;
  bool operator==(const KdLoss&) const = default;
};

// One AdamW step's hyper-parameters (torch.optim.AdamW semantics; backend/cpu/kernels.h).
struct AdamWParams {
  float lr = 0;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0;  // decoupled: param -= lr * weight_decay * param
  int step = 1;            // 1-based, for bias correction
  float grad_scale = 1;    // grads are multiplied by this first (clipping, loss-scale undo)
};

class Ops {
 public:
  virtual ~Ops() = default;
  virtual std::string_view name() const = 0;  // "cpu", "cuda"
  // Stream hook: every op queued so far has finished (the CPU runs each op to completion).
  virtual void synchronize() const {}

  // ---- where the ops' memory lives (docs/notes/device-trainer.md) ---------------------------
  // Whether the host may read and write the memory the ops take directly (the CPU's). False
  // (a GPU): the caller reaches that memory only through the ops, and through the copies below.
  virtual bool host_addressable() const = 0;
  // Whether `p` is the ops' memory rather than the host's (a non-null pointer; its bytes are not
  // read). The CPU: false (its memory is the host's). A device: whether the device's allocator
  // made it (dist::StagingCommunicator stages such buffers through host memory).
  virtual bool is_device_pointer(const void* p) const = 0;
  // Copies of `bytes` bytes between host memory and the ops' memory, ordered after every op
  // queued before them; each has finished, and its source may be reused, when it returns. The
  // CPU's are memcpy.
  virtual void copy_to_device(void* dst, const void* src, size_t bytes) const = 0;
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) const = 0;
  // Fills `bytes` bytes of the ops' memory with `value` (memset).
  virtual void fill_bytes(void* dst, int value, size_t bytes) const = 0;
  // Asynchronous copies (the offload tier's: docs/notes/device-trainer.md): ordered after every
  // op queued before them, and free to overlap the ops queued after them (a GPU runs them on
  // its d2h / h2d copy stream). Each returns a ticket for wait_copy; until wait_copy(ticket)
  // returns, neither side may be written nor the destination read, by the host or by an op.
  // wait_copy blocks until the copy has finished and orders every op queued after it after the
  // copy; it may be called from another thread than the copy's, once per ticket (0: returns).
  // The defaults copy synchronously and return 0 (the CPU's: memcpy).
  virtual uint64_t copy_to_host_async(void* dst, const void* src, size_t bytes) const {
    copy_to_host(dst, src, bytes);
    return 0;
  }
  virtual uint64_t copy_to_device_async(void* dst, const void* src, size_t bytes) const {
    copy_to_device(dst, src, bytes);
    return 0;
  }
  virtual void wait_copy(uint64_t ticket) const { (void)ticket; }
  // The sum over i < N with targets[i] >= 0 of losses[i] in double precision, and in *count how
  // many; both on the host (a stream backend synchronizes). losses and targets are the ops'
  // memory. The CPU adds in index order; every backend gives the same bits on every run.
  virtual double masked_loss_sum(const float* losses, const int32_t* targets, int N,
                                 int64_t* count) const = 0;

  // ---- sizes the planner plans (elements or floats; functions of shapes only) -------------
  virtual int64_t activation_row_stride(int64_t cols, int64_t elem_bytes) const = 0;
  virtual int64_t logits_row_stride(int64_t V) const = 0;
  virtual size_t attention_tiled_scratch_floats(int B, int T, int C, int NH, int NKV,
                                                DType storage) const = 0;
  virtual size_t attention_tiled_backward_scratch_floats(int B, int T, int C, int NH, int NKV,
                                                         DType storage) const = 0;
  virtual size_t attention_backward_scratch_floats(int B, int T, int NH, int NKV) const = 0;
  virtual size_t lm_head_ce_scratch_floats(int chunk, int V, DType storage) const = 0;
  virtual size_t f16_matmul_staging_floats(int64_t N, int64_t IC, int64_t OC) const = 0;
  // Whether the bf16 weight gradient of an [N, IC] x [IC, OC] matmul takes the staging.
  virtual bool bf16_wgrad_transposes(int N, int IC, int OC) const = 0;

  // ---- embedding (fp32): out = wte[tokens] (+ wpe[t] when wpe is not null) -----------------
  virtual void embedding_forward(float* out, const int32_t* tokens, const float* wte,
                                 const float* wpe, int B, int T, int C) const = 0;
  virtual void embedding_backward(float* dwte, float* dwpe, const float* dout,
                                  const int32_t* tokens, int B, int T, int C) const = 0;

  // ---- LayerNorm (eps 1e-5, as GPT-2) ------------------------------------------------------
#define HR_OPS_NORM(T)                                                                            \
  virtual void layernorm_forward(T* out, float* mean, float* rstd, const float* inp,              \
                                 const float* weight, const float* bias, int N, int C) const = 0; \
  virtual void layernorm_backward(float* dinp, float* dweight, float* dbias, const T* dout,       \
                                  const float* inp, const float* weight, const float* mean,       \
                                  const float* rstd, int N, int C) const = 0;                     \
  virtual void rmsnorm_forward(T* out, float* rstd, const float* inp, const float* weight, int N, \
                               int C, float eps) const = 0;                                       \
  virtual void rmsnorm_backward(float* dinp, float* dweight, const T* dout, const float* inp,     \
                                const float* weight, const float* rstd, int N, int C) const = 0;
  HR_OPS_NORM(float)
  HR_OPS_NORM(bf16_t)
  HR_OPS_NORM(f16_t)
#undef HR_OPS_NORM
  // 16-bit: also the updated dinp rounded into dinp_low[N, C], in the same pass.
#define HR_OPS_NORM_LOW(T)                                                                       \
  virtual void layernorm_backward(float* dinp, T* dinp_low, float* dweight, float* dbias,        \
                                  const T* dout, const float* inp, const float* weight,          \
                                  const float* mean, const float* rstd, int N, int C) const = 0; \
  virtual void rmsnorm_backward(float* dinp, T* dinp_low, float* dweight, const T* dout,         \
                                const float* inp, const float* weight, const float* rstd, int N, \
                                int C) const = 0;
  HR_OPS_NORM_LOW(bf16_t)
  HR_OPS_NORM_LOW(f16_t)
#undef HR_OPS_NORM_LOW

  // ---- matmul: out[N,OC] = inp[N,IC] x weight (+ bias) --------------------------------------
  virtual void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                              int N, int IC, int OC, WeightLayout layout,
                              MatmulStrides strides) const = 0;
  virtual void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                               const float* inp, const float* weight, int N, int IC, int OC,
                               WeightLayout layout, MatmulStrides strides) const = 0;
  virtual void matmul_forward(float* out, const bf16_t* inp, const bf16_t* weight,
                              const float* bias, int N, int IC, int OC, WeightLayout layout,
                              MatmulStrides strides) const = 0;
  virtual void matmul_forward(bf16_t* out, const bf16_t* inp, const bf16_t* weight,
                              const float* bias, int N, int IC, int OC, WeightLayout layout,
                              MatmulStrides strides) const = 0;
  // An empty staging: no transposed operands.
  virtual void matmul_backward(bf16_t* dinp, float* dweight, float* dbias, const bf16_t* dout,
                               const bf16_t* inp, const bf16_t* weight, int N, int IC, int OC,
                               WeightLayout layout, MatmulStrides strides,
                               const WgradStaging& staging) const = 0;
  virtual void matmul_forward(float* out, const f16_t* inp, const float* weight, const float* bias,
                              int N, int IC, int OC, WeightLayout layout,
                              MatmulStrides strides) const = 0;
  virtual void matmul_forward(f16_t* out, const f16_t* inp, const float* weight, const float* bias,
                              int N, int IC, int OC, WeightLayout layout,
                              MatmulStrides strides) const = 0;
  virtual void matmul_backward(f16_t* dinp, float* dweight, float* dbias, const f16_t* dout,
                               const f16_t* inp, const float* weight, int N, int IC, int OC,
                               WeightLayout layout, MatmulStrides strides) const = 0;
  // The LM head's backward in f16: dout is fp32 holding f16 values.
  virtual void matmul_backward(f16_t* dinp, float* dweight, float* dbias, const float* dout,
                               const f16_t* inp, const float* weight, int N, int IC, int OC,
                               WeightLayout layout, MatmulStrides strides) const = 0;
  // The f16 GEMMs' staging area for the ops that follow on this thread (0 floats: unbind);
  // returns the previous binding through prev/prev_floats.
  virtual void bind_f16_staging(float* area, size_t floats, float** prev,
                                size_t* prev_floats) const = 0;

  // ---- causal self-attention ----------------------------------------------------------------
  // qkv[B,T,(NH+2 NKV) HS]: q heads, then k heads, then v heads; query head h reads kv head
  // h / (NH / NKV); out[B,T,C], HS = C / NH. Plain (fp32): att[B,NH,T,T] keeps the probabilities.
  virtual void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C,
                                 int NH, int NKV) const = 0;
  virtual void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                                  const float* att, int B, int T, int C, int NH, int NKV) const = 0;
  // Generation with a KV cache (fp32): appends the k and v heads of qkv[rows, (NH + 2 NKV) HS]
  // (positions pos0 .. pos0 + rows - 1) to k_cache / v_cache[NKV, context, HS], then attends
  // each row over every cached position up to its own; out[rows, NH HS].
  virtual void attention_cached_forward(float* out, float* k_cache, float* v_cache,
                                        const float* qkv, int rows, int pos0, int context, int NH,
                                        int NKV, int HS) const = 0;
  virtual int max_cached_head_size() const = 0;
  // Tiled (online softmax): lse[B,NH,T] instead of the probabilities.
#define HR_OPS_T(T)                                                                               \
  virtual void attention_tiled_forward(T* out, float* lse, const T* qkv, int B, int T_, int C,    \
                                       int NH, int NKV, float* scratch) const = 0;                \
  virtual void attention_tiled_backward(T* dqkv, const T* dout, const T* qkv, const T* out,       \
                                        const float* lse, int B, int T_, int C, int NH, int NKV,  \
                                        float* scratch) const = 0;                                \
  /* GELU (tanh); dinp may alias dout */                                                          \
  virtual void gelu_forward(T* out, const T* inp, int64_t n) const = 0;                           \
  virtual void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) const = 0;          \
  /* SwiGLU: gu[N, 2I] = gate | up (row stride ld_gu); out = silu(gate) * up; dgu may alias gu */ \
  virtual void swiglu_forward(T* out, const T* gu, int64_t N, int64_t I, int64_t ld_out,          \
                              int64_t ld_gu) const = 0;                                           \
  virtual void swiglu_backward(T* dgu, const T* gu, const T* dout, int64_t N, int64_t I,          \
                               int64_t ld_gu, int64_t ld_dout) const = 0;                         \
  /* Rotary embeddings in place on qkv's q and k heads (rotate_half pairs); cos/sin [T, HS/2] */  \
  virtual void rope_forward(T* qkv, const float* cos, const float* sin, int B, int T_, int NH,    \
                            int NKV, int HS) const = 0;                                           \
  virtual void rope_backward(T* dqkv, const float* cos, const float* sin, int B, int T_, int NH,  \
                             int NKV, int HS) const = 0;                                          \
  /* The LM head fused with cross-entropy, in chunks of tokens (fused_kernels.h) */               \
  virtual void lm_head_ce_forward(float* losses, float* lse, const T* x, const GemmWeight<T>* w,  \
                                  const int32_t* targets, int N, int C, int V, int chunk,         \
                                  float* scratch, int w_rows) const = 0;                          \
  virtual void lm_head_ce_backward(T* dx, float* dw, const T* x, const GemmWeight<T>* w,          \
                                   const int32_t* targets, const float* lse, int N, int C, int V, \
                                   int chunk, float dloss, float* scratch, int w_rows) const = 0;
  template <typename T>
  using GemmWeight = std::conditional_t<std::is_same_v<T, f16_t>, float, T>;
  HR_OPS_T(float)
  HR_OPS_T(bf16_t)
  HR_OPS_T(f16_t)
#undef HR_OPS_T

  // ---- knowledge distillation: the LM head fused with CE + KL against a teacher ------------
  // (backend/cpu/distill_kernels.h is the reference for the mathematics.) Per chunk of `chunk`
  // tokens both models' logits are computed into scratch, reduced and gone before the next
  // chunk: neither N x V logits tensor exists. losses[N] the combined per-token loss; stats[4N]:
  // logsumexp(student), logsumexp(student / T), logsumexp(teacher / T), the CE alone. The
  // backward recomputes both chunks and writes dx (OVERWRITTEN) and dw (ACCUMULATES) from
  // dloss * d(sum losses); the teacher gets no gradient. alpha = 0 gives lm_head_ce's bits.
  // scratch: lm_head_ce_scratch_floats(chunk, V, storage), as the CE head; the teacher's chunk
  // of logits in teacher.logits_chunk.
#define HR_OPS_KD(T)                                                                               \
  virtual void lm_head_kd_forward(float* losses, float* stats, const T* x, const GemmWeight<T>* w, \
                                  const KdTeacher& teacher, const int32_t* targets, int N, int C,  \
                                  int V, int chunk, KdLoss kd, float* scratch, int w_rows)         \
      const = 0;                                                                                   \
  virtual void lm_head_kd_backward(T* dx, float* dw, const T* x, const GemmWeight<T>* w,           \
                                   const KdTeacher& teacher, const int32_t* targets,               \
                                   const float* stats, int N, int C, int V, int chunk, KdLoss kd,  \
                                   float dloss, float* scratch, int w_rows) const = 0;
  HR_OPS_KD(float)
  HR_OPS_KD(bf16_t)
  HR_OPS_KD(f16_t)
#undef HR_OPS_KD
  // inv_freq[HS/2] and the cos/sin tables [T, HS/2] of positions pos0 .. pos0 + T - 1.
  virtual void rope_inv_freq(float* inv_freq, int HS, float theta,
                             const RopeScaling& scaling) const = 0;
  virtual void rope_table(float* cos, float* sin, const float* inv_freq, int HS, int pos0,
                          int T) const = 0;

  // ---- residual, loss over full logits, casts ----------------------------------------------
  virtual void residual_forward(float* out, const float* a, const float* b, int64_t n) const = 0;
  virtual void cross_entropy_forward(float* losses, float* lse, const float* logits,
                                     const int32_t* targets, int N, int V, int64_t ld) const = 0;
  virtual void cross_entropy_backward_inplace(float* logits, const float* lse,
                                              const int32_t* targets, int N, int V, float dloss,
                                              DType storage, int64_t ld) const = 0;
  virtual void cross_entropy_forward_backward_inplace(float* losses, float* lse, float* logits,
                                                      const int32_t* targets, int N, int V,
                                                      float dloss, DType storage,
                                                      int64_t ld) const = 0;
  virtual void cast_to_bf16(bf16_t* out, const float* inp, int64_t n) const = 0;
  virtual void cast_to_f16(f16_t* out, const float* inp, int64_t n) const = 0;
  virtual void round_to_f16_values(float* out, const float* inp, int64_t n) const = 0;
  virtual void zero(float* x, int64_t n) const = 0;

  // ---- optimizer (fp32 master, m, v, grads) ------------------------------------------------
  // params, m, v updated in place from grads; with params_bf16 also the updated parameters
  // rounded to bf16 there; with zero_grads, grads[0, n) zeroed in the same pass.
  virtual void adamw_update(float* params, float* grads, float* m, float* v, int64_t n,
                            const AdamWParams& p, bf16_t* params_bf16, bool zero_grads) const = 0;
  // Sum of squares in double precision (the global gradient norm), the same for any thread
  // count; a stream backend synchronizes to return it.
  virtual double sum_squares(const float* x, int64_t n) const = 0;
  virtual void scale_inplace(float* x, int64_t n, float s) const = 0;
  // A sparsity mask (docs/notes/pruning.md): x[i] = +0.0f where mask[i] == 0, for i < n; the
  // other elements untouched (bits kept, NaN included). mask holds one byte per float of x (a
  // parameter-shaped buffer: weights, gradients, AdamW's moments); both are the ops' memory.
  virtual void apply_mask(const uint8_t* mask, float* x, int64_t n) const = 0;
};

// The f16 GEMM staging of a scope (Ops::bind_f16_staging), restored when it ends.
class F16StagingScope {
 public:
  F16StagingScope(const Ops& ops, float* area, size_t floats) : ops_(ops) {
    ops_.bind_f16_staging(area, floats, &prev_, &prev_floats_);
  }
  ~F16StagingScope() {
    float* p;
    size_t n;
    ops_.bind_f16_staging(prev_, prev_floats_, &p, &n);
  }
  F16StagingScope(const F16StagingScope&) = delete;
  F16StagingScope& operator=(const F16StagingScope&) = delete;

 private:
  const Ops& ops_;
  float* prev_ = nullptr;
  size_t prev_floats_ = 0;
};

// The CPU backend (backend/cpu/cpu_ops.cc): the process's one instance.
const Ops& cpu_ops();

}  // namespace headroom::backend
