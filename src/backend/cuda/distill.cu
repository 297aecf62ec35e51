// The distillation family of the CUDA op table (cuda_ops_impl.h): the LM head fused with
// cross-entropy and the temperature-softened KL against a teacher, per chunk of tokens, as the
// CPU's backend/cpu/distill_kernels.{h,cc} (the reference for the mathematics). Per chunk: the
// student's logits into scratch and the teacher's into teacher.logits_chunk through gemm.cu's
// chunk GEMMs (gemm_internal.h), then one block per row reduces them in a fixed order (no
// atomics: the same bits on every run). See the "distillation" section of docs/notes/cuda.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "backend/cuda/cuda_ops_impl.h"
#include "backend/cuda/elementwise_common.cuh"
#include "backend/cuda/gemm_internal.h"
#include "core/check.h"

namespace headroom::backend::cuda {
namespace {

constexpr int kKdThreads = 512;  // as the CE head's row kernels (a multiple of 32)

struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// The row's max and sum of exp(f(i) - max) over i in [0, V), on every thread of the block: each
// thread keeps an online (max, sum) over its strided columns, merged by shuffles and then the
// warps in order (gemm.cu's row_max_sum, so with f(i) = z[i] the CE head's bits). `sh` holds a
// warp's value each; the block synchronizes before returning so that it can be reused.
template <typename F>
__device__ MaxSum block_max_sum(F f, int V, MaxSum* sh) {
  MaxSum t{-INFINITY, 0.0f};
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float x = f(i);
    if (x > t.m) {
      t.s = t.s * expf(t.m - x) + 1.0f;
      t.m = x;
    } else if (x != -INFINITY) {
      t.s += expf(x - t.m);
    }
  }
  for (int off = 16; off > 0; off /= 2) {
    const MaxSum o{__shfl_xor_sync(0xffffffffu, t.m, off), __shfl_xor_sync(0xffffffffu, t.s, off)};
    t = merge(t, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sh[warp] = t;
  __syncthreads();
  MaxSum r = sh[0];
  for (int w = 1; w < int(blockDim.x / 32); ++w) r = merge(r, sh[w]);
  __syncthreads();
  return r;
}

// The block's sum of v (double), on every thread: shuffles, then the warps in order.
__device__ double block_sum(double v, double* sh) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  double r = sh[0];
  for (int w = 1; w < int(blockDim.x / 32); ++w) r += sh[w];
  __syncthreads();
  return r;
}

// One block per row r of the chunk (global row row0 + r): the four stats and the loss.
// stats[row] = lse(zs) (in double, as the CE head's lse), stats[N + row] = lse(zs / tau),
// stats[2N + row] = lse(zt / tau), stats[3N + row] = CE (0 on ignored rows); losses[row] =
// (1 - alpha) CE + alpha tau^2 KL(p_t || q_s), KL = sum_i p_t,i (zt_i - zs_i) / tau + ls - lt.
// A target outside [-1, V) gives NaN (the CPU aborts), as the CE head.
__global__ void kd_forward_kernel(float* losses, float* stats, const float* zs_all,
                                  const float* zt_all, int64_t ld, const int32_t* targets,
                                  int64_t row0, int64_t N, int V, float inv_tau, double alpha,
                                  double tau2) {
  __shared__ MaxSum sh_ms[kKdThreads / 32];
  __shared__ double sh_d[kKdThreads / 32];
  const int64_t row = row0 + blockIdx.x;
  const float* zs = zs_all + int64_t{blockIdx.x} * ld;
  const float* zt = zt_all + int64_t{blockIdx.x} * ld;
  const MaxSum ms = block_max_sum([&](int i) { return zs[i]; }, V, sh_ms);
  const MaxSum mss = block_max_sum([&](int i) { return zs[i] * inv_tau; }, V, sh_ms);
  const MaxSum mst = block_max_sum([&](int i) { return zt[i] * inv_tau; }, V, sh_ms);
  const double l = log(double(ms.s)) + double(ms.m);
  const float ls = float(log(double(mss.s)) + double(mss.m));
  const float lt = float(log(double(mst.s)) + double(mst.m));
  double part = 0.0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float a = zt[i] * inv_tau, b = zs[i] * inv_tau;
    part += double(expf(a - lt)) * (double(a) - double(b));
  }
  const double kl = block_sum(part, sh_d) + (double(ls) - double(lt));
  if (threadIdx.x == 0) {
    stats[row] = float(l);
    stats[N + row] = ls;
    stats[2 * N + row] = lt;
    const int32_t t = targets[row];
    if (t == -1) {
      stats[3 * N + row] = 0.0f;
      losses[row] = 0.0f;
    } else if (t < -1 || t >= V) {
      stats[3 * N + row] = NAN;
      losses[row] = NAN;
    } else {
      const double ce = l - double(zs[t]);
      stats[3 * N + row] = float(ce);
      // With alpha = 0: (1 - 0) * ce + 0 * kl is ce exactly, the CE head's loss bit for bit.
      losses[row] = float((1.0 - alpha) * ce + alpha * tau2 * kl);
    }
  }
}

// One block per row: dlogits d[i] = dce (softmax(zs)_i - [i = target]) + dkl (softmax(zs / tau)_i
// - softmax(zt / tau)_i) from the saved stats, into D (fp32 in place over the student's logits,
// bf16 in its own area, or fp32 rounded to f16 values in place). Each thread reads zs[i], zt[i]
// before it writes d[i], and only its own i: in place is safe. With alpha = 0 (dkl = 0) the
// values are the CE head's backward kernel's bits.
template <typename D, bool kF16Values>
__global__ void kd_backward_kernel(D* dlogits, int64_t ldd, const float* zs_all,
                                   const float* zt_all, int64_t ld, const float* stats,
                                   const int32_t* targets, int64_t row0, int64_t N, int V,
                                   float inv_tau, float dce, float dkl) {
  const int64_t row = row0 + blockIdx.x;
  const float* zs = zs_all + int64_t{blockIdx.x} * ld;
  const float* zt = zt_all + int64_t{blockIdx.x} * ld;
  D* d = dlogits + int64_t{blockIdx.x} * ldd;
  const int32_t t = targets[row];
  const float l = stats[row], ls = stats[N + row], lt = stats[2 * N + row];
  const bool bad = t < -1 || t >= V;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    float g = 0.0f;
    if (bad) {
      g = NAN;
    } else if (t >= 0) {
      g = expf(zs[i] - l) * dce;
      if (i == t) g -= dce;
      g += dkl * (expf(zs[i] * inv_tau - ls) - expf(zt[i] * inv_tau - lt));
    }
    if constexpr (kF16Values) g = elem::round_f16(g);
    d[i] = elem::from_f32<D>(g);
  }
}

