// CPU fp32 kernels (see kernels.h for the contract). GEMMs go through gemm.h (oneDNN); the rest
// are OpenMP loops written so that GCC vectorises them with -O3 -march=native.
//
// Determinism: no atomics. Parameter-gradient reductions over rows (bias, embedding, and
// layernorm without AVX-512) are parallelised over the output dimension, each thread owning a
// column range and summing rows in order, so they do not even depend on the thread count; the
// AVX-512 layernorm backward sums 12 blocks of rows fixed by N, in block order (see Note
// [LayerNorm backward in one pass]), likewise. Only sum_squares combines per-thread partials (in
// thread order), and the GEMMs follow oneDNN's blocking.
#include "backend/cpu/kernels.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#include "backend/cpu/amx_gemm.h"
#include "backend/cpu/bf16.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/gemm.h"
#include "backend/cpu/transpose.h"
#include "core/check.h"

namespace headroom::cpu {
namespace {

// Columns are reduced in blocks of this many floats held on the stack, so a parameter gradient
// receives one `+=` per call (two calls add the same value twice, exactly).
constexpr int kColBlock = 256;

// This thread's share [begin, end) of [0, n), in units of `align` elements (cache lines) where
// possible. Call inside a parallel region.
inline void thread_range(int64_t n, int64_t align, int64_t* begin, int64_t* end) {
  const int64_t nth = omp_get_num_threads();
  const int64_t tid = omp_get_thread_num();
  const int64_t units = (n + align - 1) / align;
  const int64_t per = units / nth, rem = units % nth;
  const int64_t u0 = tid * per + std::min(tid, rem);
  const int64_t u1 = u0 + per + (tid < rem ? 1 : 0);
  *begin = std::min(n, u0 * align);
  *end = std::min(n, u1 * align);
}

#if HR_AVX512_KERNELS
// out[i] = f(in[i]) for i < n, 16 lanes at a time, each thread's range ending in one masked
// vector (no scalar tail: see fast_math.h). Ranges are multiples of 64 elements, whole cache lines
// for every storage type. out may alias in. One vector at a time: on Zen 5 grouping made the
// fp32 -> bf16 cast 1.13x slower (median of 3 alternated rounds); map16_grouped is for long chains.
template <typename TO, typename TI, typename F>
inline void map16(TO* out, const TI* in, int64_t n, F f) {
#pragma omp parallel
  {
    int64_t i0, i1;
    thread_range(n, 64, &i0, &i1);
    for_each16(i0, i1, [&](int64_t i, __mmask16 m) { store16(out + i, m, f(load16(in + i, m))); });
  }
}

// map16's walk for an f with a long dependency chain (GELU): kGroup vectors per iteration, all
// loaded, then f(v) on the array of them (__m512 (&v)[K], in place), then stored; the range's
// last vectors one at a time (K = 1). f computes step by step across the vectors (fast_math.h,
// "Forms over a group of K vectors"), the same bits as one at a time. out may still alias the
// inputs: each group is read before it is written. With bf16 input and output, the lanes hold
// the even and the odd elements (load32_eo, store32_eo): f must be elementwise (a lane's result
// depends only on that lane's input). How many vectors, and why no software prefetch of the
// input: docs/notes/memory-bound-kernels.md, "GELU step by step across eight vectors".
template <int kGroup, typename TO, typename TI, typename F>
inline void map16_grouped(TO* out, const TI* in, int64_t n, F f) {
  static_assert(kGroup % 2 == 0);  // bf16's even and odd halves
#pragma omp parallel
  {
    int64_t i0, i1;
    thread_range(n, 64, &i0, &i1);
    auto one = [&](int64_t i, __mmask16 m) {
      __m512 v[1] = {load16(in + i, m)};
      f(v);
      store16(out + i, m, v[0]);
    };
    for_each_block<16 * kGroup>(i0, i1, one, [&](int64_t i) {
      __m512 v[kGroup];
      if constexpr (std::is_same_v<TO, bf16_t> && std::is_same_v<TI, bf16_t>) {
        for (int k = 0; k < kGroup / 2; ++k) load32_eo(in + i + 32 * k, &v[2 * k], &v[2 * k + 1]);
        f(v);
        for (int k = 0; k < kGroup / 2; ++k) store32_eo(out + i + 32 * k, v[2 * k], v[2 * k + 1]);
      } else {
        for (int k = 0; k < kGroup; ++k) v[k] = load16(in + i + 16 * k, 0xFFFF);
        f(v);
        for (int k = 0; k < kGroup; ++k) store16(out + i + 16 * k, 0xFFFF, v[k]);
      }
    });
  }
}
// out[i] = combine(f(in[i]), in2[i]): f as in the one-input map16_grouped, on the group of in's
// vectors; in2's vectors are loaded only after it (loaded with in's, they would hold kGroup more
// registers through f's chain: 1.03-1.06x the cycles in L1), their lines prefetched when the
// group starts (loaded late without it, the fp32 backward took 1.27-1.35x main's time from
// memory), and combine(a, b) takes one vector of each.
template <int kGroup, typename TO, typename TI, typename TI2, typename F, typename C>
inline void map16_grouped(TO* out, const TI* in, const TI2* in2, int64_t n, F f, C combine) {
  static_assert(kGroup % 2 == 0);  // bf16's even and odd halves
#pragma omp parallel
  {
    int64_t i0, i1;
    thread_range(n, 64, &i0, &i1);
    auto one = [&](int64_t i, __mmask16 m) {
      __m512 v[1] = {load16(in + i, m)};
      f(v);
      store16(out + i, m, combine(v[0], load16(in2 + i, m)));
    };
    for_each_block<16 * kGroup>(i0, i1, one, [&](int64_t i) {
      for (int64_t k = 0; k < 16 * kGroup; k += 64 / int64_t(sizeof(TI2))) {
        _mm_prefetch(reinterpret_cast<const char*>(in2 + i + k), _MM_HINT_T0);
      }
      __m512 v[kGroup];
      if constexpr (std::is_same_v<TO, bf16_t> && std::is_same_v<TI, bf16_t> &&
                    std::is_same_v<TI2, bf16_t>) {
        for (int k = 0; k < kGroup / 2; ++k) load32_eo(in + i + 32 * k, &v[2 * k], &v[2 * k + 1]);
        f(v);
        for (int k = 0; k < kGroup / 2; ++k) {  // even and odd elements of in2 alike
          __m512 b[2];
          load32_eo(in2 + i + 32 * k, &b[0], &b[1]);
          store32_eo(out + i + 32 * k, combine(v[2 * k], b[0]), combine(v[2 * k + 1], b[1]));
        }
      } else {
        for (int k = 0; k < kGroup; ++k) v[k] = load16(in + i + 16 * k, 0xFFFF);
        f(v);
        for (int k = 0; k < kGroup; ++k) {
          store16(out + i + 16 * k, 0xFFFF, combine(v[k], load16(in2 + i + 16 * k, 0xFFFF)));
        }
      }
    });
  }
}
#endif

// sum over rows r of x[r*ld + c] for c in [c0, c1) added to acc_out[c]; rows in order.
template <typename T>
inline void add_column_sums(float* acc_out, const T* x, int64_t rows, int64_t ld, int64_t c0,
                            int64_t c1) {
  for (int64_t cb = c0; cb < c1; cb += kColBlock) {
    const int64_t w = std::min<int64_t>(kColBlock, c1 - cb);
    float acc[kColBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * ld + cb;
#pragma omp simd
      for (int64_t j = 0; j < w; ++j) acc[j] += to_f32(xr[j]);
    }
#pragma omp simd
    for (int64_t j = 0; j < w; ++j) acc_out[cb + j] += acc[j];
  }
}

inline float dot(const float* a, const float* b, int n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

}  // namespace

// ---- embedding -----------------------------------------------------------------------------

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B,
                       int T, int C) {
  const int64_t BT = int64_t{B} * T;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < BT; ++bt) {
    const int64_t t = bt % T;
    const float* w = wte + int64_t{tokens[bt]} * C;
    float* o = out + bt * C;
    if (!wpe) {  // rotary positions: no table
      std::memcpy(o, w, size_t(C) * sizeof(float));
      continue;
    }
    const float* p = wpe + t * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] = w[c] + p[c];
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                        int T, int C) {
  // Tokens repeat, so rows of dwte collide; each thread owns a range of channels instead.
#pragma omp parallel
  {
    int64_t c0, c1;
    thread_range(C, 16, &c0, &c1);
    if (c0 < c1) {
      const int64_t BT = int64_t{B} * T;
      for (int64_t bt = 0; bt < BT; ++bt) {
        float* w = dwte + int64_t{tokens[bt]} * C;
        const float* d = dout + bt * C;
#pragma omp simd
        for (int64_t c = c0; c < c1; ++c) w[c] += d[c];
      }
      for (int64_t t = 0; dwpe && t < T; ++t) {
        // dwpe[t, c0:c1] += sum_b dout[b, t, c0:c1]
        add_column_sums(dwpe + t * C, dout + t * C, B, int64_t{T} * C, c0, c1);
      }
    }
  }
}

// ---- layernorm -----------------------------------------------------------------------------

namespace {
constexpr float kLnEps = 1e-5f;

#if HR_AVX512_KERNELS
// The sum of v's 16 lanes, always by the same tree (the result depends on v only): halves, then
// quarters, pairs and lanes (the maskz forms with a full mask: GCC 12 warns falsely about the
// plain ones, as in bf16.h).
inline float hsum16(__m512 v) {
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(0xFFFF, v, v, 0x4E));  // 256-bit halves swapped
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(0xFFFF, v, v, 0xB1));  // 128-bit quarters swapped
  v = _mm512_add_ps(v, _mm512_maskz_permute_ps(0xFFFF, v, 0x4E));        // pairs of lanes swapped
  v = _mm512_add_ps(v, _mm512_maskz_permute_ps(0xFFFF, v, 0xB1));        // lanes swapped
  return _mm512_cvtss_f32(v);
}

