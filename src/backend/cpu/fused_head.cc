// LM head fused with cross-entropy, chunked over tokens (see fused_kernels.h): each chunk's
// logits live in a chunk x V scratch, are reduced to a loss (or turned into their gradient in
// place) and are gone before the next chunk. See Note [Fused LM head] in
// docs/notes/fused-kernels.md.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "backend/cpu/bf16.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/fused_kernels.h"
#include "backend/cpu/gemm.h"
#include "backend/cpu/kernels.h"
#include "core/check.h"

namespace headroom::cpu {
namespace {

// The row stride of a chunk's logits and dlogits (logits_row_stride); columns [V, ld) are unused.
inline int head_ld(int V) { return int(logits_row_stride(V)); }

// logits[n, V] (row stride ld) = x[n, C] x wte[V, C]^T (the kOutIn matmul_forward); fp32 logits.
inline void chunk_logits(float* logits, const float* x, const float* wte, int n, int C, int V,
                         int ld) {
  gemm(false, true, n, V, C, x, C, wte, C, logits, ld, nullptr, false);
}
inline void chunk_logits(float* logits, const bf16_t* x, const bf16_t* wte, int n, int C, int V,
                         int ld) {
  gemm_ex(false, true, n, V, C, DType::kBF16, x, C, wte, C, DType::kF32, logits, ld, nullptr,
          false);
}

inline void chunk_logits(float* logits, const f16_t* x, const float* wte, int n, int C, int V,
                         int ld) {
  gemm_f16(false, true, n, V, C, x, C, wte, C, logits, ld, nullptr, false);
}

// dx[n, C] = dlogits x wte; dwte += dlogits^T x x (the kOutIn matmul_backward).
inline void chunk_backward(float* dx, float* dwte, float* dlogits, const float* x, const float* wte,
                           int n, int C, int V, int ld) {
  if (dx != nullptr) gemm(false, false, n, C, V, dlogits, ld, wte, C, dx, C, nullptr, false);
  if (dwte != nullptr) gemm(true, false, V, C, n, dlogits, ld, x, C, dwte, C, nullptr, true);
}
// bf16: dlogits in bf16, as autocast feeds the bf16 GEMMs; dwte accumulates in fp32.
inline void chunk_backward(bf16_t* dx, float* dwte, const bf16_t* dlogits, const bf16_t* x,
                           const bf16_t* wte, int n, int C, int V, int ld) {
  const DType bf = DType::kBF16;
  if (dx != nullptr) {
    gemm_ex(false, false, n, C, V, bf, dlogits, ld, wte, C, bf, dx, C, nullptr, false);
  }
  if (dwte != nullptr) {
    gemm_ex(true, false, V, C, n, bf, dlogits, ld, x, C, DType::kF32, dwte, C, nullptr, true);
  }
}

// f16: dlogits are fp32 holding f16 values (in place over the logits).
inline void chunk_backward(f16_t* dx, float* dwte, const float* dlogits, const f16_t* x,
                           const float* wte, int n, int C, int V, int ld) {
  if (dx != nullptr) gemm_f16(false, false, n, C, V, dlogits, ld, wte, C, dx, C, nullptr);
  if (dwte != nullptr) gemm_f16(true, false, V, C, n, dlogits, ld, x, C, dwte, C, nullptr, true);
}

// The storage of the chunk's dlogits for activations of type T: bf16 for bf16; fp32 otherwise
// (holding f16 values for f16).
template <typename T>
using DlogitsT = std::conditional_t<std::is_same_v<T, bf16_t>, bf16_t, float>;
template <typename T>
inline DlogitsT<T> to_dlogit(float x) {
  if constexpr (std::is_same_v<T, f16_t>) {
    return round_f16(x);
  } else {
    return from_f32<T>(x);
  }
}

// The columns a chunk's logits GEMM computes: all ld where wte holds ld rows (dense output rows,
// which oneDNN's AMX brgemm wants; the columns past V are never read), else V.
inline int chunk_cols(int V, int ld, int wte_rows) { return wte_rows >= ld ? ld : V; }

template <typename T, typename TW>
void lm_head_ce_forward_t(float* losses, float* lse, const T* x, const TW* wte,
                          const int32_t* targets, int N, int C, int V, int chunk, float* scratch,
                          int wte_rows = 0) {
  HR_CHECK(chunk >= 1 && V >= 1);
  const int ld = head_ld(V), cols = chunk_cols(V, ld, wte_rows);
  for (int c0 = 0; c0 < N; c0 += chunk) {
    const int n = std::min(chunk, N - c0);
    chunk_logits(scratch, x + int64_t{c0} * C, wte, n, C, cols, ld);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < n; ++r) {
      const int64_t row = c0 + r;
      const int32_t target = targets[row];
      HR_CHECK(target >= -1 && target < V);
      const float* z = scratch + int64_t{r} * ld;
      float m, s;
      softmax_row_stats(z, V, &m, &s);
      // The same double-precision sum as cross_entropy_forward, so the losses agree to rounding.
      const double l = std::log(static_cast<double>(s)) + m;
      lse[row] = static_cast<float>(l);
      losses[row] = target < 0 ? 0.0f : static_cast<float>(l - z[target]);
    }
  }
}

template <typename T, typename TW>
void lm_head_ce_backward_t(T* dx, float* dwte, const T* x, const TW* wte, const int32_t* targets,
                           const float* lse, int N, int C, int V, int chunk, float dloss,
                           float* scratch, int wte_rows = 0) {
  HR_CHECK(chunk >= 1 && V >= 1);
  const int ld = head_ld(V), cols = chunk_cols(V, ld, wte_rows);
  for (int c0 = 0; c0 < N; c0 += chunk) {
    const int n = std::min(chunk, N - c0);
    const T* xc = x + int64_t{c0} * C;
    chunk_logits(scratch, xc, wte, n, C, cols, ld);
    // dlogits: in place over the fp32 logits, or (bf16) into the bf16 area after them.
    using D = DlogitsT<T>;
    D* dlogits =
        reinterpret_cast<D*>(std::is_same_v<T, bf16_t> ? scratch + int64_t{chunk} * ld : scratch);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < n; ++r) {
      const int32_t target = targets[c0 + r];
      HR_CHECK(target >= -1 && target < V);
      const float* z = scratch + int64_t{r} * ld;
      D* d = dlogits + int64_t{r} * ld;
      if (target < 0) {
        std::fill(d, d + V, to_dlogit<T>(0.0f));
        continue;
      }
      // softmax = exp(z - lse): one pass instead of the max and sum passes of a fresh softmax.
      const float l = lse[c0 + r];
      const float dt = fast_exp(z[target] - l) * dloss - dloss;  // before z[target] is written
#pragma omp simd
      for (int i = 0; i < V; ++i) d[i] = to_dlogit<T>(fast_exp(z[i] - l) * dloss);
      d[target] = to_dlogit<T>(dt);
    }
    chunk_backward(dx == nullptr ? nullptr : dx + int64_t{c0} * C, dwte, dlogits, xc, wte, n, C, V,
                   ld);
  }
}

}  // namespace

