// The Llama family's RMSNorm, SwiGLU and rotary embeddings (see llama_kernels.h). With AVX-512,
// every element goes through the vector path (a row's last partial vector masked, never a scalar
// tail), so an element's result does not depend on where a thread's range starts; otherwise plain
// loops that GCC vectorises.
#include "backend/cpu/llama_kernels.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "backend/cpu/bf16.h"
#include "backend/cpu/fast_math.h"
#include "core/check.h"

namespace headroom::cpu {
namespace {

// This thread's share [begin, end) of [0, n) in units of `align`. Call inside a parallel region.
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

// ---- RMSNorm -------------------------------------------------------------------------------

// The parameter gradient's sums over rows are taken in kRmsBlocks blocks of rows fixed by N
// (rms_block_begin): each block's sum in row order, then the blocks' sums in block order, so
// the result does not depend on the thread count, and the fused form (in the row pass) and the
// separate one (a pass over columns) take the same operations in the same order. Twelve blocks,
// as layernorm_backward's (whole rounds for 1, 2, 3, 4, 6 and 12 threads).
constexpr int64_t kRmsBlocks = 12;
inline int64_t rms_blocks(int64_t N) { return std::min(N, kRmsBlocks); }
inline int64_t rms_block_begin(int64_t b, int64_t N) { return b * N / rms_blocks(N); }
// The fused form keeps each block's partial sums (C floats) on the caller's stack (12 x 8 KiB
// at most, as layernorm's); wider rows take the separate pass over columns.
constexpr int kRmsFusedMaxC = 2048;
// Columns of the separate pass held on the stack at a time.
constexpr int kColBlock = 256;

#if HR_AVX512_KERNELS
// The sum of v's lanes by a tree that depends on v only.
inline float hsum16(__m512 v) {
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(0xFFFF, v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(0xFFFF, v, v, 0xB1));
  v = _mm512_add_ps(v, _mm512_maskz_permute_ps(0xFFFF, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_maskz_permute_ps(0xFFFF, v, 0xB1));
  return _mm512_cvtss_f32(v);
}

// sum_c a[c] * b[c] in four accumulators (one would wait on the FMA latency), the tail masked;
// the lanes and their order depend on C only.
template <typename TA>
inline float dot_row16(const TA* a, const float* b, int C) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int c = 0;
  for (; c + 64 <= C; c += 64) {
    s0 = _mm512_fmadd_ps(load16(a + c, 0xFFFF), _mm512_loadu_ps(b + c), s0);
    s1 = _mm512_fmadd_ps(load16(a + c + 16, 0xFFFF), _mm512_loadu_ps(b + c + 16), s1);
    s2 = _mm512_fmadd_ps(load16(a + c + 32, 0xFFFF), _mm512_loadu_ps(b + c + 32), s2);
    s3 = _mm512_fmadd_ps(load16(a + c + 48, 0xFFFF), _mm512_loadu_ps(b + c + 48), s3);
  }
  for (; c < C; c += 16) {
    const __mmask16 k = first_lanes(C - c);
    s0 = _mm512_fmadd_ps(load16(a + c, k), _mm512_maskz_loadu_ps(k, b + c), s0);
  }
  return hsum16(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

// The forward reads a row from memory once (the sum of squares) and again from L1 (the output);
// the row two ahead is asked for during the second pass, as layernorm_forward does.
constexpr int64_t kRmsPrefetchRows = 2;
#endif

template <typename TOut>
void rmsnorm_forward_t(TOut* out, float* rstd, const float* inp, const float* weight, int N, int C,
                       float eps) {
  HR_CHECK(C > 0);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    TOut* o = out + n * C;
#if HR_AVX512_KERNELS
    const float r = 1.0f / std::sqrt(dot_row16(x, x, C) / float(C) + eps);
    const __m512 vr = _mm512_set1_ps(r);
    const float* ahead = inp + std::min<int64_t>(n + kRmsPrefetchRows, N - 1) * C;
    for_each16(0, C, [&](int64_t c, __mmask16 k) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + c), _MM_HINT_T0);
      const __m512 norm = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + c), vr);
      store16(o + c, k, _mm512_mul_ps(norm, _mm512_maskz_loadu_ps(k, weight + c)));
    });