// One row's mean and 1 / sqrt(variance + eps), two-pass (the row is in L1 for the second pass;
// no cancellation for rows with a large mean). Four vector accumulators per pass: a single one
// makes each pass wait on the add latency (GCC's `omp simd reduction` kept one). The lanes and
// their order depend on C only, so the result does not depend on the thread.
inline void layernorm_row_stats16(const float* x, int C, float* mean, float* rstd) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int c = 0;
  for (; c + 64 <= C; c += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(x + c));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(x + c + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(x + c + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(x + c + 48));
  }
  for (; c < C; c += 16) a0 = _mm512_add_ps(a0, _mm512_maskz_loadu_ps(first_lanes(C - c), x + c));
  const float m = hsum16(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) / C;
  const __m512 vm = _mm512_set1_ps(m);
  a0 = a1 = a2 = a3 = _mm512_setzero_ps();
  for (c = 0; c + 64 <= C; c += 64) {
    const __m512 d0 = _mm512_sub_ps(_mm512_loadu_ps(x + c), vm);
    const __m512 d1 = _mm512_sub_ps(_mm512_loadu_ps(x + c + 16), vm);
    const __m512 d2 = _mm512_sub_ps(_mm512_loadu_ps(x + c + 32), vm);
    const __m512 d3 = _mm512_sub_ps(_mm512_loadu_ps(x + c + 48), vm);
    a0 = _mm512_fmadd_ps(d0, d0, a0);
    a1 = _mm512_fmadd_ps(d1, d1, a1);
    a2 = _mm512_fmadd_ps(d2, d2, a2);
    a3 = _mm512_fmadd_ps(d3, d3, a3);
  }
  for (; c < C; c += 16) {
    const __mmask16 k = first_lanes(C - c);
    const __m512 d = _mm512_maskz_sub_ps(k, _mm512_maskz_loadu_ps(k, x + c), vm);
    a0 = _mm512_fmadd_ps(d, d, a0);
  }
  const float v = hsum16(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) / C;
  *mean = m;
  *rstd = 1.0f / std::sqrt(v + kLnEps);
}
#endif

#if HR_AVX512_KERNELS
// The forward reads a row from memory (the sum), twice more from L1 (the squared deviations, the
// output), so the memory stream would stall during each row's output loop (the hardware
// prefetcher does not run far enough ahead for that): that loop prefetches the row two ahead
// (6 KiB at C = 768), one line per vector of 16 floats, as many lines as the row has. Measured
// with 0, 1, 2, 3 and 4 rows ahead (docs/notes/memory-bound-kernels.md, "LayerNorm forward: the
// next rows prefetched"): 2 and 3 alike, 1 about half the gain. It moves no result.
constexpr int64_t kLnPrefetchRows = 2;
#endif

template <typename TOut>
void layernorm_forward_t(TOut* out, float* mean, float* rstd, const float* inp, const float* weight,
                         const float* bias, int N, int C) {
#if HR_AVX512_KERNELS
  // Statistics (two passes over the row, from L1 after the first), then the output, 16 lanes at a
  // time with the last vector masked.
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    TOut* o = out + n * C;
    float m, r;
    layernorm_row_stats16(x, C, &m, &r);
    const __m512 vm = _mm512_set1_ps(m), vr = _mm512_set1_ps(r);
    // The row kLnPrefetchRows ahead, one cache line per output vector (see the constant).
    const float* ahead = inp + std::min<int64_t>(n + kLnPrefetchRows, N - 1) * C;
    for_each16(0, C, [&](int64_t c, __mmask16 k) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + c), _MM_HINT_T0);
      const __m512 norm = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + c), vm), vr);
      const __m512 w = _mm512_maskz_loadu_ps(k, weight + c);
      store16(o + c, k,
              bias != nullptr ? _mm512_fmadd_ps(norm, w, _mm512_maskz_loadu_ps(k, bias + c))
                              : _mm512_mul_ps(norm, w));
    });
    mean[n] = m;
    rstd[n] = r;
  }
#else
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int c = 0; c < C; ++c) s += x[c];
    const float m = s / C;
    float v = 0.0f;  // two-pass variance: no cancellation for rows with a large mean
#pragma omp simd reduction(+ : v)
    for (int c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
    const float r = 1.0f / std::sqrt(v / C + kLnEps);
    TOut* o = out + n * C;
    if (bias != nullptr) {
#pragma omp simd
      for (int c = 0; c < C; ++c) o[c] = from_f32<TOut>((x[c] - m) * r * weight[c] + bias[c]);
    } else {
#pragma omp simd
      for (int c = 0; c < C; ++c) o[c] = from_f32<TOut>((x[c] - m) * r * weight[c]);
    }
    mean[n] = m;
    rstd[n] = r;
  }
#endif
}

#if HR_AVX512_KERNELS
// See Note [LayerNorm backward in one pass] in docs/notes/memory-bound-kernels.md. The parameter
// gradients are sums over rows taken in kLnBlocks blocks of rows (ln_block_begin): each block's
// sum in row order, then the blocks' sums added in block order. The blocks depend on N only, so
// the result does not depend on the thread count, and both forms below (fused into the row pass,
// or a separate pass over columns) compute it with the same operations in the same order: the
// same bits. Twelve blocks (fewer when N < 12): whole rounds for 1, 2, 3, 4, 6 and 12 threads, and
// at most 12 / threads barriers a call (a barrier costs a scheduler time slice when the machine is
// busy).
constexpr int64_t kLnBlocks = 12;
inline int64_t ln_blocks(int64_t N) { return std::min(N, kLnBlocks); }
// The first row of block b of ln_blocks(N).
inline int64_t ln_block_begin(int64_t b, int64_t N) { return b * N / ln_blocks(N); }
// The fused form keeps each block's partial sums (2C floats) and their total on the caller's stack
// (13 x 8 KiB at most); wider rows (GPT-2 large and XL's 1280 and 1600) take the separate pass.
constexpr int kLnFusedMaxC = 1024;

// One row of the input gradient, dx += (dy w - mean(dy w) - norm mean(dy w norm)) r with
// norm = (x - m) r, two passes over the row (the second from L1); with lo, also lo = TL(dx). With
// part, also part[c] += dy norm and part[C + c] += dy (this row's share of the parameter
// gradients, in the same pass).
template <typename TD, typename TL>
inline void layernorm_backward_row16(float* dx, TL* lo, float* part, const TD* dy, const float* x,
                                     const float* w, float m, float r, int C) {
  const __m512 vm = _mm512_set1_ps(m), vr = _mm512_set1_ps(r);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, t0 = s0, t1 = s0;
  int c = 0;
  for (; c + 32 <= C; c += 32) {
    const __m512 dn0 = _mm512_mul_ps(load16(dy + c, 0xFFFF), _mm512_loadu_ps(w + c));
    const __m512 dn1 = _mm512_mul_ps(load16(dy + c + 16, 0xFFFF), _mm512_loadu_ps(w + c + 16));
    const __m512 n0 = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + c), vm), vr);
    const __m512 n1 = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + c + 16), vm), vr);
    s0 = _mm512_add_ps(s0, dn0);
    s1 = _mm512_add_ps(s1, dn1);
    t0 = _mm512_fmadd_ps(dn0, n0, t0);
    t1 = _mm512_fmadd_ps(dn1, n1, t1);
  }
  for (; c < C; c += 16) {
    const __mmask16 k = first_lanes(C - c);
    const __m512 dn = _mm512_mul_ps(load16(dy + c, k), _mm512_maskz_loadu_ps(k, w + c));
    const __m512 nr =
        _mm512_mul_ps(_mm512_maskz_sub_ps(k, _mm512_maskz_loadu_ps(k, x + c), vm), vr);
    s0 = _mm512_add_ps(s0, dn);
    t0 = _mm512_fmadd_ps(dn, nr, t0);
  }
  const __m512 mean_dn = _mm512_set1_ps(hsum16(_mm512_add_ps(s0, s1)) / C);
  const __m512 mean_dn_n = _mm512_set1_ps(hsum16(_mm512_add_ps(t0, t1)) / C);
  for_each16(0, C, [&](int64_t c, __mmask16 k) {
    const __m512 d = load16(dy + c, k);
    const __m512 nr = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + c), vm), vr);
    const __m512 t = _mm512_fnmadd_ps(nr, mean_dn_n,
                                      _mm512_fmsub_ps(d, _mm512_maskz_loadu_ps(k, w + c), mean_dn));
    const __m512 g = _mm512_fmadd_ps(t, vr, _mm512_maskz_loadu_ps(k, dx + c));
    _mm512_mask_storeu_ps(dx + c, k, g);
    if (lo != nullptr) store16(lo + c, k, g);
    if (part != nullptr) {
      _mm512_mask_storeu_ps(part + c, k,
                            _mm512_fmadd_ps(d, nr, _mm512_maskz_loadu_ps(k, part + c)));
      _mm512_mask_storeu_ps(part + C + c, k,
                            _mm512_add_ps(_mm512_maskz_loadu_ps(k, part + C + c), d));
    }
  });
}

// acc[j] += add[j] for j < n.
inline void add_floats(float* acc, const float* add, int64_t n) {
  for_each16(0, n, [&](int64_t j, __mmask16 k) {
    _mm512_mask_storeu_ps(
        acc + j, k,
        _mm512_add_ps(_mm512_maskz_loadu_ps(k, acc + j), _mm512_maskz_loadu_ps(k, add + j)));
  });
}

// The parameter gradients alone, parallel over columns: for each block of rows, its
// sum in row order, added to the running total in block order (the fused form's operations).
template <typename TD>
void layernorm_param_grads_by_columns16(float* dweight, float* dbias, const TD* dout,
                                        const float* inp, const float* mean, const float* rstd,
                                        int N, int C) {
#pragma omp parallel
  {
    int64_t c0, c1;
    thread_range(C, 16, &c0, &c1);
    for (int64_t cb = c0; cb < c1; cb += kColBlock) {
      const int64_t w = std::min<int64_t>(kColBlock, c1 - cb);
      alignas(64) float acc_w[kColBlock] = {}, acc_b[kColBlock] = {};
      alignas(64) float part_w[kColBlock], part_b[kColBlock];
      for (int64_t b = 0; b < ln_blocks(N); ++b) {
        std::fill(part_w, part_w + kColBlock, 0.0f);  // whole: the last vector is stored whole
        std::fill(part_b, part_b + kColBlock, 0.0f);
        for (int64_t n = ln_block_begin(b, N); n < ln_block_begin(b + 1, N); ++n) {
          const float* x = inp + n * C + cb;
          const TD* dy = dout + n * C + cb;
          const __m512 vm = _mm512_set1_ps(mean[n]), vr = _mm512_set1_ps(rstd[n]);
          for_each16(0, w, [&](int64_t j, __mmask16 k) {
            const __m512 d = load16(dy + j, k);
            const __m512 nr = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), vm), vr);
            _mm512_store_ps(part_w + j, _mm512_fmadd_ps(d, nr, _mm512_load_ps(part_w + j)));
            _mm512_store_ps(part_b + j, _mm512_add_ps(_mm512_load_ps(part_b + j), d));
          });
        }
        add_floats(acc_w, part_w, w);
        add_floats(acc_b, part_b, w);
      }
      if (dweight != nullptr) add_floats(dweight + cb, acc_w, w);
      if (dbias != nullptr) add_floats(dbias + cb, acc_b, w);
    }
  }
}

