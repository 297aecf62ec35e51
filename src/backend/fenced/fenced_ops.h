// The fenced device's op table (docs/notes/fenced-device.md): another table's ops (the CPU's by
// default) over a FencedResource's memory, each run with the resource's window open, and
// host_addressable() false. A caller that treats it as a GPU (reaching its memory only through
// the ops and their copies) runs exactly as on the inner table; one that touches a fenced block
// itself dies with SIGSEGV at that instruction. So a CPU-only machine proves that the trainer's
// device path never reads or writes device memory from the host.
//
// Every op forwards to the inner table unchanged (the same bits). The size functions and the f16
// staging binding touch no memory and forward without a window. The other way round, an op's
// device operands must be the resource's memory (a GPU kernel cannot read host memory either):
// each pointer operand is checked to lie in a live block, and the copies' and fills' whole
// device ranges; a host pointer given to an op aborts naming the op. Thread safety: as the inner
// table's; the windows nest and are counted by the resource, and while one is open every
// thread may touch the blocks (mprotect is process-wide).
//
// The asynchronous copies are deferred: each is made at its wait_copy, not at its call. A GPU's
// copy stream may run the copy any time in between, so that is the latest it may land and read
// its source; a caller that reads the destination, or reuses the source, before waiting gets
// stale or later bytes here (and a test comparing with the CPU fails), as it could on a GPU.
#pragma once

#include <cstdint>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "backend/fenced/fenced_resource.h"
#include "backend/ops.h"

namespace headroom::backend {

class FencedOps final : public Ops {
 private:
  // Runs `f` (op `op` of the inner table) with the resource's memory open, after checking that
  // each pointer among `args` (the op's device operands) is null or inside a live block: a
  // device op given host memory (which a GPU could not read) aborts, naming the op.
  template <typename F, typename... A>
  auto in_window(const char* op, F&& f, const A&... args) const {
    (void)op;  // an op without pointer operands checks nothing
    (check_operand(op, args), ...);
    FencedResource::Window window(resource_);
    return f();
  }
  template <typename A>
  void check_operand(const char* op, const A& a) const {
    if constexpr (std::is_pointer_v<A>) {
      if (a != nullptr && !resource_->contains(a)) operand_not_on_device(op, a, 1);
    } else if constexpr (std::is_same_v<A, WgradStaging>) {
      check_operand(op, a.inp_t);
      check_operand(op, a.out_t);
    } else if constexpr (std::is_same_v<A, KdTeacher>) {
      check_operand(op, a.x);
      check_operand(op, a.w);
      check_operand(op, a.logits_chunk);
    }
  }
  // [p, p + bytes) inside one live block (a copy's or a fill's device side).
  void check_range(const char* op, const void* p, size_t bytes) const {
    if (bytes > 0 && !resource_->contains(p, bytes)) operand_not_on_device(op, p, bytes);
  }
  [[noreturn]] static void operand_not_on_device(const char* op, const void* p, size_t bytes);

 public:
  // REQUIRES: `resource` and `inner` outlive this table.
  explicit FencedOps(FencedResource* resource, const Ops& inner = cpu_ops())
      : resource_(resource), inner_(inner) {}

  FencedResource* resource() const { return resource_; }
  const Ops& inner() const { return inner_; }

  std::string_view name() const override { return "fenced"; }
  void synchronize() const override { inner_.synchronize(); }

  bool host_addressable() const override { return false; }
  bool is_device_pointer(const void* p) const override { return resource_->contains(p); }
  void copy_to_device(void* dst, const void* src, size_t bytes) const override {
    check_range("copy_to_device", dst, bytes);
    return in_window("copy_to_device", [&] { return inner_.copy_to_device(dst, src, bytes); });
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) const override {
    check_range("copy_to_host", src, bytes);
    return in_window("copy_to_host", [&] { return inner_.copy_to_host(dst, src, bytes); });
  }
  // Deferred to wait_copy (see the top of this file); the device range is checked now.
  uint64_t copy_to_host_async(void* dst, const void* src, size_t bytes) const override {
    check_range("copy_to_host_async", src, bytes);
    return defer({dst, src, bytes, /*to_host=*/true});
  }
  uint64_t copy_to_device_async(void* dst, const void* src, size_t bytes) const override {
    check_range("copy_to_device_async", dst, bytes);
    return defer({dst, src, bytes, /*to_host=*/false});
  }
  // Makes the ticket's copy (ticket 0: nothing). Any thread may wait a ticket, once.
  void wait_copy(uint64_t ticket) const override;
  // Copies issued and not yet waited (for tests).
  size_t pending_copies() const {
    std::lock_guard<std::mutex> lock(copy_mu_);
    return pending_.size();
  }
  void fill_bytes(void* dst, int value, size_t bytes) const override {
    check_range("fill_bytes", dst, bytes);
    return in_window("fill_bytes", [&] { return inner_.fill_bytes(dst, value, bytes); });
  }
  double masked_loss_sum(const float* losses, const int32_t* targets, int N,
                         int64_t* count) const override {
    return in_window(
        "masked_loss_sum", [&] { return inner_.masked_loss_sum(losses, targets, N, count); },
        losses, targets, N);
  }

