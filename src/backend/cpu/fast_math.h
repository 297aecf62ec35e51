// Branch-free expf/tanhf that GCC vectorises inside `#pragma omp simd` loops, and their AVX-512
// forms (exp16, gelu16, ...) for kernels whose vector loop is written out. glibc's vector math
// (libmvec) is only used under -ffast-math, which the build does not set, and scalar expf calls
// would dominate softmax over a 50257-entry vocabulary and GELU.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace headroom::cpu {

// Plain inline functions: GCC inlines and vectorises them (checked with objdump, GCC 12).
// exp(x) for x in float range; relative error below 2e-7 for x in [-87, 88]. Inputs are clamped
// to that range, so exp of very negative x returns ~1e-38 instead of 0 (harmless where it is
// used: softmax sums of at least 1, and tanh).
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;  // ternaries, not std::fmin/fmax: those block vectorisation
  x = x > 88.0f ? 88.0f : x;
  // n = round(x / ln2) by the 1.5 * 2^23 trick: std::floor/nearbyint do not vectorise without
  // -fno-trapping-math, and this rounding is exact for |n| < 2^22.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  // x - n*ln2 in two parts (Cody-Waite) keeps r accurate.
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  // exp(r) on |r| <= ln2/2: Cephes expf polynomial.
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(e);
}

// tanh(x) = 1 - 2 / (exp(2x) + 1); absolute error ~1e-7 (relative error grows for |x| < 1e-3,
// where tanh(x) ~ x is tiny anyway; in GELU it is multiplied by x).
inline float fast_tanh(float x) { return 1.0f - 2.0f / (fast_exp(2.0f * x) + 1.0f); }

// Kernels with their vector loops written out (AVX-512 F/BW/VL): 1 or 0, always defined, so that
// it can be used in expressions as well as in #if (-DHR_AVX512_KERNELS=0 forces the portable path).
#ifndef HR_AVX512_KERNELS
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HR_AVX512_KERNELS 1
#else
#define HR_AVX512_KERNELS 0
#endif
#endif

#if defined(__x86_64__) && defined(__GNUC__)  // GCC and clang
// The AVX-512 forms below carry their instruction sets in a target attribute, so that one
// definition serves two kinds of caller: the kernels compiled for this CPU (HR_AVX512_KERNELS,
// -march=native), and functions that have an AVX-512 target attribute of their own in any x86-64
// build (the bf16 / AMX attention kernels in attention_tiled.cc, chosen at run time). GCC and
// clang inline a function with a target attribute into a caller whose instruction sets include
// its own, as they inline a plain one (checked with objdump: no call to exp16 in
// attention_tiled.cc.o, kernels.cc.o or fused_head.cc.o).
#define HR_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#define HR_AVX512_HELPERS 1
#endif

#if HR_AVX512_HELPERS
// The mask of the first min(16, n) lanes (n >= 0).
HR_AVX512_TARGET inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
}

// f(i, k) for the vectors of 16 lanes that cover [i0, i1): the whole ones with the constant mask
// 0xFFFF, then the partial last one (if any) with its mask. Once f is inlined, the whole vectors'
// masked loads and stores are plain ones (a constant full mask compiles to an unmasked move), and
// the same operations give the same bits as masking every vector. Why not a mask per vector:
// AMD's Zen 5 runs a load under a run-time mask at about half the rate of a plain one (64M floats
// copied with masked loads: 14.0 ms, plain: 8.9 ms; docs/notes/memory-bound-kernels.md, "Zen 5:
// masked loads"); Intel's cores run both alike.
template <typename F>
HR_AVX512_TARGET inline void for_each16(int64_t i0, int64_t i1, F&& f) {
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) f(i, __mmask16(0xFFFF));
  if (i < i1) f(i, first_lanes(i1 - i));
}

// ---- AVX-512 forms, for kernels that write their vector loop out --------------------------
// Every element of such a kernel goes through these (a range's last partial vector is masked,
// never a scalar tail), so an element's result does not depend on where a thread's range starts.