template <typename TD, typename TL = float>
void layernorm_backward_t(float* dinp, float* dweight, float* dbias, const TD* dout,
                          const float* inp, const float* weight, const float* mean,
                          const float* rstd, int N, int C, TL* dinp_low = nullptr) {
  const bool params = dweight != nullptr || dbias != nullptr;
  const bool fused = dinp != nullptr && params && C <= kLnFusedMaxC;
  if (dinp != nullptr && !fused) {  // the input gradient alone: rows are independent
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      layernorm_backward_row16(dinp + n * C, dinp_low != nullptr ? dinp_low + n * C : nullptr,
                               static_cast<float*>(nullptr), dout + n * C, inp + n * C, weight,
                               mean[n], rstd[n], C);
    }
  }
  if (!params) return;
  if (!fused) {
    layernorm_param_grads_by_columns16(dweight, dbias, dout, inp, mean, rstd, N, C);
    return;
  }
  // One pass: each block's input gradient is written and its parameter gradients summed (into
  // its own row of `parts`) in the same pass; the blocks' sums are added in block order after the
  // parallel loop. (Blocks in rounds with a barrier each, holding only two partial sums per
  // thread, ran 20-40x slower on this shared machine: a barrier in the middle of a parallel
  // region costs whole scheduler time slices when other processes compete for the cores.)
  const int64_t blocks = ln_blocks(N);
  alignas(64) float parts[kLnBlocks][2 * kLnFusedMaxC];
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    float* part = parts[b];
    std::fill(part, part + 2 * C, 0.0f);
    for (int64_t n = ln_block_begin(b, N); n < ln_block_begin(b + 1, N); ++n) {
      layernorm_backward_row16(dinp + n * C, dinp_low != nullptr ? dinp_low + n * C : nullptr, part,
                               dout + n * C, inp + n * C, weight, mean[n], rstd[n], C);
    }
  }
  alignas(64) float acc[2 * kLnFusedMaxC];
  std::fill(acc, acc + 2 * C, 0.0f);
  for (int64_t b = 0; b < blocks; ++b) add_floats(acc, parts[b], 2 * int64_t{C});
  if (dweight != nullptr) add_floats(dweight, acc, C);
  if (dbias != nullptr) add_floats(dbias, acc + C, C);
}
#else
// With dinp_low (not null), also stores each updated dinp value rounded to TL there.
template <typename TD, typename TL = float>
void layernorm_backward_t(float* dinp, float* dweight, float* dbias, const TD* dout,
                          const float* inp, const float* weight, const float* mean,
                          const float* rstd, int N, int C, TL* dinp_low = nullptr) {
  // Input gradient: rows are independent.
  if (dinp != nullptr) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = inp + n * C;
      const TD* dy = dout + n * C;
      const float m = mean[n], r = rstd[n];
      float sum_dn = 0.0f, sum_dn_n = 0.0f;
#pragma omp simd reduction(+ : sum_dn, sum_dn_n)
      for (int c = 0; c < C; ++c) {
        const float dn = to_f32(dy[c]) * weight[c];
        sum_dn += dn;
        sum_dn_n += dn * (x[c] - m) * r;
      }
      const float mean_dn = sum_dn / C, mean_dn_n = sum_dn_n / C;
      float* dx = dinp + n * C;
      if (dinp_low == nullptr) {
#pragma omp simd
        for (int c = 0; c < C; ++c) {
          const float norm = (x[c] - m) * r;
          dx[c] += (to_f32(dy[c]) * weight[c] - mean_dn - norm * mean_dn_n) * r;
        }
      } else {
        TL* lo = dinp_low + n * C;
#pragma omp simd
        for (int c = 0; c < C; ++c) {
          const float norm = (x[c] - m) * r;
          const float v = dx[c] + (to_f32(dy[c]) * weight[c] - mean_dn - norm * mean_dn_n) * r;
          dx[c] = v;
          lo[c] = from_f32<TL>(v);
        }
      }
    }
  }
  // Parameter gradients: reductions over rows, parallel over channels (deterministic).
  if (dweight == nullptr && dbias == nullptr) return;
#pragma omp parallel
  {
    int64_t c0, c1;
    thread_range(C, 16, &c0, &c1);
    for (int64_t cb = c0; cb < c1; cb += kColBlock) {
      const int64_t w = std::min<int64_t>(kColBlock, c1 - cb);
      float acc_w[kColBlock] = {}, acc_b[kColBlock] = {};
      for (int64_t n = 0; n < N; ++n) {
        const float* x = inp + n * C + cb;
        const TD* dy = dout + n * C + cb;
        const float m = mean[n], r = rstd[n];
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) {
          const float d = to_f32(dy[j]);
          acc_w[j] += d * ((x[j] - m) * r);
          acc_b[j] += d;
        }
      }
      if (dweight != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) dweight[cb + j] += acc_w[j];
      }
      if (dbias != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) dbias[cb + j] += acc_b[j];
      }
    }
  }
}