  // ---- sizes: functions of shapes only, no window ----
  int64_t activation_row_stride(int64_t cols, int64_t elem_bytes) const override {
    return inner_.activation_row_stride(cols, elem_bytes);
  }
  int64_t logits_row_stride(int64_t V) const override { return inner_.logits_row_stride(V); }
  size_t attention_tiled_scratch_floats(int B, int T, int C, int NH, int NKV,
                                        DType storage) const override {
    return inner_.attention_tiled_scratch_floats(B, T, C, NH, NKV, storage);
  }
  size_t attention_tiled_backward_scratch_floats(int B, int T, int C, int NH, int NKV,
                                                 DType storage) const override {
    return inner_.attention_tiled_backward_scratch_floats(B, T, C, NH, NKV, storage);
  }
  size_t attention_backward_scratch_floats(int B, int T, int NH, int NKV) const override {
    return inner_.attention_backward_scratch_floats(B, T, NH, NKV);
  }
  size_t lm_head_ce_scratch_floats(int chunk, int V, DType storage) const override {
    return inner_.lm_head_ce_scratch_floats(chunk, V, storage);
  }
  size_t f16_matmul_staging_floats(int64_t N, int64_t IC, int64_t OC) const override {
    return inner_.f16_matmul_staging_floats(N, IC, OC);
  }
  bool bf16_wgrad_transposes(int N, int IC, int OC) const override {
    return inner_.bf16_wgrad_transposes(N, IC, OC);
  }
  int max_cached_head_size() const override { return inner_.max_cached_head_size(); }
  // A binding for the ops that follow: it records pointers and touches nothing.
  void bind_f16_staging(float* area, size_t floats, float** prev,
                        size_t* prev_floats) const override {
    check_operand("bind_f16_staging", area);
    inner_.bind_f16_staging(area, floats, prev, prev_floats);
  }

  // ---- the ops ----
  void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                         int B, int T, int C) const override {
    return in_window(
        "embedding_forward",
        [&] { return inner_.embedding_forward(out, tokens, wte, wpe, B, T, C); }, out, tokens, wte,
        wpe, B, T, C);
  }
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                          int T, int C) const override {
    return in_window(
        "embedding_backward",
        [&] { return inner_.embedding_backward(dwte, dwpe, dout, tokens, B, T, C); }, dwte, dwpe,
        dout, tokens, B, T, C);
  }

#define HR_FENCED_NORM(T)                                                                          \
  void layernorm_forward(T* out, float* mean, float* rstd, const float* inp, const float* weight,  \
                         const float* bias, int N, int C) const override {                         \
    return in_window(                                                                              \
        "layernorm_forward",                                                                       \
        [&] { return inner_.layernorm_forward(out, mean, rstd, inp, weight, bias, N, C); }, out,   \
        mean, rstd, inp, weight, bias, N, C);                                                      \
  }                                                                                                \
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const T* dout,                \
                          const float* inp, const float* weight, const float* mean,                \
                          const float* rstd, int N, int C) const override {                        \
    return in_window(                                                                              \
        "layernorm_backward",                                                                      \
        [&] {                                                                                      \
          return inner_.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, \
                                           C);                                                     \
        },                                                                                         \
        dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);                                \
  }                                                                                                \
  void rmsnorm_forward(T* out, float* rstd, const float* inp, const float* weight, int N, int C,   \
                       float eps) const override {                                                 \
    return in_window(                                                                              \
        "rmsnorm_forward",                                                                         \
        [&] { return inner_.rmsnorm_forward(out, rstd, inp, weight, N, C, eps); }, out, rstd, inp, \
        weight, N, C, eps);                                                                        \
  }                                                                                                \
  void rmsnorm_backward(float* dinp, float* dweight, const T* dout, const float* inp,              \
                        const float* weight, const float* rstd, int N, int C) const override {     \
    return in_window(                                                                              \
        "rmsnorm_backward",                                                                        \
        [&] { return inner_.rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C); },     \
        dinp, dweight, dout, inp, weight, rstd, N, C);                                             \
  }
  HR_FENCED_NORM(float)
  HR_FENCED_NORM(bf16_t)
  HR_FENCED_NORM(f16_t)