// The teacher's chunk of logits [n, V] (row stride ld) in its own precision, fp32 results.
void teacher_logits(const Context& ctx, float* logits, const KdTeacher& t, int64_t row0, int n,
                    int V, int64_t ld) {
  if (t.dtype == DType::kBF16) {
    const bf16_t* x = static_cast<const bf16_t*>(t.x) + row0 * t.C;
    chunk_logits(ctx, logits, x, static_cast<const bf16_t*>(t.w), n, t.C, V, ld);
  } else {
    const float* x = static_cast<const float*>(t.x) + row0 * t.C;
    chunk_logits(ctx, logits, x, static_cast<const float*>(t.w), n, t.C, V, ld);
  }
}

void check_kd_args(const KdTeacher& t, int N, int C, int V, int chunk, KdLoss kd, int w_rows) {
  HR_CHECK_MSG(chunk >= 1 && V >= 1 && C >= 1 && N >= 0,
               "lm_head_kd: chunk, V and C must be positive");
  HR_CHECK_MSG(w_rows == 0 || w_rows >= V, "lm_head_kd: the weight has fewer rows than V");
  HR_CHECK_MSG(t.x != nullptr && t.w != nullptr && t.logits_chunk != nullptr && t.C >= 1,
               "lm_head_kd: the teacher's x, w, logits_chunk and C must be set");
  HR_CHECK_MSG(t.w_rows == 0 || t.w_rows >= V,
               "lm_head_kd: the teacher's weight has fewer rows "
               "than V");
  HR_CHECK_MSG(t.dtype == DType::kF32 || t.dtype == DType::kBF16,
               "lm_head_kd: the teacher's dtype must be fp32 or bf16");
  HR_CHECK_MSG(kd.alpha >= 0.0f && kd.alpha <= 1.0f && kd.temperature > 0.0f,
               "lm_head_kd: alpha must be in [0, 1] and the temperature positive");
}