#endif

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C) {
  layernorm_forward_t(out, mean, rstd, inp, weight, bias, N, C);
}
void layernorm_forward(bf16_t* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C) {
  layernorm_forward_t(out, mean, rstd, inp, weight, bias, N, C);
}
void layernorm_forward(f16_t* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C) {
  layernorm_forward_t(out, mean, rstd, inp, weight, bias, N, C);
}
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C) {
  layernorm_backward_t(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
}
void layernorm_backward(float* dinp, float* dweight, float* dbias, const f16_t* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C) {
  layernorm_backward_t(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
}
void layernorm_backward(float* dinp, float* dweight, float* dbias, const bf16_t* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C) {
  layernorm_backward_t(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
}
void layernorm_backward(float* dinp, bf16_t* dinp_low, float* dweight, float* dbias,
                        const bf16_t* dout, const float* inp, const float* weight,
                        const float* mean, const float* rstd, int N, int C) {
  HR_CHECK(dinp != nullptr && dinp_low != nullptr);
  layernorm_backward_t(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, dinp_low);
}
void layernorm_backward(float* dinp, f16_t* dinp_low, float* dweight, float* dbias,
                        const f16_t* dout, const float* inp, const float* weight, const float* mean,
                        const float* rstd, int N, int C) {
  HR_CHECK(dinp != nullptr && dinp_low != nullptr);
  layernorm_backward_t(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, dinp_low);
}

// ---- matmul --------------------------------------------------------------------------------

int64_t activation_row_stride(int64_t cols, int64_t elem_bytes) {
  return (cols * elem_bytes) % 4096 == 0 ? cols + 64 / elem_bytes : cols;
}

namespace {
// Operand types: A and B of type TA (f32 or bf16), C of type TC.
template <typename TA, typename TC>
void mm(bool ta, bool tb, int M, int N, int K, const TA* A, int lda, const TA* B, int ldb, TC* C,
        int ldc, const float* bias, bool accumulate) {
  if constexpr (std::is_same_v<TA, float> && std::is_same_v<TC, float>) {
    gemm(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, bias, accumulate);
  } else {
    gemm_ex(ta, tb, M, N, K, dtype_of<TA>(), A, lda, B, ldb, dtype_of<TC>(), C, ldc, bias,
            accumulate);
  }
}

template <typename TA, typename TO>
void matmul_forward_t(TO* out, const TA* inp, const TA* weight, const float* bias, int N, int IC,
                      int OC, WeightLayout layout, MatmulStrides st) {
  const int ldi = int(st.inp ? st.inp : IC), ldo = int(st.out ? st.out : OC);
  if (layout == WeightLayout::kInOut) {
    mm(false, false, N, OC, IC, inp, ldi, weight, OC, out, ldo, bias, false);
  } else {
    mm(false, true, N, OC, IC, inp, ldi, weight, IC, out, ldo, bias, false);
  }
}

template <typename T>
void matmul_backward_t(T* dinp, float* dweight, float* dbias, const T* dout, const T* inp,
                       const T* weight, int N, int IC, int OC, WeightLayout layout,
                       MatmulStrides st, const Bf16WgradStaging* ws = nullptr) {
  const bool in_out = layout == WeightLayout::kInOut;
  const int ldi = int(st.inp ? st.inp : IC), ldo = int(st.out ? st.out : OC);
  if (dinp != nullptr) {  // dinp[N,IC] = dout[N,OC] x weight^T
    if (in_out) {
      mm(false, true, N, IC, OC, dout, ldo, weight, OC, dinp, ldi, nullptr, false);
    } else {
      mm(false, false, N, IC, OC, dout, ldo, weight, IC, dinp, ldi, nullptr, false);
    }
  }
  // Only the bf16 overload passes a staging: the transposed path exists for bf16 operands.
  constexpr bool kBf16 = std::is_same_v<T, bf16_t>;
  const bool transposed = ws != nullptr && (ws->inp_t != nullptr || ws->out_t != nullptr);
  HR_CHECK_MSG(!transposed || kBf16,
               "matmul_backward: transposed weight-gradient operands are for bf16 only");
  if (dweight != nullptr && transposed) {
    if constexpr (std::is_same_v<T, bf16_t>) {
      // kOutIn's dout^T may come in chunks of its rows (the staging's rows, a multiple of 16).
      const int64_t out_rows = int64_t(ws->out_t_elems / size_t(N));
      const int64_t chunk = in_out || out_rows >= OC ? int64_t(OC) : out_rows / 16 * 16;
      HR_CHECK_MSG(ws->inp_t != nullptr && ws->inp_t_elems >= size_t(IC) * size_t(N),
                   "bf16 weight gradient: the staging for inp^T is missing or too small");
      HR_CHECK_MSG(ws->out_t != nullptr && chunk >= std::min(OC, 16) &&
                       (!in_out || ws->out_t_elems >= size_t(OC) * size_t(N)),
                   "bf16 weight gradient: the staging for dout^T is missing or too small");
      const Bf16WgradCopies copies = bf16_wgrad_copies(N, layout);
      if (copies.inp_t) transpose(ws->inp_t, N, inp, ldi, N, IC);  // inp^T [IC, N]
      // dweight[IC,OC] += inp^T x dout (kInOut), dweight[OC,IC] += dout^T x inp (kOutIn, rows
      // [o0, o1) per chunk): A is the first operand's copy; B the second's copy (transposed,
      // K-contiguous) or its rows.
      const bool b_copied = in_out ? copies.out_t : copies.inp_t;
      const bf16_t* b = b_copied ? (in_out ? ws->out_t : ws->inp_t) : (in_out ? dout : inp);
      const int ldb = b_copied ? N : (in_out ? ldo : ldi);
      for (int64_t o0 = 0; o0 < OC; o0 += chunk) {
        const int o1 = int(std::min<int64_t>(OC, o0 + chunk));
        if (copies.out_t) transpose(ws->out_t, N, dout + o0, ldo, N, o1 - int(o0));  // dout^T
        const bf16_t* a = in_out ? ws->inp_t : ws->out_t;
        const int rows = in_out ? IC : o1 - int(o0), cols = in_out ? OC : IC;
        gemm_ex(false, b_copied, rows, cols, N, DType::kBF16, a, N, b, ldb, DType::kF32,
                dweight + o0 * cols, cols, nullptr, true);
      }
    }
  } else if (dweight != nullptr) {  // accumulated (in fp32) through oneDNN's sum post-op
    if (in_out) {                   // dweight[IC,OC] += inp^T x dout
      mm(true, false, IC, OC, N, inp, ldi, dout, ldo, dweight, OC, nullptr, true);
    } else {  // dweight[OC,IC] += dout^T x inp
      mm(true, false, OC, IC, N, dout, ldo, inp, ldi, dweight, IC, nullptr, true);
    }
  }
  if (dbias != nullptr) {
#pragma omp parallel
    {
      int64_t c0, c1;
      thread_range(OC, 16, &c0, &c1);
      add_column_sums(dbias, dout, N, ldo, c0, c1);
    }
  }
}
}  // namespace

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                    int IC, int OC, WeightLayout layout, MatmulStrides st) {
  matmul_forward_t(out, inp, weight, bias, N, IC, OC, layout, st);
}
void matmul_forward(float* out, const bf16_t* inp, const bf16_t* weight, const float* bias, int N,
                    int IC, int OC, WeightLayout layout, MatmulStrides st) {
  matmul_forward_t(out, inp, weight, bias, N, IC, OC, layout, st);
}
void matmul_forward(bf16_t* out, const bf16_t* inp, const bf16_t* weight, const float* bias, int N,
                    int IC, int OC, WeightLayout layout, MatmulStrides st) {
  matmul_forward_t(out, inp, weight, bias, N, IC, OC, layout, st);
}
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int IC, int OC, WeightLayout layout,
                     MatmulStrides st) {
  matmul_backward_t(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout, st);
}
void matmul_backward(bf16_t* dinp, float* dweight, float* dbias, const bf16_t* dout,
                     const bf16_t* inp, const bf16_t* weight, int N, int IC, int OC,
                     WeightLayout layout, MatmulStrides st) {
  matmul_backward_t(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout, st);
}
void matmul_backward(bf16_t* dinp, float* dweight, float* dbias, const bf16_t* dout,
                     const bf16_t* inp, const bf16_t* weight, int N, int IC, int OC,
                     WeightLayout layout, MatmulStrides st, const Bf16WgradStaging& staging) {
  matmul_backward_t(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout, st, &staging);
}
bool bf16_wgrad_transposes(int N, int IC, int OC) {
  if (const char* env = std::getenv("HEADROOM_BF16_WGRAD_TRANSPOSE"); env != nullptr && *env) {
    if (std::string_view(env) != "0" && std::string_view(env) != "1") {
      // A measurement knob set wrong is the user's error, said as such (the CLI prints it).
      throw std::invalid_argument(std::string("HEADROOM_BF16_WGRAD_TRANSPOSE=") + env +
                                  ": expected 0 or 1");
    }
    return *env == '1';
  }
  // GPT-2 124M (docs/gemm.md): the MLP's 768 <-> 3072 and the LM head's won, the attention's
  // 768 -> 768 and 768 -> 2304 did not.
  return N > 0 && std::max(IC, OC) >= 3072;
}

Bf16WgradCopies bf16_wgrad_copies(int N, WeightLayout layout) {
  if (!amx_gemm_takes(N, DType::kF32)) return {.inp_t = true, .out_t = true};
  return layout == WeightLayout::kInOut ? Bf16WgradCopies{.inp_t = true, .out_t = false}
                                        : Bf16WgradCopies{.inp_t = false, .out_t = true};
}

// ---- fp16 GEMMs: widen, fp32 GEMM, narrow ------------------------------------------------
// See Note [fp16 GEMMs] in docs/notes/mixed-precision.md: oneDNN 2.6 creates no f16 matmul on
// this CPU, so the f16 operands are widened (exactly) into the bound staging area.
namespace {
float* g_f16_staging = nullptr;
size_t g_f16_staging_floats = 0;

// d[j] = float(s[j]) for j < n (vcvtph2ps, 16 at a time); exact.
inline void f16_span_to_f32(float* d, const f16_t* s, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    // (maskz forms with a full mask: GCC 12 warns falsely about the plain ones, as in bf16.h.)
    _mm512_storeu_ps(
        d + j,
        _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + j))));
  }
#endif
  for (; j < n; ++j) d[j] = to_f32(s[j]);
}

// d[j] = f16(s[j]) for j < n, round to nearest even (vcvtps2ph), as from_f32<f16_t>.
inline void f32_span_to_f16(f16_t* d, const float* s, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + j),
                        _mm512_maskz_cvtps_ph(0xFFFF, _mm512_loadu_ps(s + j),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  for (; j < n; ++j) d[j] = from_f32<f16_t>(s[j]);
}

// dst[r*ld_dst + c] = src[r*ld_src + c].
void widen_f16(float* dst, int64_t ld_dst, const f16_t* src, int64_t ld_src, int64_t rows,
               int64_t cols) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) f16_span_to_f32(dst + r * ld_dst, src + r * ld_src, cols);
}

// dst[r*ld_dst + c] = f16(src[r*ld_src + c]).
void narrow_f16(f16_t* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows,
                int64_t cols) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) f32_span_to_f16(dst + r * ld_dst, src + r * ld_src, cols);
}

// The row stride of a staged fp32 matrix of `cols` columns: padded off multiples of 4 KiB, as
// the fp32 activations are (activation_row_stride; dense 3072-float rows ran the MLP GEMMs about
// 2x slower here too).
int64_t staged_ld(int64_t cols) { return activation_row_stride(cols, 4); }

// Takes `floats` from the staging area at *cursor.
float* take_staging(size_t* cursor, size_t floats) {
  HR_CHECK_MSG(g_f16_staging != nullptr, "an fp16 GEMM ran without its staging area bound");
  HR_CHECK_MSG(*cursor + floats <= g_f16_staging_floats,
               "the fp16 GEMM staging area is smaller than this GEMM's operands");
  float* p = g_f16_staging + *cursor;
  *cursor += floats;
  return p;
}

// An fp32 view of a GEMM operand: itself, or (f16) its widened dense copy in the staging area.
// The operand is stored [rows, cols] with leading dimension ld (rows x cols as it lies in memory,
// whether or not the GEMM transposes it).
template <typename T>
const float* as_f32(const T* x, int64_t rows, int64_t cols, int* ld, size_t* cursor) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const int64_t ldw = staged_ld(cols);
    float* w = take_staging(cursor, size_t(rows * ldw));
    widen_f16(w, ldw, x, *ld, rows, cols);
    *ld = int(ldw);
    return w;
  }
}

// C = op(A) op(B) (+ bias) with any of A, B, C in f16 (fp32 otherwise); as gemm().
template <typename TA, typename TB, typename TC>
void mm16(bool ta, bool tb, int M, int N, int K, const TA* A, int lda, const TB* B, int ldb, TC* C,
          int ldc, const float* bias, bool accumulate) {
  size_t cursor = 0;
  const float* a = as_f32(A, ta ? K : M, ta ? M : K, &lda, &cursor);
  const float* b = as_f32(B, tb ? N : K, tb ? K : N, &ldb, &cursor);
  if constexpr (std::is_same_v<TC, float>) {
    gemm(ta, tb, M, N, K, a, lda, b, ldb, C, ldc, bias, accumulate);
  } else {
    HR_CHECK(!accumulate);  // f16 outputs are activations or their gradients: overwritten
    const int64_t ldt = staged_ld(N);
    float* c = take_staging(&cursor, size_t(M * ldt));
    gemm(ta, tb, M, N, K, a, lda, b, ldb, c, int(ldt), bias, false);
    narrow_f16(C, ldc, c, ldt, M, N);
  }
}

template <typename TO, typename TD, typename TI>
void matmul_backward16(TO* dinp, float* dweight, float* dbias, const TD* dout, const TI* inp,
                       const float* weight, int N, int IC, int OC, WeightLayout layout,
                       MatmulStrides st) {
  const bool in_out = layout == WeightLayout::kInOut;
  const int ldi = int(st.inp ? st.inp : IC), ldo = int(st.out ? st.out : OC);
  if (dinp != nullptr) {
    if (in_out) {
      mm16(false, true, N, IC, OC, dout, ldo, weight, OC, dinp, ldi, nullptr, false);
    } else {
      mm16(false, false, N, IC, OC, dout, ldo, weight, IC, dinp, ldi, nullptr, false);
    }
  }
  if (dweight != nullptr) {
    if (in_out) {
      mm16(true, false, IC, OC, N, inp, ldi, dout, ldo, dweight, OC, nullptr, true);
    } else {
      mm16(true, false, OC, IC, N, dout, ldo, inp, ldi, dweight, IC, nullptr, true);
    }
  }
  if (dbias != nullptr) {
#pragma omp parallel
    {
      int64_t c0, c1;
      thread_range(OC, 16, &c0, &c1);
      add_column_sums(dbias, dout, N, ldo, c0, c1);
    }
  }
}

