// Knowledge distillation fused into the chunked LM head (distill_kernels.h): the student's and the
// teacher's logits of one chunk of tokens live side by side in scratch, are reduced to the loss
// (or turned into the student's dlogits) and are gone before the next chunk. See
// docs/notes/distillation.md.
#include "backend/cpu/distill_kernels.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/cpu/bf16.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/gemm.h"
#include "backend/cpu/head_chunks.h"
#include "backend/cpu/kernels.h"
#include "core/check.h"

namespace headroom::cpu {
namespace {

using namespace head_chunks;  // head_ld, chunk_cols, chunk_logits, chunk_backward, to_dlogit

// The teacher's chunk of logits in its own precision (fp32 logits either way).
void teacher_logits(float* logits, const backend::KdTeacher& t, int row0, int n, int V, int ld) {
  const int cols = chunk_cols(V, ld, t.w_rows);
  if (t.dtype == DType::kBF16) {
    const bf16_t* x = static_cast<const bf16_t*>(t.x) + int64_t{row0} * t.C;
    gemm_ex(false, true, n, cols, t.C, DType::kBF16, x, t.C, t.w, t.C, DType::kF32, logits, ld,
            nullptr, false);
  } else {
    const float* x = static_cast<const float*>(t.x) + int64_t{row0} * t.C;
    gemm(false, true, n, cols, t.C, x, t.C, static_cast<const float*>(t.w), t.C, logits, ld,
         nullptr, false);
  }
}

// log(sum_i exp(z_i * inv_tau)), given m = max_i z_i: the softened row's log-sum-exp. Sixteen
// float lanes in element order, then their total in double (as softmax_row_stats), so the result
// depends on V only, never on the thread.
double scaled_lse(const float* z, int V, float m, float inv_tau) {
  const float mt = m * inv_tau;  // max of z * inv_tau: rounding is monotonic for inv_tau > 0
  constexpr int kLanes = 16;
  float part[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= V; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) part[j] += fast_exp(z[i + j] * inv_tau - mt);
  }
  double s = 0.0;
  for (; i < V; ++i) s += fast_exp(z[i] * inv_tau - mt);
  for (int j = 0; j < kLanes; ++j) s += part[j];
  return std::log(s) + mt;
}

void check_args(const backend::KdTeacher& t, int V, int chunk, backend::KdLoss kd) {
  HR_CHECK(chunk >= 1 && V >= 1);
  HR_CHECK(t.x != nullptr && t.w != nullptr && t.logits_chunk != nullptr && t.C >= 1);
  HR_CHECK(t.dtype == DType::kF32 || t.dtype == DType::kBF16);
  HR_CHECK(kd.alpha >= 0.0f && kd.alpha <= 1.0f && kd.temperature > 0.0f);
}

template <typename T, typename TW>
void kd_forward_t(float* losses, float* stats, const T* x, const TW* w,
                  const backend::KdTeacher& teacher, const int32_t* targets, int N, int C, int V,
                  int chunk, backend::KdLoss kd, float* scratch, int w_rows) {
  check_args(teacher, V, chunk, kd);
  chunk = std::min(chunk, std::max(N, 1));  // scratch for min(chunk, N) rows suffices
  const int ld = head_ld(V), cols = chunk_cols(V, ld, w_rows);
  float* zs_all = scratch;
  float* zt_all = teacher.logits_chunk;
  const float inv_tau = 1.0f / kd.temperature;
  const double a = kd.alpha, tau2 = double(kd.temperature) * kd.temperature;
  for (int c0 = 0; c0 < N; c0 += chunk) {
    const int n = std::min(chunk, N - c0);
    chunk_logits(zs_all, x + int64_t{c0} * C, w, n, C, cols, ld);
    teacher_logits(zt_all, teacher, c0, n, V, ld);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < n; ++r) {
      const int64_t row = c0 + r;
      const int32_t target = targets[row];
      HR_CHECK(target >= -1 && target < V);
      const float* zs = zs_all + int64_t{r} * ld;
      const float* zt = zt_all + int64_t{r} * ld;
      float m, s;
      softmax_row_stats(zs, V, &m, &s);
      // The CE as lm_head_ce_forward computes it (double log-sum-exp, one rounding).
      const double l = std::log(static_cast<double>(s)) + m;
      stats[row] = static_cast<float>(l);
      const float ls = static_cast<float>(scaled_lse(zs, V, m, inv_tau));
      const float lt = static_cast<float>(scaled_lse(zt, V, row_max(zt, V), inv_tau));
      stats[N + row] = ls;
      stats[2 * int64_t{N} + row] = lt;
      if (target < 0) {
        stats[3 * int64_t{N} + row] = 0.0f;
        losses[row] = 0.0f;
        continue;
      }
      const double ce = l - zs[target];
      // KL(p_t || q_s) = sum_i p_t,i (log p_t,i - log q_s,i), with log p_t,i = zt_i / tau - lt
      // and log q_s,i = zs_i / tau - ls: sum_i p_t,i (zt_i - zs_i) / tau + ls - lt (sum p_t = 1).
      double kl = 0.0;
      for (int i = 0; i < V; ++i) {
        const float pt = fast_exp(zt[i] * inv_tau - lt);
        kl += double(pt) * (double(zt[i] * inv_tau) - double(zs[i] * inv_tau));
      }
      kl += double(ls) - double(lt);
      stats[3 * int64_t{N} + row] = static_cast<float>(ce);
      // With alpha = 0: (1 - 0) * ce + 0 * kl is ce exactly, the CE head's loss bit for bit.
      losses[row] = static_cast<float>((1.0 - a) * ce + a * tau2 * kl);
    }
  }
}