#undef HR_FENCED_NORM
#define HR_FENCED_NORM_LOW(T)                                                                      \
  void layernorm_backward(float* dinp, T* dinp_low, float* dweight, float* dbias, const T* dout,   \
                          const float* inp, const float* weight, const float* mean,                \
                          const float* rstd, int N, int C) const override {                        \
    return in_window(                                                                              \
        "layernorm_backward",                                                                      \
        [&] {                                                                                      \
          return inner_.layernorm_backward(dinp, dinp_low, dweight, dbias, dout, inp, weight,      \
                                           mean, rstd, N, C);                                      \
        },                                                                                         \
        dinp, dinp_low, dweight, dbias, dout, inp, weight, mean, rstd, N, C);                      \
  }                                                                                                \
  void rmsnorm_backward(float* dinp, T* dinp_low, float* dweight, const T* dout, const float* inp, \
                        const float* weight, const float* rstd, int N, int C) const override {     \
    return in_window(                                                                              \
        "rmsnorm_backward",                                                                        \
        [&] {                                                                                      \
          return inner_.rmsnorm_backward(dinp, dinp_low, dweight, dout, inp, weight, rstd, N, C);  \
        },                                                                                         \
        dinp, dinp_low, dweight, dout, inp, weight, rstd, N, C);                                   \
  }
  HR_FENCED_NORM_LOW(bf16_t)
  HR_FENCED_NORM_LOW(f16_t)
#undef HR_FENCED_NORM_LOW

  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                      int IC, int OC, WeightLayout layout, MatmulStrides st) const override {
    return in_window(
        "matmul_forward",
        [&] { return inner_.matmul_forward(out, inp, weight, bias, N, IC, OC, layout, st); }, out,
        inp, weight, bias, N, IC, OC, layout, st);
  }
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, int N, int IC, int OC,
                       WeightLayout layout, MatmulStrides st) const override {
    return in_window(
        "matmul_backward",
        [&] {
          return inner_.matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout,
                                        st);
        },
        dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout, st);
  }
  void matmul_forward(float* out, const bf16_t* inp, const bf16_t* weight, const float* bias, int N,
                      int IC, int OC, WeightLayout layout, MatmulStrides st) const override {
    return in_window(
        "matmul_forward",
        [&] { return inner_.matmul_forward(out, inp, weight, bias, N, IC, OC, layout, st); }, out,
        inp, weight, bias, N, IC, OC, layout, st);
  }
  void matmul_forward(bf16_t* out, const bf16_t* inp, const bf16_t* weight, const float* bias,
                      int N, int IC, int OC, WeightLayout layout, MatmulStrides st) const override {
    return in_window(
        "matmul_forward",
        [&] { return inner_.matmul_forward(out, inp, weight, bias, N, IC, OC, layout, st); }, out,
        inp, weight, bias, N, IC, OC, layout, st);
  }
  void matmul_backward(bf16_t* dinp, float* dweight, float* dbias, const bf16_t* dout,
                       const bf16_t* inp, const bf16_t* weight, int N, int IC, int OC,
                       WeightLayout layout, MatmulStrides st,
                       const WgradStaging& staging) const override {
    return in_window(
        "matmul_backward",
        [&] {
          return inner_.matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout,
                                        st, staging);
        },
        dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout, st, staging);
  }
  void matmul_forward(float* out, const f16_t* inp, const float* weight, const float* bias, int N,
                      int IC, int OC, WeightLayout layout, MatmulStrides st) const override {
    return in_window(
        "matmul_forward",
        [&] { return inner_.matmul_forward(out, inp, weight, bias, N, IC, OC, layout, st); }, out,
        inp, weight, bias, N, IC, OC, layout, st);
  }
  void matmul_forward(f16_t* out, const f16_t* inp, const float* weight, const float* bias, int N,
                      int IC, int OC, WeightLayout layout, MatmulStrides st) const override {
    return in_window(
        "matmul_forward",
        [&] { return inner_.matmul_forward(out, inp, weight, bias, N, IC, OC, layout, st); }, out,
        inp, weight, bias, N, IC, OC, layout, st);
  }
  void matmul_backward(f16_t* dinp, float* dweight, float* dbias, const f16_t* dout,
                       const f16_t* inp, const float* weight, int N, int IC, int OC,
                       WeightLayout layout, MatmulStrides st) const override {
    return in_window(
        "matmul_backward",
        [&] {
          return inner_.matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout,
                                        st);
        },
        dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout, st);
  }
  void matmul_backward(f16_t* dinp, float* dweight, float* dbias, const float* dout,
                       const f16_t* inp, const float* weight, int N, int IC, int OC,
                       WeightLayout layout, MatmulStrides st) const override {
    return in_window(
        "matmul_backward",
        [&] {
          return inner_.matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout,
                                        st);
        },
        dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout, st);
  }

  void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                         int NKV) const override {
    return in_window(
        "attention_forward",
        [&] { return inner_.attention_forward(out, att, qkv, B, T, C, NH, NKV); }, out, att, qkv, B,
        T, C, NH, NKV);
  }
  void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                          const float* att, int B, int T, int C, int NH, int NKV) const override {
    return in_window(
        "attention_backward",
        [&] { return inner_.attention_backward(dqkv, scratch, dout, qkv, att, B, T, C, NH, NKV); },
        dqkv, scratch, dout, qkv, att, B, T, C, NH, NKV);
  }
  void attention_cached_forward(float* out, float* k_cache, float* v_cache, const float* qkv,
                                int rows, int pos0, int context, int NH, int NKV,
                                int HS) const override {
    return in_window(
        "attention_cached_forward",
        [&] {
          return inner_.attention_cached_forward(out, k_cache, v_cache, qkv, rows, pos0, context,
                                                 NH, NKV, HS);
        },
        out, k_cache, v_cache, qkv, rows, pos0, context, NH, NKV, HS);
  }