template <typename TO>
void matmul_forward16(TO* out, const f16_t* inp, const float* weight, const float* bias, int N,
                      int IC, int OC, WeightLayout layout, MatmulStrides st) {
  const int ldi = int(st.inp ? st.inp : IC), ldo = int(st.out ? st.out : OC);
  if (layout == WeightLayout::kInOut) {
    mm16(false, false, N, OC, IC, inp, ldi, weight, OC, out, ldo, bias, false);
  } else {
    mm16(false, true, N, OC, IC, inp, ldi, weight, IC, out, ldo, bias, false);
  }
}
}  // namespace

F16GemmStaging::F16GemmStaging(float* area, size_t floats)
    : prev_(g_f16_staging), prev_floats_(g_f16_staging_floats) {
  g_f16_staging = area;
  g_f16_staging_floats = floats;
}
F16GemmStaging::~F16GemmStaging() {
  g_f16_staging = prev_;
  g_f16_staging_floats = prev_floats_;
}

void bind_f16_gemm_staging(float* area, size_t floats, float** prev, size_t* prev_floats) {
  *prev = g_f16_staging;
  *prev_floats = g_f16_staging_floats;
  g_f16_staging = area;
  g_f16_staging_floats = floats;
}

size_t f16_matmul_staging_floats(int64_t N, int64_t IC, int64_t OC) {
  // Forward: inp (N x IC) and an f16 out (N x OC); backward dinp: dout and dinp; dweight: inp
  // and dout. The weight operand is fp32 and never staged. Rows padded as staged_ld.
  return size_t(N * (staged_ld(IC) + staged_ld(OC)));
}

void matmul_forward(float* out, const f16_t* inp, const float* weight, const float* bias, int N,
                    int IC, int OC, WeightLayout layout, MatmulStrides st) {
  matmul_forward16(out, inp, weight, bias, N, IC, OC, layout, st);
}
void matmul_forward(f16_t* out, const f16_t* inp, const float* weight, const float* bias, int N,
                    int IC, int OC, WeightLayout layout, MatmulStrides st) {
  matmul_forward16(out, inp, weight, bias, N, IC, OC, layout, st);
}
void matmul_backward(f16_t* dinp, float* dweight, float* dbias, const f16_t* dout, const f16_t* inp,
                     const float* weight, int N, int IC, int OC, WeightLayout layout,
                     MatmulStrides st) {
  matmul_backward16(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout, st);
}
void matmul_backward(f16_t* dinp, float* dweight, float* dbias, const float* dout, const f16_t* inp,
                     const float* weight, int N, int IC, int OC, WeightLayout layout,
                     MatmulStrides st) {
  matmul_backward16(dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout, st);
}
void gemm_f16(bool trans_a, bool trans_b, int M, int N, int K, const f16_t* A, int lda,
              const float* B, int ldb, float* C, int ldc, const float* bias, bool accumulate) {
  mm16(trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, bias, accumulate);
}
void gemm_f16(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda,
              const f16_t* B, int ldb, float* C, int ldc, const float* bias, bool accumulate) {
  mm16(trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, bias, accumulate);
}
void gemm_f16(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda,
              const float* B, int ldb, f16_t* C, int ldc, const float* bias) {
  mm16(trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, bias, false);
}

// ---- attention -----------------------------------------------------------------------------
// Layout: a qkv row holds the NH q heads, then the NKV k heads, then the NKV v heads, HS each
// (with NKV == NH: q, k, v of C each); query head h reads kv head j = h / (NH / NKV). The
// forward's (b, h) pairs are independent and own their slices of out / att; the backward's tasks
// are (b, j) pairs, which own kv head j's dk / dv and their query heads' dq and scratch rows, so
// the loops run in parallel without races.

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                       int NKV) {
  HR_CHECK(NH > 0 && NKV > 0 && NH % NKV == 0 && C % NH == 0);
  const int HS = C / NH, group = NH / NKV;
  const int64_t W = int64_t{NH + 2 * NKV} * HS;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      const int j = h / group;
      const float* q0 = qkv + int64_t{b} * T * W + int64_t{h} * HS;
      const float* k0 = qkv + int64_t{b} * T * W + int64_t{NH + j} * HS;
      const float* v0 = k0 + int64_t{NKV} * HS;
      float* att_bh = att + (int64_t{b} * NH + h) * T * T;
      for (int t = 0; t < T; ++t) {
        const float* q = q0 + t * W;
        float* row = att_bh + int64_t{t} * T;
        float maxv = -INFINITY;
        for (int s = 0; s <= t; ++s) {
          const float v = dot(q, k0 + s * W, HS) * scale;
          row[s] = v;
          maxv = std::max(maxv, v);
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int s = 0; s <= t; ++s) {
          const float e = fast_exp(row[s] - maxv);
          row[s] = e;
          sum += e;
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int s = 0; s <= t; ++s) row[s] *= inv;
        for (int s = t + 1; s < T; ++s) row[s] = 0.0f;
        float* o = out + (int64_t{b} * T + t) * C + int64_t{h} * HS;
        std::fill(o, o + HS, 0.0f);
        for (int s = 0; s <= t; ++s) axpy(o, row[s], v0 + s * W, HS);
      }
    }
  }
}

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
  attention_forward(out, att, qkv, B, T, C, NH, NH);
}

size_t attention_backward_scratch_floats(int B, int T, int NH, int NKV) {
  // One row of dL/d(probabilities) per (b, query head): independent of the thread count, so the
  // planner can size it from the shapes alone.
  (void)NKV;
  return static_cast<size_t>(B) * NH * T;
}
size_t attention_backward_scratch_floats(int B, int T, int NH) {
  return attention_backward_scratch_floats(B, T, NH, NH);
}

void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                        const float* att, int B, int T, int C, int NH, int NKV) {
  HR_CHECK(NH > 0 && NKV > 0 && NH % NKV == 0 && C % NH == 0);
  const int HS = C / NH, group = NH / NKV;
  const int64_t W = int64_t{NH + 2 * NKV} * HS;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < NKV; ++j) {
      const int64_t row0 = int64_t{b} * T * W;
      const float* k0 = qkv + row0 + int64_t{NH + j} * HS;
      const float* v0 = k0 + int64_t{NKV} * HS;
      float* dk0 = dqkv + row0 + int64_t{NH + j} * HS;
      float* dv0 = dk0 + int64_t{NKV} * HS;
      for (int t = 0; t < T; ++t) {
        std::fill(dk0 + t * W, dk0 + t * W + HS, 0.0f);
        std::fill(dv0 + t * W, dv0 + t * W + HS, 0.0f);
      }
      for (int i = 0; i < group; ++i) {  // dk, dv summed over the group in this order
        const int h = j * group + i;
        const float* q0 = qkv + row0 + int64_t{h} * HS;
        float* dq0 = dqkv + row0 + int64_t{h} * HS;
        const float* att_bh = att + (int64_t{b} * NH + h) * T * T;
        float* datt = scratch + (int64_t{b} * NH + h) * T;
        for (int t = 0; t < T; ++t) std::fill(dq0 + t * W, dq0 + t * W + HS, 0.0f);
        for (int t = 0; t < T; ++t) {
          const float* row = att_bh + int64_t{t} * T;
          const float* dy = dout + (int64_t{b} * T + t) * C + int64_t{h} * HS;
          // out_t = sum_s p_s v_s  =>  dp_s = dy . v_s,  dv_s += p_s dy
          float sum_pdp = 0.0f;
          for (int s = 0; s <= t; ++s) {
            const float dp = dot(dy, v0 + s * W, HS);
            datt[s] = dp;
            sum_pdp += row[s] * dp;
            axpy(dv0 + s * W, row[s], dy, HS);
          }
          // softmax: dscore_s = p_s (dp_s - sum_u p_u dp_u); score = scale * q . k
          const float* q = q0 + t * W;
          float* dq = dq0 + t * W;
          for (int s = 0; s <= t; ++s) {
            const float ds = row[s] * (datt[s] - sum_pdp) * scale;
            axpy(dq, ds, k0 + s * W, HS);
            axpy(dk0 + s * W, ds, q, HS);
          }
        }
      }
    }
  }
}

void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                        const float* att, int B, int T, int C, int NH) {
  attention_backward(dqkv, scratch, dout, qkv, att, B, T, C, NH, NH);
}

// ---- GELU ----------------------------------------------------------------------------------

namespace {
#if !HR_AVX512_KERNELS
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCube = 0.044715f;
#endif

#if HR_AVX512_KERNELS
// See Note [GELU by lookup table] in docs/notes/memory-bound-kernels.md. A bf16 or f16 input has
// 65536 possible values, so GELU in 16-bit storage is a function of 16 bits. The tables are
// computed once, on first use, by the same instructions as the computed path (gelu16 then
// store16; gelu_grad16<true> in fp32), so a lookup returns the computed path's bits for every
// input. A static local: built once, thread-safe (C++11), outside the memory plan like oneDNN's
// code.
template <typename T>
struct GeluForwardTable {
  // One entry per input's bits. The gather reads 32 bits at 2 * index, i.e. entries i and i + 1
  // (the upper half discarded): the padding (one entry needed, a cache line's worth kept) keeps
  // the read at 0xFFFF inside the array.
  alignas(64) T out[65536 + 32];
  GeluForwardTable() {
    alignas(64) T x[16];
    for (int i = 0; i < 65536; i += 16) {
      for (int j = 0; j < 16; ++j) x[j] = T{uint16_t(i + j)};
      store16(out + i, 0xFFFF, gelu16<true>(load16(x, 0xFFFF)));
    }
    for (int i = 65536; i < 65536 + 32; ++i) out[i] = T{0};
  }
};
template <typename T>
struct GeluGradTable {
  alignas(64) float grad[65536];  // gelu'(x) in fp32, by gelu_grad16<true>
  GeluGradTable() {
    alignas(64) T x[16];
    for (int i = 0; i < 65536; i += 16) {
      for (int j = 0; j < 16; ++j) x[j] = T{uint16_t(i + j)};
      _mm512_store_ps(grad + i, gelu_grad16<true>(load16(x, 0xFFFF)));
    }
  }
};
template <typename T>
const T* gelu_forward_table() {
  static const GeluForwardTable<T> table;
  return table.out;
}
template <typename T>
const float* gelu_grad_table() {
  static const GeluGradTable<T> table;
  return table.grad;
}

// The 16 inputs' bits as 32-bit gather indices (lanes outside m: 0, a valid index).
inline __m512i bits16(const void* p, __mmask16 m) {
  return _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_maskz_loadu_epi16(m, p));
}