template <typename T, typename TW>
void kd_forward_t(const Context& ctx, float* losses, float* stats, const T* x, const TW* w,
                  const KdTeacher& teacher, const int32_t* targets, int N, int C, int V, int chunk,
                  KdLoss kd, float* scratch, int w_rows) {
  check_kd_args(teacher, N, C, V, chunk, kd, w_rows);
  chunk = std::min(chunk, std::max(N, 1));  // scratch for min(chunk, N) rows suffices
  const int64_t ld = head_ld(V);
  const float inv_tau = 1.0f / kd.temperature;
  const double tau2 = double(kd.temperature) * kd.temperature;
  for (int c0 = 0; c0 < N; c0 += chunk) {
    const int n = std::min(chunk, N - c0);
    chunk_logits(ctx, scratch, x + int64_t{c0} * C, w, n, C, V, ld);
    teacher_logits(ctx, teacher.logits_chunk, teacher, c0, n, V, ld);
    kd_forward_kernel<<<unsigned(n), kKdThreads, 0, ctx.compute>>>(
        losses, stats, scratch, teacher.logits_chunk, ld, targets, c0, N, V, inv_tau,
        double(kd.alpha), tau2);
    HR_CUDA_LAUNCH_CHECK();
  }
}

template <typename T, typename TW>
void kd_backward_t(const Context& ctx, T* dx, float* dw, const T* x, const TW* w,
                   const KdTeacher& teacher, const int32_t* targets, const float* stats, int N,
                   int C, int V, int chunk, KdLoss kd, float dloss, float* scratch, int w_rows) {
  check_kd_args(teacher, N, C, V, chunk, kd, w_rows);
  chunk = std::min(chunk, std::max(N, 1));  // scratch for min(chunk, N) rows suffices
  const int64_t ld = head_ld(V);
  const float inv_tau = 1.0f / kd.temperature;
  // d loss / d zs_i = (1 - alpha) (p_i - [i = target]) + alpha tau^2 (1 / tau) (q_i - p_t,i).
  const float dce = (1.0f - kd.alpha) * dloss;
  const float dkl = kd.alpha * kd.temperature * dloss;
  float* zt = teacher.logits_chunk;
  for (int c0 = 0; c0 < N; c0 += chunk) {
    const int n = std::min(chunk, N - c0);
    const T* xc = x + int64_t{c0} * C;
    T* dxc = dx == nullptr ? nullptr : dx + int64_t{c0} * C;
    chunk_logits(ctx, scratch, xc, w, n, C, V, ld);
    teacher_logits(ctx, zt, teacher, c0, n, V, ld);
    if constexpr (std::is_same_v<T, bf16_t>) {
      // bf16 dlogits in the area after the fp32 logits (lm_head_ce's layout).
      bf16_t* dl = reinterpret_cast<bf16_t*>(scratch + int64_t{chunk} * ld);
      kd_backward_kernel<bf16_t, false><<<unsigned(n), kKdThreads, 0, ctx.compute>>>(
          dl, ld, scratch, zt, ld, stats, targets, c0, N, V, inv_tau, dce, dkl);
      HR_CUDA_LAUNCH_CHECK();
      chunk_backward(ctx, dxc, dw, dl, xc, w, n, C, V, ld);
    } else {
      constexpr bool kF16 = std::is_same_v<T, f16_t>;
      kd_backward_kernel<float, kF16><<<unsigned(n), kKdThreads, 0, ctx.compute>>>(
          scratch, ld, scratch, zt, ld, stats, targets, c0, N, V, inv_tau, dce, dkl);
      HR_CUDA_LAUNCH_CHECK();
      chunk_backward(ctx, dxc, dw, scratch, xc, w, n, C, V, ld);
    }
  }
}

}  // namespace

#define HR_KD_DEFINE(T)                                                                            \
  void CudaOps::lm_head_kd_forward(float* losses, float* stats, const T* x,                        \
                                   const GemmWeight<T>* w, const KdTeacher& teacher,               \
                                   const int32_t* targets, int N, int C, int V, int chunk,         \
                                   KdLoss kd, float* scratch, int w_rows) const {                  \
    kd_forward_t(ctx_, losses, stats, x, w, teacher, targets, N, C, V, chunk, kd, scratch,         \
                 w_rows);                                                                          \
  }                                                                                                \
  void CudaOps::lm_head_kd_backward(T* dx, float* dw, const T* x, const GemmWeight<T>* w,          \
                                    const KdTeacher& teacher, const int32_t* targets,              \
                                    const float* stats, int N, int C, int V, int chunk, KdLoss kd, \
                                    float dloss, float* scratch, int w_rows) const {               \
    kd_backward_t(ctx_, dx, dw, x, w, teacher, targets, stats, N, C, V, chunk, kd, dloss, scratch, \
                  w_rows);                                                                         \
  }
HR_KD_DEFINE(float)
HR_KD_DEFINE(bf16_t)
HR_KD_DEFINE(f16_t)
#undef HR_KD_DEFINE

}  // namespace headroom::backend::cuda