#else
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int c = 0; c < C; ++c) s += x[c] * x[c];
    const float r = 1.0f / std::sqrt(s / float(C) + eps);
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] = from_f32<TOut>((x[c] * r) * weight[c]);
#endif
    rstd[n] = r;
  }
}

#if HR_AVX512_KERNELS
// One row of the input gradient: dx += r (g - norm mean(g norm)), g = dy w, norm = x r; two
// passes over the row (the second from L1). With lo, also lo = TL(dx); with part, also
// part[c] += dy norm (this row's share of dweight, in the same pass).
template <typename TD, typename TL>
inline void rmsnorm_backward_row16(float* dx, TL* lo, float* part, const TD* dy, const float* x,
                                   const float* w, float r, int C) {
  const __m512 vr = _mm512_set1_ps(r);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0;
  int c = 0;
  for (; c + 32 <= C; c += 32) {
    const __m512 g0 = _mm512_mul_ps(load16(dy + c, 0xFFFF), _mm512_loadu_ps(w + c));
    const __m512 g1 = _mm512_mul_ps(load16(dy + c + 16, 0xFFFF), _mm512_loadu_ps(w + c + 16));
    s0 = _mm512_fmadd_ps(g0, _mm512_loadu_ps(x + c), s0);
    s1 = _mm512_fmadd_ps(g1, _mm512_loadu_ps(x + c + 16), s1);
  }
  for (; c < C; c += 16) {
    const __mmask16 k = first_lanes(C - c);
    const __m512 g = _mm512_mul_ps(load16(dy + c, k), _mm512_maskz_loadu_ps(k, w + c));
    s0 = _mm512_fmadd_ps(g, _mm512_maskz_loadu_ps(k, x + c), s0);
  }
  // mean(g norm) = r sum(g x) / C
  const __m512 mean_gn = _mm512_set1_ps(hsum16(_mm512_add_ps(s0, s1)) * r / float(C));
  for_each16(0, C, [&](int64_t c, __mmask16 k) {
    const __m512 d = load16(dy + c, k);
    const __m512 nr = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + c), vr);
    const __m512 t =
        _mm512_fnmadd_ps(nr, mean_gn, _mm512_mul_ps(d, _mm512_maskz_loadu_ps(k, w + c)));
    const __m512 v = _mm512_fmadd_ps(t, vr, _mm512_maskz_loadu_ps(k, dx + c));
    _mm512_mask_storeu_ps(dx + c, k, v);
    if (lo != nullptr) store16(lo + c, k, v);
    if (part != nullptr) {
      _mm512_mask_storeu_ps(part + c, k,
                            _mm512_fmadd_ps(d, nr, _mm512_maskz_loadu_ps(k, part + c)));
    }
  });
}

inline void add_floats(float* acc, const float* add, int64_t n) {
  for_each16(0, n, [&](int64_t j, __mmask16 k) {
    _mm512_mask_storeu_ps(
        acc + j, k,
        _mm512_add_ps(_mm512_maskz_loadu_ps(k, acc + j), _mm512_maskz_loadu_ps(k, add + j)));
  });
}

// dweight alone, parallel over columns: the fused form's operations (per block of rows, its sum
// in row order; the blocks' sums in block order).
template <typename TD>
void rmsnorm_dweight_by_columns16(float* dweight, const TD* dout, const float* inp,
                                  const float* rstd, int N, int C) {
#pragma omp parallel
  {
    int64_t c0, c1;
    thread_range(C, 16, &c0, &c1);
    for (int64_t cb = c0; cb < c1; cb += kColBlock) {
      const int64_t w = std::min<int64_t>(kColBlock, c1 - cb);
      alignas(64) float acc[kColBlock] = {};
      alignas(64) float part[kColBlock];
      for (int64_t b = 0; b < rms_blocks(N); ++b) {
        std::fill(part, part + kColBlock, 0.0f);
        for (int64_t n = rms_block_begin(b, N); n < rms_block_begin(b + 1, N); ++n) {
          const float* x = inp + n * C + cb;
          const TD* dy = dout + n * C + cb;
          const __m512 vr = _mm512_set1_ps(rstd[n]);
          for_each16(0, w, [&](int64_t j, __mmask16 k) {
            const __m512 nr = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + j), vr);
            _mm512_store_ps(part + j,
                            _mm512_fmadd_ps(load16(dy + j, k), nr, _mm512_load_ps(part + j)));
          });
        }
        add_floats(acc, part, w);
      }
      add_floats(dweight + cb, acc, w);
    }
  }
}