// out[i] = table[bits(inp[i])] by vpgatherdd, each thread's range ending in one masked vector.
// (The masked gathers: GCC 12 warns falsely about the plain ones, as about other maskz forms.)
template <typename T>
void gelu_forward_lookup(T* out, const T* inp, int64_t n) {
  const T* table = gelu_forward_table<T>();
#pragma omp parallel
  {
    int64_t i0, i1;
    thread_range(n, 64, &i0, &i1);
    for_each16(i0, i1, [&](int64_t i, __mmask16 m) {
      // The input 4 KiB ahead, as the fp32 forward: 0.83-0.91x of the time without, in two
      // loaded runs each (the backward, prefetching both inputs: 0.88-1.0x, not done).
      _mm_prefetch(reinterpret_cast<const char*>(inp + std::min(i + 2048, n - 1)), _MM_HINT_T0);
      const __m512i v =
          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, bits16(inp + i, m), table, 2);
      _mm256_mask_storeu_epi16(out + i, m, _mm512_maskz_cvtepi32_epi16(0xFFFF, v));
    });
  }
}

// dinp[i] = gelu'(inp[i]) * dout[i], gelu' from the table (vgatherdps): the computed path's
// product, operands in the same order, so the same bits.
template <typename T>
void gelu_backward_lookup(T* dinp, const T* inp, const T* dout, int64_t n) {
  const float* table = gelu_grad_table<T>();
#pragma omp parallel
  {
    int64_t i0, i1;
    thread_range(n, 64, &i0, &i1);
    for_each16(i0, i1, [&](int64_t i, __mmask16 m) {
      const __m512 g =
          _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, bits16(inp + i, m), table, 4);
      store16(dinp + i, m, _mm512_mul_ps(g, load16(dout + i, m)));
    });
  }
}
#endif

// 16-bit storage: the narrow forms (see gelu16 and gelu_grad16).
template <typename T>
constexpr bool kNarrowStorage = !std::is_same_v<T, float>;
// Vectors per group (map16_grouped): eight in 16-bit storage; four in fp32, where eight took
// 1.06x the time of four (the backward; the forward 1.0-1.02x).
template <typename T>
constexpr int kGeluGroup = kNarrowStorage<T> ? 8 : 4;

// With AVX-512: fp32 storage through gelu16 / gelu_grad16 (fast_math.h), every element through
// the vector path; bf16 and f16 storage the same, or by table lookup where gelu_by_table() (the
// same bits, see above). Otherwise: plain loops that GCC vectorises, on fast_exp (the same
// sigma form as gelu16).
template <typename T>
void gelu_forward_t(T* out, const T* inp, int64_t n) {
#if HR_AVX512_KERNELS
  if constexpr (!std::is_same_v<T, float>) {
    if (gelu_by_table()) return gelu_forward_lookup(out, inp, n);
  }
  // Grouped, step by step, so that the vectors' long chains overlap.
  map16_grouped<kGeluGroup<T>>(out, inp, n, [](auto& v) { gelu16<kNarrowStorage<T>>(v); });
#else
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_f32(inp[i]);
    const float u = kGeluScale * (x + kGeluCube * x * x * x);
    // x sigma(2u), as gelu16; below x = -10 GELU is under 1.1e-37 in magnitude, and fast_exp's
    // clamp at 88 would leave x * 6e-39 (-6e-9 at x = -1e30): -0 there (a NaN keeps its way).
    out[i] = from_f32<T>(x < -10.0f ? -0.0f : x / (1.0f + fast_exp(-2.0f * u)));
  }
#endif
}

template <typename T>
void gelu_backward_t(T* dinp, const T* inp, const T* dout, int64_t n) {
#if HR_AVX512_KERNELS
  if constexpr (!std::is_same_v<T, float>) {
    if (gelu_by_table()) return gelu_backward_lookup(dinp, inp, dout, n);
  }
  map16_grouped<kGeluGroup<T>>(
      dinp, inp, dout, n, [](auto& v) { gelu_grad16<kNarrowStorage<T>>(v); },
      [](__m512 g, __m512 d) { return _mm512_mul_ps(g, d); });
#else
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float x = to_f32(inp[i]);
    x = x < -10.0f ? -10.0f : (x > 10.0f ? 10.0f : x);  // as gelu_grad16 (a NaN stays)
    const float u = kGeluScale * (x + kGeluCube * x * x * x);
    const float e = fast_exp(-2.0f * u), s = 1.0f / (1.0f + e);  // sigma(2u), 1 - sigma = e s
    const float du2 = 2.0f * kGeluScale * (1.0f + 3.0f * kGeluCube * x * x);
    dinp[i] = from_f32<T>(s * (1.0f + x * (e * s) * du2) * to_f32(dout[i]));
  }
#endif
}
}  // namespace

bool gelu_by_table() {
  if (const char* env = std::getenv("HEADROOM_GELU_TABLE"); env != nullptr && *env) {
    if (std::string_view(env) != "0" && std::string_view(env) != "1") {
      throw std::invalid_argument(std::string("HEADROOM_GELU_TABLE=") + env + ": expected 0 or 1");
    }
    return HR_AVX512_KERNELS && *env == '1';
  }
#if HR_AVX512_KERNELS
  // The lookup ran in 0.55-0.82x of the computed path's time on the Xeon of sessions 1-9; on the
  // AMD Zen 5 of session 10 the computed path ran in 0.81-1.04x of the lookup's (three alternated
  // runs; docs/notes/memory-bound-kernels.md, "Zen 5").
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
#else
  return false;
#endif
}

void gelu_forward(float* out, const float* inp, int64_t n) { gelu_forward_t(out, inp, n); }
void gelu_forward(bf16_t* out, const bf16_t* inp, int64_t n) { gelu_forward_t(out, inp, n); }
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  gelu_backward_t(dinp, inp, dout, n);
}
void gelu_backward(bf16_t* dinp, const bf16_t* inp, const bf16_t* dout, int64_t n) {
  gelu_backward_t(dinp, inp, dout, n);
}
void gelu_forward(f16_t* out, const f16_t* inp, int64_t n) { gelu_forward_t(out, inp, n); }
void gelu_backward(f16_t* dinp, const f16_t* inp, const f16_t* dout, int64_t n) {
  gelu_backward_t(dinp, inp, dout, n);
}

// ---- casts ---------------------------------------------------------------------------------

void cast_to_bf16(bf16_t* out, const float* inp, int64_t n) {
#if HR_AVX512_KERNELS
  map16(out, inp, n, [](__m512 x) { return x; });
#else
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = from_f32<bf16_t>(inp[i]);
#endif
}

void cast_to_f16(f16_t* out, const float* inp, int64_t n) {
  constexpr int64_t kBlock = 4096;
#pragma omp parallel for schedule(static)
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    f32_span_to_f16(out + i0, inp + i0, std::min(kBlock, n - i0));
  }
}

void round_to_f16_values(float* out, const float* inp, int64_t n) {
#if HR_AVX512_KERNELS
  map16(out, inp, n, [](__m512 x) {
    return _mm512_maskz_cvtph_ps(
        0xFFFF, _mm512_maskz_cvtps_ph(0xFFFF, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  });
#else
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = round_f16(inp[i]);
#endif
}

void round_rows_to_bf16_inplace(float* x, int64_t rows, int64_t cols, int64_t ld) {
  // Within a row, bf16 element j lands on bytes [2j, 2j+2), inside float j/2, which this pass
  // has already read: in order, blocks of 16 are read whole before they are written.
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * ld;
    bf16_t* out = reinterpret_cast<bf16_t*>(row);
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16) {
      bf16_t tmp[16];
#pragma omp simd
      for (int k = 0; k < 16; ++k) tmp[k] = from_f32<bf16_t>(row[j + k]);
      std::memcpy(out + j, tmp, sizeof(tmp));
    }
    for (; j < cols; ++j) {
      const bf16_t v = from_f32<bf16_t>(row[j]);
      std::memcpy(out + j, &v, sizeof(v));
    }
  }
}

// ---- residual ------------------------------------------------------------------------------

void residual_forward(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void residual_backward(float* da, float* db, const float* dout, int64_t n) {
  if (da != nullptr) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) da[i] += dout[i];
  }
  if (db != nullptr) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) db[i] += dout[i];
  }
}

// ---- cross-entropy -------------------------------------------------------------------------

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                           int N, int V, int64_t ld) {
  if (ld == 0) ld = V;
  HR_CHECK(ld >= V);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int32_t target = targets[n];
    HR_CHECK(target >= -1 && target < V);
    if (target < 0) {
      losses[n] = 0.0f;
      if (lse != nullptr) lse[n] = 0.0f;
      continue;
    }
    const float* x = logits + n * ld;
    // The next row into L2 while this one's exponentials are computed (see softmax_row_stats).
    const double l = softmax_row_lse(x, V, n + 1 < N ? x + ld : nullptr);
    losses[n] = static_cast<float>(l - x[target]);
    if (lse != nullptr) lse[n] = static_cast<float>(l);
  }
}

void cross_entropy_forward(float* losses, const float* logits, const int32_t* targets, int N,
                           int V) {
  cross_entropy_forward(losses, nullptr, logits, targets, N, V);
}