template <typename T, typename TW>
void kd_backward_t(T* dx, float* dw, const T* x, const TW* w, const backend::KdTeacher& teacher,
                   const int32_t* targets, const float* stats, int N, int C, int V, int chunk,
                   backend::KdLoss kd, float dloss, float* scratch, int w_rows) {
  check_args(teacher, V, chunk, kd);
  chunk = std::min(chunk, std::max(N, 1));  // scratch for min(chunk, N) rows suffices
  const int ld = head_ld(V), cols = chunk_cols(V, ld, w_rows);
  float* zs_all = scratch;
  float* zt_all = teacher.logits_chunk;
  using D = DlogitsT<T>;
  // dlogits: in place over the student's fp32 logits, or (bf16) into the bf16 area after them
  // (lm_head_ce's layout).
  D* dlogits =
      reinterpret_cast<D*>(std::is_same_v<T, bf16_t> ? scratch + int64_t{chunk} * ld : scratch);
  const float inv_tau = 1.0f / kd.temperature;
  // d loss / d zs_i = (1 - alpha) (p_i - [i = target]) + alpha tau^2 (1 / tau) (q_i - p_t,i).
  const float dce = (1.0f - kd.alpha) * dloss;
  const float dkl = kd.alpha * kd.temperature * dloss;
  for (int c0 = 0; c0 < N; c0 += chunk) {
    const int n = std::min(chunk, N - c0);
    const T* xc = x + int64_t{c0} * C;
    chunk_logits(zs_all, xc, w, n, C, cols, ld);
    teacher_logits(zt_all, teacher, c0, n, V, ld);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < n; ++r) {
      const int64_t row = c0 + r;
      const int32_t target = targets[row];
      HR_CHECK(target >= -1 && target < V);
      const float* zs = zs_all + int64_t{r} * ld;
      const float* zt = zt_all + int64_t{r} * ld;
      D* d = dlogits + int64_t{r} * ld;
      if (target < 0) {
        std::fill(d, d + V, to_dlogit<T>(0.0f));
        continue;
      }
      const float l = stats[row], ls = stats[N + row], lt = stats[2 * int64_t{N} + row];
      // The CE part as lm_head_ce_backward computes it; with alpha = 0 the KD part is (+-)0 and
      // every dlogit is that kernel's bits. The target's before its logit is overwritten.
      auto kd_part = [&](int i) {
        return dkl * (fast_exp(zs[i] * inv_tau - ls) - fast_exp(zt[i] * inv_tau - lt));
      };
      const float dt = (fast_exp(zs[target] - l) * dce - dce) + kd_part(target);
#pragma omp simd
      for (int i = 0; i < V; ++i) d[i] = to_dlogit<T>(fast_exp(zs[i] - l) * dce + kd_part(i));
      d[target] = to_dlogit<T>(dt);
    }
    chunk_backward(dx == nullptr ? nullptr : dx + int64_t{c0} * C, dw, dlogits, xc, w, n, C, V, ld);
  }
}

}  // namespace

size_t lm_head_kd_teacher_floats(int chunk, int V) { return size_t{1} * chunk * head_ld(V); }

void lm_head_kd_forward(float* losses, float* stats, const float* x, const float* w,
                        const backend::KdTeacher& teacher, const int32_t* targets, int N, int C,
                        int V, int chunk, backend::KdLoss kd, float* scratch, int w_rows) {
  kd_forward_t(losses, stats, x, w, teacher, targets, N, C, V, chunk, kd, scratch, w_rows);
}
void lm_head_kd_forward(float* losses, float* stats, const bf16_t* x, const bf16_t* w,
                        const backend::KdTeacher& teacher, const int32_t* targets, int N, int C,
                        int V, int chunk, backend::KdLoss kd, float* scratch, int w_rows) {
  kd_forward_t(losses, stats, x, w, teacher, targets, N, C, V, chunk, kd, scratch, w_rows);
}
void lm_head_kd_forward(float* losses, float* stats, const f16_t* x, const float* w,
                        const backend::KdTeacher& teacher, const int32_t* targets, int N, int C,
                        int V, int chunk, backend::KdLoss kd, float* scratch, int w_rows) {
  kd_forward_t(losses, stats, x, w, teacher, targets, N, C, V, chunk, kd, scratch, w_rows);
}

void lm_head_kd_backward(float* dx, float* dw, const float* x, const float* w,
                         const backend::KdTeacher& teacher, const int32_t* targets,
                         const float* stats, int N, int C, int V, int chunk, backend::KdLoss kd,
                         float dloss, float* scratch, int w_rows) {
  kd_backward_t(dx, dw, x, w, teacher, targets, stats, N, C, V, chunk, kd, dloss, scratch, w_rows);
}
void lm_head_kd_backward(bf16_t* dx, float* dw, const bf16_t* x, const bf16_t* w,
                         const backend::KdTeacher& teacher, const int32_t* targets,
                         const float* stats, int N, int C, int V, int chunk, backend::KdLoss kd,
                         float dloss, float* scratch, int w_rows) {
  kd_backward_t(dx, dw, x, w, teacher, targets, stats, N, C, V, chunk, kd, dloss, scratch, w_rows);
}
void lm_head_kd_backward(f16_t* dx, float* dw, const f16_t* x, const float* w,
                         const backend::KdTeacher& teacher, const int32_t* targets,
                         const float* stats, int N, int C, int V, int chunk, backend::KdLoss kd,
                         float dloss, float* scratch, int w_rows) {
  kd_backward_t(dx, dw, x, w, teacher, targets, stats, N, C, V, chunk, kd, dloss, scratch, w_rows);
}

}  // namespace headroom::cpu