template <typename TD, typename TL = float>
void rmsnorm_backward_t(float* dinp, float* dweight, const TD* dout, const float* inp,
                        const float* weight, const float* rstd, int N, int C,
                        TL* dinp_low = nullptr) {
  const bool fused = dinp != nullptr && dweight != nullptr && C <= kRmsFusedMaxC;
  if (dinp != nullptr && !fused) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      rmsnorm_backward_row16(dinp + n * C, dinp_low != nullptr ? dinp_low + n * C : nullptr,
                             static_cast<float*>(nullptr), dout + n * C, inp + n * C, weight,
                             rstd[n], C);
    }
  }
  if (dweight == nullptr) return;
  if (!fused) {
    rmsnorm_dweight_by_columns16(dweight, dout, inp, rstd, N, C);
    return;
  }
  // One pass: each block of rows writes its input gradient and sums its share of dweight into
  // its own row of `parts`; the blocks' sums are added in block order after the loop.
  const int64_t blocks = rms_blocks(N);
  alignas(64) float parts[kRmsBlocks][kRmsFusedMaxC];
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    float* part = parts[b];
    std::fill(part, part + C, 0.0f);
    for (int64_t n = rms_block_begin(b, N); n < rms_block_begin(b + 1, N); ++n) {
      rmsnorm_backward_row16(dinp + n * C, dinp_low != nullptr ? dinp_low + n * C : nullptr, part,
                             dout + n * C, inp + n * C, weight, rstd[n], C);
    }
  }
  alignas(64) float acc[kRmsFusedMaxC];
  std::fill(acc, acc + C, 0.0f);
  for (int64_t b = 0; b < blocks; ++b) add_floats(acc, parts[b], C);
  add_floats(dweight, acc, C);
}
#else
template <typename TD, typename TL = float>
void rmsnorm_backward_t(float* dinp, float* dweight, const TD* dout, const float* inp,
                        const float* weight, const float* rstd, int N, int C,
                        TL* dinp_low = nullptr) {
  if (dinp != nullptr) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = inp + n * C;
      const TD* dy = dout + n * C;
      const float r = rstd[n];
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int c = 0; c < C; ++c) s += to_f32(dy[c]) * weight[c] * x[c];
      const float mean_gn = s * r / float(C);
      float* dx = dinp + n * C;
#pragma omp simd
      for (int c = 0; c < C; ++c) {
        const float v = dx[c] + (to_f32(dy[c]) * weight[c] - x[c] * r * mean_gn) * r;
        dx[c] = v;
        if (dinp_low != nullptr) dinp_low[n * C + c] = from_f32<TL>(v);
      }
    }
  }
  if (dweight == nullptr) return;
    // Parallel over columns, rows summed in order (deterministic, thread-count independent).
#pragma omp parallel
  {
    int64_t c0, c1;
    thread_range(C, 16, &c0, &c1);
    for (int64_t cb = c0; cb < c1; cb += kColBlock) {
      const int64_t w = std::min<int64_t>(kColBlock, c1 - cb);
      float acc[kColBlock] = {};
      for (int64_t n = 0; n < N; ++n) {
        const float* x = inp + n * C + cb;
        const TD* dy = dout + n * C + cb;
        const float r = rstd[n];
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) acc[j] += to_f32(dy[j]) * (x[j] * r);
      }
      for (int64_t j = 0; j < w; ++j) dweight[cb + j] += acc[j];
    }
  }
}
#endif

// ---- SwiGLU --------------------------------------------------------------------------------