namespace {
// A row's gradient is softmax - onehot, times dloss: exp(x[i] - m) * c with c = dloss * exp(m - l)
// (m the row's max, l its log-sum-exp rounded to float), minus dloss at the target. Every path
// takes c from (m, l) this way, so a row's gradient is the same bits whether its exponentials were
// kept from the statistics (one pass) or computed from the saved lse (Note [Softmax statistics
// with the exponentials kept] in docs/notes/memory-bound-kernels.md).
inline float ce_scale(float m, float l, float dloss) { return fast_exp(m - l) * dloss; }

// One row of dlogits, d[i] = p(i) * c (minus dloss at the target), stored as D (float, bf16, or
// with kF16Values fp32 holding f16 values), where p(i) = exp(x[i] - m) computed here (kept null),
// or read from kept[i] (stored by softmax_row_stats). d may overlap x or kept as far as d's
// element j starts at or before their element j (in place: fp32 over fp32, or bf16 over the
// first half of the same fp32 row): every block of 64 is read whole before it is written, and the
// target's value first.
// prefetch: a row to fetch into L2 meanwhile (null: none), one cache line per vector.
template <typename D, bool kF16Values = false>
void ce_grad_row(D* d, const float* x, const float* kept, int32_t target, float m, float c,
                 float dloss, int V, const float* prefetch = nullptr) {
  auto store = [&](int64_t j, float v) {
    D o;
    if constexpr (kF16Values) {
      o = round_f16(v);
    } else {
      o = from_f32<D>(v);
    }
    std::memcpy(d + j, &o, sizeof(D));  // d may be another type's memory: no aliasing UB
  };
#if HR_AVX512_KERNELS
  auto store_v = [&](int64_t j, __mmask16 k, __m512 v) {
    if constexpr (kF16Values) {
      store16(d + j, k,
              _mm512_maskz_cvtph_ps(
                  0xFFFF,
                  _mm512_maskz_cvtps_ph(0xFFFF, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    } else {
      store16(d + j, k, v);
    }
  };
  if (target < 0) {
    for_each16(0, V, [&](int64_t j, __mmask16 k) { store_v(j, k, _mm512_setzero_ps()); });
    return;
  }
  const __m512 vm = _mm512_set1_ps(m), vc = _mm512_set1_ps(c);
  // p at the target, read before the row is written: the lane's own value (exp16 of the same
  // difference, or the kept one).
  const float pt =
      kept != nullptr ? kept[target] : _mm512_cvtss_f32(exp16<true>(_mm512_set1_ps(x[target] - m)));
  auto p = [&](int64_t j, __mmask16 k) {
    return kept != nullptr ? _mm512_maskz_loadu_ps(k, kept + j)
                           : exp16<true>(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), vm));
  };
  for_each64(
      0, V,
      [&](int64_t j, __mmask16 k) {
        if (prefetch != nullptr) {
          _mm_prefetch(reinterpret_cast<const char*>(prefetch + j), _MM_HINT_T1);
        }
        store_v(j, k, _mm512_mul_ps(p(j, k), vc));
      },
      [&](int64_t j) {
        __m512 v[4];
        for (int q = 0; q < 4; ++q) {
          if (prefetch != nullptr) {
            _mm_prefetch(reinterpret_cast<const char*>(prefetch + j + 16 * q), _MM_HINT_T1);
          }
          v[q] = p(j + 16 * q, __mmask16(0xFFFF));
        }
        if constexpr (std::is_same_v<D, bf16_t>) {  // two vectors per conversion (store32)
          for (int q = 0; q < 4; q += 2) {
            store32(d + j + 16 * q, _mm512_mul_ps(v[q], vc), _mm512_mul_ps(v[q + 1], vc));
          }
        } else {
          for (int q = 0; q < 4; ++q)
            store_v(j + 16 * q, __mmask16(0xFFFF), _mm512_mul_ps(v[q], vc));
        }
      });
  store(target, pt * c - dloss);
#else
  (void)prefetch;
  if (target < 0) {
    for (int j = 0; j < V; ++j) store(j, 0.0f);
    return;
  }
  const float pt = kept != nullptr ? kept[target] : fast_exp(x[target] - m);  // before writes
  int j = 0;
  for (; j + 16 <= V; j += 16) {
    float v[16];
    if (kept != nullptr) {
#pragma omp simd
      for (int k = 0; k < 16; ++k) v[k] = kept[j + k] * c;
    } else {
#pragma omp simd
      for (int k = 0; k < 16; ++k) v[k] = fast_exp(x[j + k] - m) * c;
    }
    D o[16];
#pragma omp simd
    for (int k = 0; k < 16; ++k) {
      if constexpr (kF16Values) {
        o[k] = round_f16(v[k]);
      } else {
        o[k] = from_f32<D>(v[k]);
      }
    }
    std::memcpy(d + j, o, sizeof(o));
  }
  for (; j < V; ++j) store(j, (kept != nullptr ? kept[j] : fast_exp(x[j] - m)) * c);
  store(target, pt * c - dloss);
#endif
}

// Where ce_grad_rows takes each row's log-sum-exp from, and what else it writes: `lse` holds the
// forward's (read); or, with lse null, it is computed from the row, and with `losses` not null
// the row's loss (and, with `lse_out` not null, its lse) is stored as cross_entropy_forward
// stores them, from the same double (the one-pass forward and backward). With `keep`, the
// statistics keep the row's exponentials for the gradient, over the row's dlogits memory as
// fp32 (Note [The bf16 gradient over its own row] in docs/notes/memory-bound-kernels.md).
struct CeRowStats {
  const float* lse = nullptr;
  float* losses = nullptr;
  float* lse_out = nullptr;
  bool keep = false;
};

// Rows from their saved lse, or with statistics computed here (see CeRowStats). Either way a
// row's gradient is exp(x - m) * ce_scale(m, l, dloss) with the same m and l, so the same bits.
// ld: the row stride of logits in floats; dlogits' rows are ld * 4 bytes apart too (ld D
// elements for fp32, 2 ld for bf16), so each row of dlogits starts where its fp32 row does and
// has room for V floats, where the exponentials are kept.
template <typename D, bool kF16Values = false>
void ce_grad_rows(D* dlogits, const float* logits, CeRowStats st, const int32_t* targets,
                  int64_t n0, int64_t n1, int V, float dloss, int64_t ld) {
  const int64_t ldd = ld * int64_t(sizeof(float) / sizeof(D));
#pragma omp for schedule(static)
  for (int64_t n = n0; n < n1; ++n) {
    const int32_t target = targets[n];
    HR_CHECK(target >= -1 && target < V);
    const float* x = logits + n * ld;
    // This thread's next row (omp for static: a contiguous range), fetched into L2 while this
    // row's exponentials are computed: during the statistics where they are taken here (the
    // gradient pass then only scales and writes), else during the gradient pass.
    const float* next = n + 1 < n1 ? x + ld : nullptr;
    float l = 0.0f, m = 0.0f;
    float* kept = nullptr;
    D* d = dlogits + n * ldd;
    if (target >= 0 && st.lse != nullptr) {
      l = st.lse[n];
      m = row_max(x, V);  // the row's read from memory; the gradient's finds it in L2
    } else if (target >= 0) {
      if (st.keep) kept = reinterpret_cast<float*>(d);
      const float xt = x[target];  // before the exponentials may be kept over it
      float s;
      softmax_row_stats(x, V, &m, &s, kept, next);
      const double dl = std::log(static_cast<double>(s)) + m;  // as softmax_row_lse
      l = static_cast<float>(dl);
      if (st.losses != nullptr) st.losses[n] = static_cast<float>(dl - xt);
    } else if (st.losses != nullptr) {
      st.losses[n] = 0.0f;
    }
    if (st.lse_out != nullptr) st.lse_out[n] = l;
    ce_grad_row<D, kF16Values>(d, x, kept, target, m, ce_scale(m, l, dloss), dloss, V,
                               st.lse != nullptr ? next : nullptr);
  }
}

// The in-place gradient in `storage` (cross_entropy_backward_inplace's contract), rows' lse as
// `st` says.
void ce_grad_inplace(float* logits, CeRowStats st, const int32_t* targets, int N, int V,
                     float dloss, DType storage, int64_t ld) {
  if (ld == 0) ld = V;
  HR_CHECK(ld >= V);
  switch (storage) {
    case DType::kF32:
#pragma omp parallel
      ce_grad_rows(logits, logits, st, targets, 0, N, V, dloss, ld);
      return;
    case DType::kF16:
#pragma omp parallel
      ce_grad_rows<float, true>(logits, logits, st, targets, 0, N, V, dloss, ld);
      return;
    case DType::kBF16:
      // Row n's bf16 gradient lands on the first half of its own fp32 row (floats
      // [n ld, n ld + V/2)), which ce_grad_row reads before it writes, while the row is still in
      // L2: no row touches another's memory, and no line is read for ownership from memory.
#pragma omp parallel
      ce_grad_rows(reinterpret_cast<bf16_t*>(logits), logits, st, targets, 0, N, V, dloss, ld);
      return;
    default:
      break;
  }
  HR_CHECK_MSG(false, "cross_entropy_*_inplace: dlogits storage must be f32, f16 or bf16");
}
}  // namespace

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, int N, int V, float dloss) {
  HR_CHECK(lse != nullptr);
#pragma omp parallel
  ce_grad_rows(dlogits, logits, CeRowStats{.lse = lse}, targets, 0, N, V, dloss, V);
}

void cross_entropy_backward(float* dlogits, const float* logits, const int32_t* targets, int N,
                            int V, float dloss) {
#pragma omp parallel
  ce_grad_rows(dlogits, logits, CeRowStats{.keep = true}, targets, 0, N, V, dloss, V);
}

void cross_entropy_backward_inplace(float* logits, const float* lse, const int32_t* targets, int N,
                                    int V, float dloss, DType storage, int64_t ld) {
  HR_CHECK(lse != nullptr);
  ce_grad_inplace(logits, CeRowStats{.lse = lse}, targets, N, V, dloss, storage, ld);
}

void cross_entropy_forward_backward_inplace(float* losses, float* lse, float* logits,
                                            const int32_t* targets, int N, int V, float dloss,
                                            DType storage, int64_t ld) {
  HR_CHECK(losses != nullptr);
  ce_grad_inplace(logits, CeRowStats{.losses = losses, .lse_out = lse, .keep = true}, targets, N, V,
                  dloss, storage, ld);
}

// ---- optimizer -----------------------------------------------------------------------------