// (The maskz forms with a full mask avoid GCC 12's false -Wmaybe-uninitialized in the plain ones,
// as in bf16.h.) exp of 16 floats: fast_exp's argument clamp, reduction and polynomial, with FMAs
// and vscalefps for the 2^n (relative error below 2e-7 for x in [-87, 88]; NaN stays NaN:
// vmaxps/vminps return their second operand, x, when it is a NaN).
HR_AVX512_TARGET inline __m512 exp16(__m512 x) {
  x = _mm512_maskz_min_ps(0xFFFF, _mm512_set1_ps(88.0f),
                          _mm512_maskz_max_ps(0xFFFF, _mm512_set1_ps(-87.0f), x));
  const __m512 n =
      _mm512_maskz_roundscale_ps(0xFFFF, _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(0xFFFF, p, n);
}

// 1 / d for d >= 1 (vrcp14ps and one Newton step: within about 1 ulp; 0 where d overflows the
// reciprocal's range, i.e. above ~1e38, where 1/d is below float's normal range anyway).
HR_AVX512_TARGET inline __m512 recip16(__m512 d) {
  const __m512 r = _mm512_maskz_rcp14_ps(0xFFFF, d);
  return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.0f)), r);
}

// GELU, tanh form, as x - x / (exp(2u) + 1) with u = sqrt(2/pi) (x + 0.044715 x^3): that is
// 0.5 x (1 + tanh(u)) with tanh(u) = 1 - 2 / (exp(2u) + 1).
HR_AVX512_TARGET inline __m512 gelu16(__m512 x) {
  const __m512 x2 = _mm512_mul_ps(x, x);
  const __m512 u2 =
      _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(2.0f * 0.7978845608028654f)),
                    _mm512_fmadd_ps(x2, _mm512_set1_ps(0.044715f), _mm512_set1_ps(1.0f)));  // 2u
  const __m512 s = recip16(_mm512_add_ps(exp16(u2), _mm512_set1_ps(1.0f)));
  return _mm512_fnmadd_ps(x, s, x);
}

// d gelu / dx: with s = 1 / (exp(2u) + 1), 0.5 (1 + tanh u) = 1 - s and 1 - tanh^2 u =
// 4 s (1 - s), so gelu' = (1 - s) (1 + 2 x s u') with u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
HR_AVX512_TARGET inline __m512 gelu_grad16(__m512 x) {
  const __m512 x2 = _mm512_mul_ps(x, x);
  const __m512 u2 =
      _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(2.0f * 0.7978845608028654f)),
                    _mm512_fmadd_ps(x2, _mm512_set1_ps(0.044715f), _mm512_set1_ps(1.0f)));
  const __m512 s = recip16(_mm512_add_ps(exp16(u2), _mm512_set1_ps(1.0f)));
  const __m512 du2 =  // 2 u'
      _mm512_fmadd_ps(x2, _mm512_set1_ps(2.0f * 0.7978845608028654f * 3.0f * 0.044715f),
                      _mm512_set1_ps(2.0f * 0.7978845608028654f));
  const __m512 one_minus_s = _mm512_sub_ps(_mm512_set1_ps(1.0f), s);
  return _mm512_mul_ps(one_minus_s,
                       _mm512_fmadd_ps(_mm512_mul_ps(x, s), du2, _mm512_set1_ps(1.0f)));
}