size_t lm_head_ce_scratch_floats(int chunk, int V, DType storage) {
  const size_t logits = size_t{1} * chunk * head_ld(V);
  // bf16: the chunk's dlogits in bf16 after its fp32 logits.
  return storage == DType::kBF16 ? logits + (logits + 1) / 2 : logits;
}

void lm_head_ce_forward(float* losses, float* lse, const float* x, const float* wte,
                        const int32_t* targets, int N, int C, int V, int chunk, float* scratch,
                        int wte_rows) {
  lm_head_ce_forward_t(losses, lse, x, wte, targets, N, C, V, chunk, scratch, wte_rows);
}
void lm_head_ce_forward(float* losses, float* lse, const bf16_t* x, const bf16_t* wte,
                        const int32_t* targets, int N, int C, int V, int chunk, float* scratch,
                        int wte_rows) {
  lm_head_ce_forward_t(losses, lse, x, wte, targets, N, C, V, chunk, scratch, wte_rows);
}

void lm_head_ce_backward(float* dx, float* dwte, const float* x, const float* wte,
                         const int32_t* targets, const float* lse, int N, int C, int V, int chunk,
                         float dloss, float* scratch, int wte_rows) {
  lm_head_ce_backward_t(dx, dwte, x, wte, targets, lse, N, C, V, chunk, dloss, scratch, wte_rows);
}
void lm_head_ce_backward(bf16_t* dx, float* dwte, const bf16_t* x, const bf16_t* wte,
                         const int32_t* targets, const float* lse, int N, int C, int V, int chunk,
                         float dloss, float* scratch, int wte_rows) {
  lm_head_ce_backward_t(dx, dwte, x, wte, targets, lse, N, C, V, chunk, dloss, scratch, wte_rows);
}

void lm_head_ce_forward(float* losses, float* lse, const f16_t* x, const float* wte,
                        const int32_t* targets, int N, int C, int V, int chunk, float* scratch,
                        int wte_rows) {
  lm_head_ce_forward_t(losses, lse, x, wte, targets, N, C, V, chunk, scratch, wte_rows);
}
void lm_head_ce_backward(f16_t* dx, float* dwte, const f16_t* x, const float* wte,
                         const int32_t* targets, const float* lse, int N, int C, int V, int chunk,
                         float dloss, float* scratch, int wte_rows) {
  lm_head_ce_backward_t(dx, dwte, x, wte, targets, lse, N, C, V, chunk, dloss, scratch, wte_rows);
}

void lm_head_ce_forward_backward(float* losses, float* dx, float* dwte, const float* x,
                                 const float* wte, const int32_t* targets, int N, int C, int V,
                                 int chunk, float dloss, float* scratch) {
  HR_CHECK(chunk >= 1 && V >= 1);
  const int ld = head_ld(V);
  for (int c0 = 0; c0 < N; c0 += chunk) {
    const int n = std::min(chunk, N - c0);
    const float* xc = x + int64_t{c0} * C;
    chunk_logits(scratch, xc, wte, n, C, V, ld);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < n; ++r) {
      const int32_t target = targets[c0 + r];
      HR_CHECK(target >= -1 && target < V);
      float* z = scratch + int64_t{r} * ld;
      if (target < 0) {
        losses[c0 + r] = 0.0f;
        std::fill(z, z + V, 0.0f);
        continue;
      }
      float m, s;
      softmax_row_stats(z, V, &m, &s);
      losses[c0 + r] = static_cast<float>(std::log(static_cast<double>(s)) + m - z[target]);
      const float k = dloss / s;  // as cross_entropy_backward
#pragma omp simd
      for (int i = 0; i < V; ++i) z[i] = fast_exp(z[i] - m) * k;
      z[target] -= dloss;
    }
    chunk_backward(dx == nullptr ? nullptr : dx + int64_t{c0} * C, dwte, scratch, xc, wte, n, C, V,
                   ld);
  }
}

}  // namespace headroom::cpu