namespace {
// One element of the AdamW update (torch order: decay, then the bias-corrected Adam step).
inline void adamw_one(float& param, float grad, float& m, float& v, float b1, float b2, float eps,
                      float gs, float step_size, float bc2_sqrt, float decay) {
  const float g = grad * gs;
  m = b1 * m + (1.0f - b1) * g;
  v = b2 * v + (1.0f - b2) * g * g;
  const float denom = std::sqrt(v) / bc2_sqrt + eps;
  param = param * decay - step_size * (m / denom);
}

// Buffers from this many floats on are beyond the caches: the optimizer's streams are prefetched
// and the stores nobody reads soon (the bf16 copy) are non-temporal.
constexpr int64_t kOptimizerStreamFloats = int64_t{8} << 20;  // 32 MiB of fp32
// Prefetch distance of AdamW's four input streams, in floats (2 KiB ahead each; 256-512 measured
// alike, docs/notes/memory-bound-kernels.md).
constexpr int64_t kAdamWPrefetch = 512;

// One thread's share of the update. std::sqrt may set errno (never here: v >= 0), which keeps
// GCC from vectorising the loop without -fno-math-errno (and the optimize attribute does not
// help in GCC 12), so the AVX-512 body is written out (maskz_sqrt: plain sqrt_ps trips a false
// -Wmaybe-uninitialized in GCC 12's header). Same operations in the same order as adamw_one;
// the compiler may contract the scalar tail into FMAs, but thread ranges are multiples of 16,
// so the vector/scalar split depends on n only, never on the thread count. kZeroGrads writes
// zeros over each gradient vector once it is read (plain stores: the line is in cache, so no
// read for ownership; non-temporal ones measured slower there). kStream prefetches the inputs
// and stores the bf16 copy non-temporally (copy + i0 must be 32-byte aligned; i advances by 32
// bytes of bf16). Neither changes a value.
template <bool kZeroGrads, bool kStream>
void adamw_range(float* params, const float* grads, float* grads_out, float* m, float* v,
                 bf16_t* copy, int64_t i0, int64_t i1, float b1, float b2, float eps, float gs,
                 float step_size, float bc2_sqrt, float decay) {
  int64_t i = i0;
#if defined(__AVX512F__)
  const __m512 vb1 = _mm512_set1_ps(b1), vb2 = _mm512_set1_ps(b2), veps = _mm512_set1_ps(eps),
               vgs = _mm512_set1_ps(gs), vss = _mm512_set1_ps(step_size),
               vbc = _mm512_set1_ps(bc2_sqrt), vdecay = _mm512_set1_ps(decay),
               v1b1 = _mm512_set1_ps(1.0f - b1), v1b2 = _mm512_set1_ps(1.0f - b2);
  for (; i + 16 <= i1; i += 16) {
    if (kStream && i + kAdamWPrefetch < i1) {  // a hint, inside the thread's range
      _mm_prefetch(reinterpret_cast<const char*>(grads + i + kAdamWPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(m + i + kAdamWPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + i + kAdamWPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(params + i + kAdamWPrefetch), _MM_HINT_T0);
    }
    const __m512 g = _mm512_mul_ps(_mm512_loadu_ps(grads + i), vgs);
    if constexpr (kZeroGrads) _mm512_storeu_ps(grads_out + i, _mm512_setzero_ps());
    const __m512 mi =
        _mm512_add_ps(_mm512_mul_ps(vb1, _mm512_loadu_ps(m + i)), _mm512_mul_ps(v1b1, g));
    const __m512 vi = _mm512_add_ps(_mm512_mul_ps(vb2, _mm512_loadu_ps(v + i)),
                                    _mm512_mul_ps(_mm512_mul_ps(v1b2, g), g));
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_maskz_sqrt_ps(0xFFFF, vi), vbc), veps);
    const __m512 upd = _mm512_mul_ps(vss, _mm512_div_ps(mi, denom));
    const __m512 np = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(params + i), vdecay), upd);
    _mm512_storeu_ps(params + i, np);
    if (copy != nullptr) {
      if constexpr (kStream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(copy + i), cvt_ps_bf16(np));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(copy + i), cvt_ps_bf16(np));
      }
    }
  }
  if constexpr (kStream) _mm_sfence();
#endif
  for (; i < i1; ++i) {
    adamw_one(params[i], grads[i], m[i], v[i], b1, b2, eps, gs, step_size, bc2_sqrt, decay);
    if constexpr (kZeroGrads) grads_out[i] = 0.0f;
    if (copy != nullptr) copy[i] = from_f32<bf16_t>(params[i]);
  }
}

// adamw_update and adamw_update_and_zero: grads_out is null, or grads itself (zeroed).
void adamw_update_impl(float* params, const float* grads, float* grads_out, float* m, float* v,
                       int64_t n, const AdamWParams& p, bf16_t* params_bf16) {
  HR_CHECK(p.step >= 1);
  // Same order and scalar precision as torch.optim.AdamW (single-tensor path): decay first,
  // then addcdiv with step_size = lr / bc1 and denom = sqrt(v) / sqrt(bc2) + eps, the scalars
  // computed in double as Python does.
  const double bc1 = 1.0 - std::pow(static_cast<double>(p.beta1), p.step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(p.beta2), p.step);
  const float step_size = static_cast<float>(p.lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float decay = static_cast<float>(1.0 - static_cast<double>(p.lr) * p.weight_decay);
  const bool stream = n >= kOptimizerStreamFloats;
#pragma omp parallel
  {
    int64_t i0, i1;
    thread_range(n, 16, &i0, &i1);
    // The copy's stores stream only from a 32-byte boundary (an arena's buffers start on one).
    const bool nt = stream && (params_bf16 == nullptr ||
                               (reinterpret_cast<uintptr_t>(params_bf16 + i0) & 31) == 0);
    const auto run = [&](auto zero_grads, auto streamed) {
      adamw_range<decltype(zero_grads)::value, decltype(streamed)::value>(
          params, grads, grads_out, m, v, params_bf16, i0, i1, p.beta1, p.beta2, p.eps,
          p.grad_scale, step_size, bc2_sqrt, decay);
    };
    if (grads_out != nullptr) {
      nt ? run(std::true_type{}, std::true_type{}) : run(std::true_type{}, std::false_type{});
    } else {
      nt ? run(std::false_type{}, std::true_type{}) : run(std::false_type{}, std::false_type{});
    }
  }
}
}  // namespace

void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n,
                  const AdamWParams& p, bf16_t* params_bf16) {
  adamw_update_impl(params, grads, nullptr, m, v, n, p, params_bf16);
}

void adamw_update_and_zero(float* params, float* grads, float* m, float* v, int64_t n,
                           const AdamWParams& p, bf16_t* params_bf16) {
  adamw_update_impl(params, grads, grads, m, v, n, p, params_bf16);
}

// ---- reductions and simple ops ------------------------------------------------------------

namespace {
// Prefetch distance of sum_squares, in floats.
constexpr int64_t kSumSquaresPrefetch = 2048;
}  // namespace

double sum_squares(const float* x, int64_t n) {
  constexpr int kMaxThreads = 1024;
  double partial[kMaxThreads];
  int nthreads = 1;
#pragma omp parallel
  {
#pragma omp single
    nthreads = omp_get_num_threads();
    HR_CHECK(omp_get_num_threads() <= kMaxThreads);
    int64_t i0, i1;
    thread_range(n, 16, &i0, &i1);
    double s = 0.0;
#if HR_AVX512_KERNELS
    // Four independent accumulators of 8 doubles (the single-vector reduction GCC makes of the
    // loop below is bound by the add's latency: 2.8 G floats/s a thread, about a third of what
    // memory delivers here). The lane order is fixed by the thread's range, as before.
    __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(),
                      _mm512_setzero_pd()};
    int64_t i = i0;
    // maskz conversions: the plain ones trip a false -Wmaybe-uninitialized in GCC 12's header.
    for (; i + 32 <= i1; i += 32) {
      // Two lines 8 KiB ahead, inside the thread's range: from memory, 1.4x the hardware
      // prefetcher's bandwidth alone (docs/notes/memory-bound-kernels.md); the same sums.
      if (i + kSumSquaresPrefetch + 32 <= i1) {
        _mm_prefetch(reinterpret_cast<const char*>(x + i + kSumSquaresPrefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(x + i + kSumSquaresPrefetch + 16), _MM_HINT_T0);
      }
      for (int k = 0; k < 4; ++k) {
        const __m512d d = _mm512_maskz_cvtps_pd(0xFF, _mm256_loadu_ps(x + i + 8 * k));
        acc[k] = _mm512_fmadd_pd(d, d, acc[k]);
      }
    }
    for (; i < i1; i += 8) {
      const __mmask8 m = __mmask8((i1 - i) >= 8 ? 0xFF : (1u << (i1 - i)) - 1u);
      const __m512d d = _mm512_maskz_cvtps_pd(m, _mm256_maskz_loadu_ps(m, x + i));
      acc[0] = _mm512_fmadd_pd(d, d, acc[0]);
    }
    alignas(64) double lanes[8];
    _mm512_store_pd(lanes,
                    _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3])));
    for (double l : lanes) s += l;
#else
#pragma omp simd reduction(+ : s)
    for (int64_t i = i0; i < i1; ++i) s += static_cast<double>(x[i]) * x[i];
#endif
    partial[omp_get_thread_num()] = s;
  }
  double total = 0.0;  // fixed (thread) order
  for (int t = 0; t < nthreads; ++t) total += partial[t];
  return total;
}

void scale_inplace(float* x, int64_t n, float s) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

void apply_mask(const uint8_t* mask, float* x, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    // A multiply would keep -0.0 and turn NaN * 0 into NaN; pruned weights are +0.0 exactly.
    if (!mask[i]) x[i] = 0.0f;
  }
}

void zero(float* x, int64_t n) {
#if HR_AVX512_KERNELS
  // Buffers far beyond the caches (the gradients, every step) are zeroed with non-temporal
  // stores: no read for ownership of lines that are about to be evicted anyway. Smaller ones stay
  // in cache for the kernel that accumulates into them next.
  constexpr int64_t kStreamFloats = int64_t{64} << 20 >> 2;  // 64 MiB
  if (n >= kStreamFloats) {
#pragma omp parallel
    {
      int64_t i0, i1;
      thread_range(n, 16, &i0, &i1);
      int64_t i = i0;
      for (; i < i1 && (reinterpret_cast<uintptr_t>(x + i) & 63) != 0; ++i) x[i] = 0.0f;
      const __m512 z = _mm512_setzero_ps();
      for (; i + 16 <= i1; i += 16) _mm512_stream_ps(x + i, z);
      for (; i < i1; ++i) x[i] = 0.0f;
      _mm_sfence();
    }
    return;
  }
#endif
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] = 0.0f;
}

}  // namespace headroom::cpu
