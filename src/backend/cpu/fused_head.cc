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
#include "backend/cpu/head_chunks.h"
#include "backend/cpu/kernels.h"
#include "core/check.h"

namespace headroom::cpu {
namespace {

using namespace head_chunks;  // head_ld, chunk_cols, chunk_logits, chunk_backward, to_dlogit

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