// Rows are cut into chunks of kSwiGluChunk columns (a multiple of 16, so every chunk's vectors
// start where a whole row's would), and the (row, chunk) pairs shared out statically: enough
// tasks when N is small, and an element's result does not depend on the split.
constexpr int64_t kSwiGluChunk = 2048;

template <typename F>
void for_each_row_chunk(int64_t N, int64_t I, F f) {
  const int64_t chunks = (I + kSwiGluChunk - 1) / kSwiGluChunk;
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < N * chunks; ++task) {
    const int64_t n = task / chunks, c0 = task % chunks * kSwiGluChunk;
    f(n, c0, std::min(I, c0 + kSwiGluChunk));
  }
}

template <typename T>
void swiglu_forward_t(T* out, const T* gu, int64_t N, int64_t I, int64_t ld_out, int64_t ld_gu) {
  HR_CHECK(ld_gu >= 2 * I && ld_out >= I);
  for_each_row_chunk(N, I, [&](int64_t n, int64_t c0, int64_t c1) {
    const T* g = gu + n * ld_gu;
    const T* u = g + I;
    T* o = out + n * ld_out;
#if HR_AVX512_KERNELS
    const __m512 one = _mm512_set1_ps(1.0f);
    for_each16(c0, c1, [&](int64_t i, __mmask16 k) {
      const __m512 x = load16(g + i, k);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));  // exp(-x)
      const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, e));
      store16(o + i, k, _mm512_mul_ps(silu, load16(u + i, k)));
    });
#else
#pragma omp simd
    for (int64_t i = c0; i < c1; ++i) {
      const float x = to_f32(g[i]);
      o[i] = from_f32<T>(x / (1.0f + fast_exp(-x)) * to_f32(u[i]));
    }
#endif
  });
}

template <typename T>
void swiglu_backward_t(T* dgu, const T* gu, const T* dout, int64_t N, int64_t I, int64_t ld_gu,
                       int64_t ld_dout) {
  HR_CHECK(ld_gu >= 2 * I && ld_dout >= I);
  for_each_row_chunk(N, I, [&](int64_t n, int64_t c0, int64_t c1) {
    const T* g = gu + n * ld_gu;
    const T* u = g + I;
    const T* d = dout + n * ld_dout;
    T* dg = dgu + n * ld_gu;
    T* du = dg + I;
#if HR_AVX512_KERNELS
    const __m512 one = _mm512_set1_ps(1.0f);
    for_each16(c0, c1, [&](int64_t i, __mmask16 k) {
      // Both of this position's inputs are read before either output is stored (in place).
      const __m512 x = load16(g + i, k), up = load16(u + i, k), dy = load16(d + i, k);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));  // exp(-x)
      const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, e));     // sigmoid(x)
      // silu'(x) = s (1 + x (1 - s)), with 1 - s = e s (no cancellation where s is near 1).
      const __m512 grad = _mm512_mul_ps(s, _mm512_fmadd_ps(x, _mm512_mul_ps(e, s), one));
      store16(dg + i, k, _mm512_mul_ps(_mm512_mul_ps(dy, up), grad));
      store16(du + i, k, _mm512_mul_ps(dy, _mm512_mul_ps(x, s)));
    });
#else
#pragma omp simd
    for (int64_t i = c0; i < c1; ++i) {
      const float x = to_f32(g[i]), up = to_f32(u[i]), dy = to_f32(d[i]);
      const float e = fast_exp(-x), s = 1.0f / (1.0f + e);
      dg[i] = from_f32<T>((dy * up) * (s * (1.0f + x * (e * s))));
      du[i] = from_f32<T>(dy * (x * s));
    }
#endif
  });
}

// ---- RoPE ----------------------------------------------------------------------------------