#define HR_FENCED_T(T)                                                                             \
  void attention_tiled_forward(T* out, float* lse, const T* qkv, int B, int T_, int C, int NH,     \
                               int NKV, float* scratch) const override {                           \
    return in_window(                                                                              \
        "attention_tiled_forward",                                                                 \
        [&] { return inner_.attention_tiled_forward(out, lse, qkv, B, T_, C, NH, NKV, scratch); }, \
        out, lse, qkv, B, T_, C, NH, NKV, scratch);                                                \
  }                                                                                                \
  void attention_tiled_backward(T* dqkv, const T* dout, const T* qkv, const T* out,                \
                                const float* lse, int B, int T_, int C, int NH, int NKV,           \
                                float* scratch) const override {                                   \
    return in_window(                                                                              \
        "attention_tiled_backward",                                                                \
        [&] {                                                                                      \
          return inner_.attention_tiled_backward(dqkv, dout, qkv, out, lse, B, T_, C, NH, NKV,     \
                                                 scratch);                                         \
        },                                                                                         \
        dqkv, dout, qkv, out, lse, B, T_, C, NH, NKV, scratch);                                    \
  }                                                                                                \
  void gelu_forward(T* out, const T* inp, int64_t n) const override {                              \
    return in_window(                                                                              \
        "gelu_forward", [&] { return inner_.gelu_forward(out, inp, n); }, out, inp, n);            \
  }                                                                                                \
  void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) const override {             \
    return in_window(                                                                              \
        "gelu_backward", [&] { return inner_.gelu_backward(dinp, inp, dout, n); }, dinp, inp,      \
        dout, n);                                                                                  \
  }                                                                                                \
  void swiglu_forward(T* out, const T* gu, int64_t N, int64_t I, int64_t ld_out, int64_t ld_gu)    \
      const override {                                                                             \
    return in_window(                                                                              \
        "swiglu_forward", [&] { return inner_.swiglu_forward(out, gu, N, I, ld_out, ld_gu); },     \
        out, gu, N, I, ld_out, ld_gu);                                                             \
  }                                                                                                \
  void swiglu_backward(T* dgu, const T* gu, const T* dout, int64_t N, int64_t I, int64_t ld_gu,    \
                       int64_t ld_dout) const override {                                           \
    return in_window(                                                                              \
        "swiglu_backward",                                                                         \
        [&] { return inner_.swiglu_backward(dgu, gu, dout, N, I, ld_gu, ld_dout); }, dgu, gu,      \
        dout, N, I, ld_gu, ld_dout);                                                               \
  }                                                                                                \
  void rope_forward(T* qkv, const float* cos, const float* sin, int B, int T_, int NH, int NKV,    \
                    int HS) const override {                                                       \
    return in_window(                                                                              \
        "rope_forward", [&] { return inner_.rope_forward(qkv, cos, sin, B, T_, NH, NKV, HS); },    \
        qkv, cos, sin, B, T_, NH, NKV, HS);                                                        \
  }                                                                                                \
  void rope_backward(T* dqkv, const float* cos, const float* sin, int B, int T_, int NH, int NKV,  \
                     int HS) const override {                                                      \
    return in_window(                                                                              \
        "rope_backward", [&] { return inner_.rope_backward(dqkv, cos, sin, B, T_, NH, NKV, HS); }, \
        dqkv, cos, sin, B, T_, NH, NKV, HS);                                                       \
  }                                                                                                \
  void lm_head_ce_forward(float* losses, float* lse, const T* x, const GemmWeight<T>* w,           \
                          const int32_t* targets, int N, int C, int V, int chunk, float* scratch,  \
                          int w_rows) const override {                                             \
    return in_window(                                                                              \
        "lm_head_ce_forward",                                                                      \
        [&] {                                                                                      \
          return inner_.lm_head_ce_forward(losses, lse, x, w, targets, N, C, V, chunk, scratch,    \
                                           w_rows);                                                \
        },                                                                                         \
        losses, lse, x, w, targets, N, C, V, chunk, scratch, w_rows);                              \
  }                                                                                                \
  void lm_head_ce_backward(T* dx, float* dw, const T* x, const GemmWeight<T>* w,                   \
                           const int32_t* targets, const float* lse, int N, int C, int V,          \
                           int chunk, float dloss, float* scratch, int w_rows) const override {    \
    return in_window(                                                                              \
        "lm_head_ce_backward",                                                                     \
        [&] {                                                                                      \
          return inner_.lm_head_ce_backward(dx, dw, x, w, targets, lse, N, C, V, chunk, dloss,     \
                                            scratch, w_rows);                                      \
        },                                                                                         \
        dx, dw, x, w, targets, lse, N, C, V, chunk, dloss, scratch, w_rows);                       \
  }
  HR_FENCED_T(float)
  HR_FENCED_T(bf16_t)
  HR_FENCED_T(f16_t)