// An in-register transpose of a 16 x 16 block of 32-bit elements: r[i] holds row i on entry and
// column i on return (unpacks of 32-bit pairs, then 64-bit pairs within 128-bit lanes, then two
// rounds of lane shuffles). The maskz forms with a full mask are the plain instructions; they
// avoid GCC 12's false -Wmaybe-uninitialized in the unmasked intrinsics (as in bf16.h). Used by the
// attention's packing and the AMX GEMM's.
HR_AVX512_TARGET inline void transpose16x16(__m512 r[16]) {
  constexpr __mmask16 kAll = 0xFFFF;
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_maskz_unpacklo_ps(kAll, r[i], r[i + 1]);
    t[i + 1] = _mm512_maskz_unpackhi_ps(kAll, r[i], r[i + 1]);
  }
  // u[4g + j], lane l: column 4l + j of rows 4g..4g+3.
  __m512 u[16];
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_maskz_shuffle_ps(kAll, t[g], t[g + 2], 0x44);
    u[g + 1] = _mm512_maskz_shuffle_ps(kAll, t[g], t[g + 2], 0xEE);
    u[g + 2] = _mm512_maskz_shuffle_ps(kAll, t[g + 1], t[g + 3], 0x44);
    u[g + 3] = _mm512_maskz_shuffle_ps(kAll, t[g + 1], t[g + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 a_even =
        _mm512_maskz_shuffle_f32x4(kAll, u[j], u[4 + j], 0x88);  // lanes 0, 2 of each
    const __m512 a_odd = _mm512_maskz_shuffle_f32x4(kAll, u[j], u[4 + j], 0xDD);  // lanes 1, 3
    const __m512 b_even = _mm512_maskz_shuffle_f32x4(kAll, u[8 + j], u[12 + j], 0x88);
    const __m512 b_odd = _mm512_maskz_shuffle_f32x4(kAll, u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_maskz_shuffle_f32x4(kAll, a_even, b_even, 0x88);
    r[8 + j] = _mm512_maskz_shuffle_f32x4(kAll, a_even, b_even, 0xDD);
    r[4 + j] = _mm512_maskz_shuffle_f32x4(kAll, a_odd, b_odd, 0x88);
    r[12 + j] = _mm512_maskz_shuffle_f32x4(kAll, a_odd, b_odd, 0xDD);
  }
}
#endif  // HR_AVX512_HELPERS

// max and sum_i exp(x_i - max) of one row, in one pass over memory (see Note [One-pass
// softmax statistics] in docs/notes/memory-bound-kernels.md). The row is walked in blocks of
// kSoftmaxBlock floats: a block's max is taken, the running sums are rescaled once if it raised
// the running max, and the block's exponentials are summed while it is still in L1. The blocks
// and lanes depend on V only, so the result does not depend on the thread that computes it.
// Sixteen partial sums (lanes), then their total in double: a float sum over 50257 terms in one
// accumulator drifts by ~4e-5 relative.
constexpr int kSoftmaxBlock = 2048;  // 8 KiB: stays in L1 between the max and the exp-sum
inline void softmax_row_stats(const float* x, int V, float* maxv, float* sum) {
  float m = -INFINITY;
#if HR_AVX512_KERNELS
  // Every element through exp16, the last partial vector masked (no scalar tail).
  __m512 part = _mm512_setzero_ps();
  for (int b0 = 0; b0 < V; b0 += kSoftmaxBlock) {
    const int b1 = std::min(V, b0 + kSoftmaxBlock);
    __m512 vm = _mm512_set1_ps(m);
    for_each16(b0, b1, [&](int64_t i, __mmask16 k) {
      vm = _mm512_maskz_max_ps(0xFFFF, vm, _mm512_mask_loadu_ps(vm, k, x + i));
    });
    alignas(64) float vmax_lanes[16];  // (not _mm512_reduce_max_ps: GCC 12 warns falsely in it)
    _mm512_store_ps(vmax_lanes, vm);
    float bm = m;
    for (int j = 0; j < 16; ++j) bm = std::max(bm, vmax_lanes[j]);
    if (bm > m) {  // rescale what was summed against the old max (nothing on the first block)
      part = _mm512_mul_ps(part, _mm512_set1_ps(m == -INFINITY ? 0.0f : fast_exp(m - bm)));
      m = bm;
    }
    const __m512 vmax = _mm512_set1_ps(m);
    for_each16(b0, b1, [&](int64_t i, __mmask16 k) {
      part = _mm512_mask_add_ps(part, k, part,
                                exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vmax)));
    });
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, part);
  double s = 0.0;
  for (int j = 0; j < 16; ++j) s += lanes[j];
#else
  constexpr int kLanes = 16;
  float part[kLanes] = {};
  double s = 0.0;  // the last V % 16 terms, scaled to the final max like the lanes, then those
  for (int b0 = 0; b0 < V; b0 += kSoftmaxBlock) {
    const int b1 = std::min(V, b0 + kSoftmaxBlock);
    float bm = m;
#pragma omp simd reduction(max : bm)
    for (int i = b0; i < b1; ++i) bm = std::max(bm, x[i]);
    if (bm > m) {
      const float scale = m == -INFINITY ? 0.0f : fast_exp(m - bm);
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) part[j] *= scale;
      m = bm;
    }
    int i = b0;
    for (; i + kLanes <= b1; i += kLanes) {
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) part[j] += fast_exp(x[i + j] - m);
    }
    for (; i < b1; ++i) s += fast_exp(x[i] - m);  // only in the last block (b1 == V)
  }
  for (int j = 0; j < kLanes; ++j) s += part[j];
#endif
  *maxv = m;
  *sum = static_cast<float>(s);
}

// The same statistics as a log-sum-exp, log(sum_i exp(x_i)) = max + log(sum), in double before
// the one rounding to float.
inline double softmax_row_lse(const float* x, int V) {
  float m, s;
  softmax_row_stats(x, V, &m, &s);
  return std::log(static_cast<double>(s)) + m;
}

}  // namespace headroom::cpu