// The rotation of the q and k heads of every row of qkv; kInverse: the transpose (backward).
// Rows (b, t) are independent tasks; each row's cos / sin vectors are loaded once for all its
// heads.
template <bool kInverse, typename T>
void rope_t(T* qkv, const float* cos, const float* sin, int B, int T_, int NH, int NKV, int HS) {
  HR_CHECK(HS > 0 && HS % 2 == 0 && NH > 0 && NKV > 0);
  const int H = HS / 2, heads = NH + NKV;
  const int64_t W = int64_t{NH + 2 * NKV} * HS, rows = int64_t{B} * T_;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % T_;
    const float* cr = cos + t * H;
    const float* sr = sin + t * H;
    T* row = qkv + r * W;
#if HR_AVX512_KERNELS
    // Private copies of the shapes: the parallel region's shared ones are read through pointers
    // that the stores through `row` might alias (GCC reloaded them for every head).
    const int64_t hs = HS, half = H;
    const int nheads = heads;
    for_each16(0, half, [&](int64_t i, __mmask16 k) {
      const __m512 c = _mm512_maskz_loadu_ps(k, cr + i), s = _mm512_maskz_loadu_ps(k, sr + i);
      for (int h = 0; h < nheads; ++h) {
        T* x = row + h * hs + i;
        const __m512 x1 = load16(x, k), x2 = load16(x + half, k);
        if constexpr (kInverse) {
          store16(x, k, _mm512_fmadd_ps(x1, c, _mm512_mul_ps(x2, s)));
          store16(x + half, k, _mm512_fmsub_ps(x2, c, _mm512_mul_ps(x1, s)));
        } else {
          store16(x, k, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)));
          store16(x + half, k, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)));
        }
      }
    });
#else
    for (int h = 0; h < heads; ++h) {
      T* x = row + int64_t{h} * HS;
#pragma omp simd
      for (int i = 0; i < H; ++i) {
        const float x1 = to_f32(x[i]), x2 = to_f32(x[i + H]), c = cr[i], s = sr[i];
        x[i] = from_f32<T>(kInverse ? x1 * c + x2 * s : x1 * c - x2 * s);
        x[i + H] = from_f32<T>(kInverse ? x2 * c - x1 * s : x2 * c + x1 * s);
      }
    }
#endif
  }
}

}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps) {
  rmsnorm_forward_t(out, rstd, inp, weight, N, C, eps);
}
void rmsnorm_forward(bf16_t* out, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps) {
  rmsnorm_forward_t(out, rstd, inp, weight, N, C, eps);
}
void rmsnorm_forward(f16_t* out, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps) {
  rmsnorm_forward_t(out, rstd, inp, weight, N, C, eps);
}
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C) {
  rmsnorm_backward_t(dinp, dweight, dout, inp, weight, rstd, N, C);
}
void rmsnorm_backward(float* dinp, float* dweight, const bf16_t* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C) {
  rmsnorm_backward_t(dinp, dweight, dout, inp, weight, rstd, N, C);
}
void rmsnorm_backward(float* dinp, float* dweight, const f16_t* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C) {
  rmsnorm_backward_t(dinp, dweight, dout, inp, weight, rstd, N, C);
}
void rmsnorm_backward(float* dinp, bf16_t* dinp_low, float* dweight, const bf16_t* dout,
                      const float* inp, const float* weight, const float* rstd, int N, int C) {
  HR_CHECK(dinp != nullptr && dinp_low != nullptr);
  rmsnorm_backward_t(dinp, dweight, dout, inp, weight, rstd, N, C, dinp_low);
}
void rmsnorm_backward(float* dinp, f16_t* dinp_low, float* dweight, const f16_t* dout,
                      const float* inp, const float* weight, const float* rstd, int N, int C) {
  HR_CHECK(dinp != nullptr && dinp_low != nullptr);
  rmsnorm_backward_t(dinp, dweight, dout, inp, weight, rstd, N, C, dinp_low);
}