#undef HR_FENCED_T

#define HR_FENCED_KD(T)                                                                            \
  void lm_head_kd_forward(float* losses, float* stats, const T* x, const GemmWeight<T>* w,         \
                          const KdTeacher& teacher, const int32_t* targets, int N, int C, int V,   \
                          int chunk, KdLoss kd, float* scratch, int w_rows) const override {       \
    return in_window(                                                                              \
        "lm_head_kd_forward",                                                                      \
        [&] {                                                                                      \
          return inner_.lm_head_kd_forward(losses, stats, x, w, teacher, targets, N, C, V, chunk,  \
                                           kd, scratch, w_rows);                                   \
        },                                                                                         \
        losses, stats, x, w, teacher, targets, N, C, V, chunk, kd, scratch, w_rows);               \
  }                                                                                                \
  void lm_head_kd_backward(T* dx, float* dw, const T* x, const GemmWeight<T>* w,                   \
                           const KdTeacher& teacher, const int32_t* targets, const float* stats,   \
                           int N, int C, int V, int chunk, KdLoss kd, float dloss, float* scratch, \
                           int w_rows) const override {                                            \
    return in_window(                                                                              \
        "lm_head_kd_backward",                                                                     \
        [&] {                                                                                      \
          return inner_.lm_head_kd_backward(dx, dw, x, w, teacher, targets, stats, N, C, V, chunk, \
                                            kd, dloss, scratch, w_rows);                           \
        },                                                                                         \
        dx, dw, x, w, teacher, targets, stats, N, C, V, chunk, kd, dloss, scratch, w_rows);        \
  }
  HR_FENCED_KD(float)
  HR_FENCED_KD(bf16_t)
  HR_FENCED_KD(f16_t)