void swiglu_forward(float* out, const float* gu, int64_t N, int64_t I, int64_t ld_out,
                    int64_t ld_gu) {
  swiglu_forward_t(out, gu, N, I, ld_out, ld_gu);
}
void swiglu_forward(bf16_t* out, const bf16_t* gu, int64_t N, int64_t I, int64_t ld_out,
                    int64_t ld_gu) {
  swiglu_forward_t(out, gu, N, I, ld_out, ld_gu);
}
void swiglu_forward(f16_t* out, const f16_t* gu, int64_t N, int64_t I, int64_t ld_out,
                    int64_t ld_gu) {
  swiglu_forward_t(out, gu, N, I, ld_out, ld_gu);
}
void swiglu_backward(float* dgu, const float* gu, const float* dout, int64_t N, int64_t I,
                     int64_t ld_gu, int64_t ld_dout) {
  swiglu_backward_t(dgu, gu, dout, N, I, ld_gu, ld_dout);
}
void swiglu_backward(bf16_t* dgu, const bf16_t* gu, const bf16_t* dout, int64_t N, int64_t I,
                     int64_t ld_gu, int64_t ld_dout) {
  swiglu_backward_t(dgu, gu, dout, N, I, ld_gu, ld_dout);
}
void swiglu_backward(f16_t* dgu, const f16_t* gu, const f16_t* dout, int64_t N, int64_t I,
                     int64_t ld_gu, int64_t ld_dout) {
  swiglu_backward_t(dgu, gu, dout, N, I, ld_gu, ld_dout);
}

void rope_inv_freq(float* inv_freq, int HS, float theta, const RopeScaling& scaling) {
  HR_CHECK(HS > 0 && HS % 2 == 0 && theta > 0.0f);
  const bool llama3 = scaling.kind == RopeScaling::Kind::kLlama3;
  if (llama3) {
    HR_CHECK(scaling.factor > 0.0f && scaling.high_freq_factor > scaling.low_freq_factor);
  }
  const double original = scaling.original_max_position_embeddings;
  const double low = scaling.low_freq_factor, high = scaling.high_freq_factor;
  const double factor = scaling.factor;
  const double low_freq_wavelen = original / low, high_freq_wavelen = original / high;
  for (int i = 0; i < HS / 2; ++i) {
    // The exponent as transformers forms it: arange(0, HS, 2).float() / HS, in fp32.
    const float expo = float(2 * i) / float(HS);
    double f = 1.0 / std::pow(double(theta), double(expo));
    if (llama3) {
      const double wavelen = 2.0 * std::numbers::pi / f;
      if (wavelen < high_freq_wavelen) {
        // high frequencies: kept
      } else if (wavelen > low_freq_wavelen) {
        f /= factor;
      } else {
        const double smooth = (original / wavelen - low) / (high - low);
        f = (1.0 - smooth) * f / factor + smooth * f;
      }
    }
    inv_freq[i] = float(f);
  }
}

void rope_table(float* cos, float* sin, const float* inv_freq, int HS, int pos0, int T) {
  HR_CHECK(HS > 0 && HS % 2 == 0);
  const int H = HS / 2;
#pragma omp parallel for schedule(static)
  for (int t = 0; t < T; ++t) {
    const double pos = double(pos0) + t;
    for (int i = 0; i < H; ++i) {
      const double a = pos * double(inv_freq[i]);
      cos[int64_t{t} * H + i] = float(std::cos(a));
      sin[int64_t{t} * H + i] = float(std::sin(a));
    }
  }
}

void rope_forward(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int NKV,
                  int HS) {
  rope_t<false>(qkv, cos, sin, B, T, NH, NKV, HS);
}
void rope_forward(bf16_t* qkv, const float* cos, const float* sin, int B, int T, int NH, int NKV,
                  int HS) {
  rope_t<false>(qkv, cos, sin, B, T, NH, NKV, HS);
}
void rope_forward(f16_t* qkv, const float* cos, const float* sin, int B, int T, int NH, int NKV,
                  int HS) {
  rope_t<false>(qkv, cos, sin, B, T, NH, NKV, HS);
}
void rope_backward(float* dqkv, const float* cos, const float* sin, int B, int T, int NH, int NKV,
                   int HS) {
  rope_t<true>(dqkv, cos, sin, B, T, NH, NKV, HS);
}
void rope_backward(bf16_t* dqkv, const float* cos, const float* sin, int B, int T, int NH, int NKV,
                   int HS) {
  rope_t<true>(dqkv, cos, sin, B, T, NH, NKV, HS);
}
void rope_backward(f16_t* dqkv, const float* cos, const float* sin, int B, int T, int NH, int NKV,
                   int HS) {
  rope_t<true>(dqkv, cos, sin, B, T, NH, NKV, HS);
}

}  // namespace headroom::cpu