#undef HR_FENCED_KD

  void rope_inv_freq(float* inv_freq, int HS, float theta, const RopeScaling& s) const override {
    return in_window(
        "rope_inv_freq", [&] { return inner_.rope_inv_freq(inv_freq, HS, theta, s); }, inv_freq, HS,
        theta, s);
  }
  void rope_table(float* cos, float* sin, const float* inv_freq, int HS, int pos0,
                  int T) const override {
    return in_window(
        "rope_table", [&] { return inner_.rope_table(cos, sin, inv_freq, HS, pos0, T); }, cos, sin,
        inv_freq, HS, pos0, T);
  }

  void residual_forward(float* out, const float* a, const float* b, int64_t n) const override {
    return in_window(
        "residual_forward", [&] { return inner_.residual_forward(out, a, b, n); }, out, a, b, n);
  }
  void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                             int N, int V, int64_t ld) const override {
    return in_window(
        "cross_entropy_forward",
        [&] { return inner_.cross_entropy_forward(losses, lse, logits, targets, N, V, ld); },
        losses, lse, logits, targets, N, V, ld);
  }
  void cross_entropy_backward_inplace(float* logits, const float* lse, const int32_t* targets,
                                      int N, int V, float dloss, DType storage,
                                      int64_t ld) const override {
    return in_window(
        "cross_entropy_backward_inplace",
        [&] {
          return inner_.cross_entropy_backward_inplace(logits, lse, targets, N, V, dloss, storage,
                                                       ld);
        },
        logits, lse, targets, N, V, dloss, storage, ld);
  }
  void cross_entropy_forward_backward_inplace(float* losses, float* lse, float* logits,
                                              const int32_t* targets, int N, int V, float dloss,
                                              DType storage, int64_t ld) const override {
    return in_window(
        "cross_entropy_forward_backward_inplace",
        [&] {
          return inner_.cross_entropy_forward_backward_inplace(losses, lse, logits, targets, N, V,
                                                               dloss, storage, ld);
        },
        losses, lse, logits, targets, N, V, dloss, storage, ld);
  }
  void cast_to_bf16(bf16_t* out, const float* inp, int64_t n) const override {
    return in_window(
        "cast_to_bf16", [&] { return inner_.cast_to_bf16(out, inp, n); }, out, inp, n);
  }
  void cast_to_f16(f16_t* out, const float* inp, int64_t n) const override {
    return in_window(
        "cast_to_f16", [&] { return inner_.cast_to_f16(out, inp, n); }, out, inp, n);
  }
  void round_to_f16_values(float* out, const float* inp, int64_t n) const override {
    return in_window(
        "round_to_f16_values", [&] { return inner_.round_to_f16_values(out, inp, n); }, out, inp,
        n);
  }
  void zero(float* x, int64_t n) const override {
    return in_window(
        "zero", [&] { return inner_.zero(x, n); }, x, n);
  }

  void adamw_update(float* params, float* grads, float* m, float* v, int64_t n,
                    const AdamWParams& p, bf16_t* params_bf16, bool zero_grads) const override {
    return in_window(
        "adamw_update",
        [&] { return inner_.adamw_update(params, grads, m, v, n, p, params_bf16, zero_grads); },
        params, grads, m, v, n, p, params_bf16, zero_grads);
  }
  double sum_squares(const float* x, int64_t n) const override {
    return in_window(
        "sum_squares", [&] { return inner_.sum_squares(x, n); }, x, n);
  }
  void scale_inplace(float* x, int64_t n, float s) const override {
    return in_window(
        "scale_inplace", [&] { return inner_.scale_inplace(x, n, s); }, x, n, s);
  }
  void apply_mask(const uint8_t* mask, float* x, int64_t n) const override {
    return in_window(
        "apply_mask", [&] { return inner_.apply_mask(mask, x, n); }, mask, x, n);
  }

 private:
  struct PendingCopy {
    void* dst;
    const void* src;
    size_t bytes;
    bool to_host;
  };
  uint64_t defer(const PendingCopy& c) const;

  FencedResource* resource_;
  const Ops& inner_;
  mutable std::mutex copy_mu_;
  mutable std::unordered_map<uint64_t, PendingCopy> pending_;
  mutable uint64_t next_ticket_ = 1;
};

}  // namespace headroom::backend
