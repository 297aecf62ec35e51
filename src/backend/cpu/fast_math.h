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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
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
// GELU's forms also use vrangeps (AVX512DQ); only the kernels compiled for this CPU call them.
#define HR_AVX512DQ_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
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

// for_each16's walk with kBlock elements (a multiple of 16) at a time: fb(i) for [i, i + kBlock)
// while they last, then f(i, k) for what remains, as for_each16 does. Several independent vectors
// in one iteration let a long per-vector chain (GELU's) overlap without relying on the
// out-of-order window.
template <int64_t kBlock, typename F, typename FB>
HR_AVX512_TARGET inline void for_each_block(int64_t i0, int64_t i1, F&& f, FB&& fb) {
  static_assert(kBlock % 16 == 0);
  int64_t i = i0;
  for (; i + kBlock <= i1; i += kBlock) fb(i);
  for_each16(i, i1, f);
}
// Four whole vectors at a time: f4(i) for [i, i + 64).
template <typename F, typename F4>
HR_AVX512_TARGET inline void for_each64(int64_t i0, int64_t i1, F&& f, F4&& f4) {
  for_each_block<64>(i0, i1, f, f4);
}

// ---- AVX-512 forms, for kernels that write their vector loop out --------------------------
// Every element of such a kernel goes through these (a range's last partial vector is masked,
// never a scalar tail), so an element's result does not depend on where a thread's range starts.

// (The maskz forms with a full mask avoid GCC 12's false -Wmaybe-uninitialized in the plain ones,
// as in bf16.h.) exp of 16 floats: fast_exp's argument clamp, reduction and polynomial, with FMAs
// and vscalefps for the 2^n (relative error below 2e-7 for x in [-87, 88]; NaN stays NaN:
// vmaxps/vminps return their second operand, x, when it is a NaN).
// kNonPositive: for x <= 0 or NaN (a softmax's x - max), where the upper clamp changes nothing:
// the same bits, one instruction fewer (about 1/15 of the loss's arithmetic per logit).
template <bool kNonPositive = false>
HR_AVX512_TARGET inline __m512 exp16(__m512 x) {
  x = _mm512_maskz_max_ps(0xFFFF, _mm512_set1_ps(-87.0f), x);
  if constexpr (!kNonPositive) x = _mm512_maskz_min_ps(0xFFFF, _mm512_set1_ps(88.0f), x);
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

// ---- Forms over a group of K vectors ------------------------------------------------------
// exp2_16, gelu16 and gelu_grad16 below each take an array of K vectors and compute in place,
// one step at a time across the K vectors (step 1 of every vector, then step 2, ...). Each lane
// takes the same operations in the same order whatever K is, so the same bits; the single-vector
// forms are the K = 1 case. Why: GELU's chain is about 20 dependent operations of 3-4 cycles (the
// division more), and written one vector after another, the out-of-order window held too few
// vectors' chains to keep Zen 5's pipes busy. Eight vectors step by step took 0.78-0.80x the
// cycles of four one after another (the gradient in f16, in L1; see
// docs/notes/memory-bound-kernels.md, "GELU step by step across eight vectors").
#define HR_EACH(k, K) for (int k = 0; k < (K); ++k)

// 2^t for t in [-150, 150] (callers clamp; NaN stays NaN): t = n + f with n = round(t) and
// |f| <= 1/2, 2^f by a minimax polynomial (fitted by Remez for relative error on [-1/2, 1/2]),
// 2^n by vscalefps (2^150 is inf, 2^-150 is 0). Relative error, evaluated in float with FMAs:
// degree 6 below 1e-7 (float's rounding), degree 4 below 2.7e-6 (GELU in 16-bit storage).
template <int kDegree, int K>
HR_AVX512_TARGET inline void exp2_16(__m512 (&t)[K]) {
  static_assert(kDegree == 4 || kDegree == 6);
  static constexpr float kCoef6[] = {1.534581243e-4f,
                                     1.339993090e-3f,
                                     9.618489072e-3f,
                                     5.550328642e-2f,
                                     2.402264625e-1f,
                                     6.931471825e-1f,
                                     1.0f};
  static constexpr float kCoef4[] = {9.570102207e-3f, 5.591785908e-2f, 2.402474433e-1f,
                                     6.931217909e-1f, 9.999992847e-1f};
  const float* c = kDegree == 6 ? kCoef6 : kCoef4;  // highest degree first
  __m512 n[K], p[K];
  HR_EACH(k, K) {
    n[k] = _mm512_maskz_roundscale_ps(0xFFFF, t[k], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  HR_EACH(k, K) t[k] = _mm512_sub_ps(t[k], n[k]);  // f
  HR_EACH(k, K) p[k] = _mm512_set1_ps(c[0]);
  for (int d = 1; d <= kDegree; ++d) {
    HR_EACH(k, K) p[k] = _mm512_fmadd_ps(p[k], t[k], _mm512_set1_ps(c[d]));
  }
  HR_EACH(k, K) t[k] = _mm512_maskz_scalef_ps(0xFFFF, p[k], n[k]);
}
template <int kDegree>
HR_AVX512_TARGET inline __m512 exp2_16(__m512 t) {
  __m512 v[1] = {t};
  exp2_16<kDegree>(v);
  return v[0];
}

// GELU, tanh form: 0.5 x (1 + tanh u) with u = sqrt(2/pi) (x + 0.044715 x^3), computed as
// x * sigma(2u) = x / (1 + exp(-2u)), with exp(-2u) = 2^t, t = x (a + b x^2): the constants fold
// sqrt(2/pi), 0.044715 and 1/ln 2 into one polynomial in x. This form has no cancellation: its
// relative error is small for every x, where 0.5 x (1 + tanh u) loses it for x below about -3
// (tanh u near -1). t is clamped to [-150, 150], where 2^t is 0 or inf: x for large x, 0 for very
// negative x (NaN at x = -inf, as the tanh form gives). kNarrow: for 16-bit storage, whose rounding
// is 2^-9 (bf16) or 2^-12 (f16) relative: 2^t of degree 4 and vrcp14ps (2^-14) for the division;
// relative error below 7e-5, about 15 instructions instead of 20 (see
// docs/notes/memory-bound-kernels.md, "GELU in 16-bit storage").
constexpr float kGeluT1 = float(-2.0 * 0.7978845608028654 * 1.4426950408889634);
constexpr float kGeluT3 = float(-2.0 * 0.7978845608028654 * 1.4426950408889634 * 0.044715);
// t = x (a + b x^2) for each vector, so that exp(-2u) = 2^t (x2: x^2).
template <int K>
HR_AVX512_TARGET inline void gelu_t16(__m512 (&t)[K], const __m512 (&x)[K], const __m512 (&x2)[K]) {
  HR_EACH(k, K) t[k] = _mm512_fmadd_ps(x2[k], _mm512_set1_ps(kGeluT3), _mm512_set1_ps(kGeluT1));
  HR_EACH(k, K) t[k] = _mm512_mul_ps(x[k], t[k]);
}
// x[k] = gelu(x[k]), in place.
template <bool kNarrow = false, int K>
HR_AVX512DQ_TARGET inline void gelu16(__m512 (&x)[K]) {
  __m512 t[K];
  HR_EACH(k, K) t[k] = _mm512_mul_ps(x[k], x[k]);
  gelu_t16(t, x, t);
  // vrangeps, imm 2: the operand of smaller magnitude with t's sign, i.e. t clamped to [-150,
  // 150] in one instruction (checked on every class of input: imm 6 would give +150 for
  // t = -205; a NaN t gives 150, and x's NaN carries through to the result).
  HR_EACH(k, K) t[k] = _mm512_maskz_range_ps(0xFFFF, t[k], _mm512_set1_ps(150.0f), 0x2);
  exp2_16<kNarrow ? 4 : 6>(t);
  HR_EACH(k, K) t[k] = _mm512_add_ps(t[k], _mm512_set1_ps(1.0f));
  if constexpr (kNarrow) {
    HR_EACH(k, K) x[k] = _mm512_mul_ps(x[k], _mm512_maskz_rcp14_ps(0xFFFF, t[k]));
  } else {
    HR_EACH(k, K) x[k] = _mm512_div_ps(x[k], t[k]);
  }
}
template <bool kNarrow = false>
HR_AVX512DQ_TARGET inline __m512 gelu16(__m512 x) {
  __m512 v[1] = {x};
  gelu16<kNarrow>(v);
  return v[0];
}

// d gelu / dx = sigma + x sigma (1 - sigma) 2u', with sigma = sigma(2u) = 1 / (1 + e), e =
// exp(-2u), and u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2): sigma (1 + x e sigma 2u'), since
// 1 - sigma = e sigma, which has no cancellation where sigma is near 1 (1 - sigma would carry
// sigma's rounding, times x 2u', about 35 at x = 5). x is first clamped to [-10, 10], where
// |t| <= 126: e stays finite, so e sigma <= 1 (inf * 0 would be NaN), and x^2 cannot overflow
// (an input of 2e19 would make 2u' inf). Outside, gelu' is 1 (x > 10) or within 3e-36 of 0
// (x < -10) in float anyway. The clamp keeps a NaN (vmaxps and vminps return their second
// operand, x, when it is one).
// kNarrow (16-bit storage): 2^t of degree 4, as gelu16<true>, and the gradient as
// sigma + x 2u' (sigma - sigma^2), one operation fewer (below); the division stays, since near
// gelu''s zero (x = -0.75) the bracket cancels and a 2^-14 reciprocal's error would show in f16.
// Every bf16 and f16 input is still faithfully rounded (GeluIsFaithfullyRoundedOnEveryInput).
// x[k] = gelu'(x[k]), in place.
template <bool kNarrow = false, int K>
HR_AVX512DQ_TARGET inline void gelu_grad16(__m512 (&x)[K]) {
  __m512 x2[K], e[K], s[K];
  HR_EACH(k, K) {
    x[k] = _mm512_maskz_min_ps(0xFFFF, _mm512_set1_ps(10.0f),
                               _mm512_maskz_max_ps(0xFFFF, _mm512_set1_ps(-10.0f), x[k]));
  }
  HR_EACH(k, K) x2[k] = _mm512_mul_ps(x[k], x[k]);
  gelu_t16(e, x, x2);
  exp2_16<kNarrow ? 4 : 6>(e);
  HR_EACH(k, K) {
    s[k] = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(e[k], _mm512_set1_ps(1.0f)));
  }
  HR_EACH(k, K) {  // 2 u'
    x2[k] = _mm512_fmadd_ps(x2[k], _mm512_set1_ps(2.0f * 0.7978845608028654f * 3.0f * 0.044715f),
                            _mm512_set1_ps(2.0f * 0.7978845608028654f));
  }
  if constexpr (kNarrow) {
    // sigma + x 2u' (sigma - sigma^2): three operations where the form below takes four.
    // sigma - sigma^2 by one FMA carries sigma's rounding where sigma is near 1 (x > 2): an error
    // below 2^-24 x 2u' sigma, under 2^-16 of the result for |x| <= 10, far inside 16-bit
    // rounding; near gelu''s zero the bracket cancels as in the form below.
    HR_EACH(k, K) e[k] = _mm512_fnmadd_ps(s[k], s[k], s[k]);
    HR_EACH(k, K) x[k] = _mm512_fmadd_ps(_mm512_mul_ps(x[k], x2[k]), e[k], s[k]);
  } else {
    HR_EACH(k, K) e[k] = _mm512_mul_ps(x[k], _mm512_mul_ps(e[k], s[k]));  // x e sigma
    HR_EACH(k, K) x[k] = _mm512_mul_ps(s[k], _mm512_fmadd_ps(e[k], x2[k], _mm512_set1_ps(1.0f)));
  }
}

template <bool kNarrow = false>
HR_AVX512DQ_TARGET inline __m512 gelu_grad16(__m512 x) {
  __m512 v[1] = {x};
  gelu_grad16<kNarrow>(v);
  return v[0];
}
#undef HR_EACH

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

// The max of a row: the same value for any order of the elements (a NaN may or may not survive
// it, as vmaxps returns its second operand when either is one; a NaN logit still makes the row's
// sum and loss NaN through its exponential). Four running maxima, so that the pass runs at the
// rate of its loads from L2 rather than one vmaxps latency per vector (0.80 against 1.18 TSC
// ticks per vector of a 201 KB row in L2; docs/notes/memory-bound-kernels.md, "The loss's max in
// four chains, and benchmarks on a cache line").
inline float row_max(const float* x, int V) {
  float m = -INFINITY;
#if HR_AVX512_KERNELS
  __m512 vm[4];
  for (__m512& v : vm) v = _mm512_set1_ps(m);
  for_each64(
      0, V,
      [&](int64_t i, __mmask16 k) {
        vm[0] = _mm512_maskz_max_ps(0xFFFF, vm[0], _mm512_mask_loadu_ps(vm[0], k, x + i));
      },
      [&](int64_t i) {
        for (int q = 0; q < 4; ++q) {
          vm[q] = _mm512_maskz_max_ps(0xFFFF, vm[q], _mm512_loadu_ps(x + i + 16 * q));
        }
      });
  alignas(64) float lanes[64];  // (not _mm512_reduce_max_ps: GCC 12 warns falsely in it)
  for (int q = 0; q < 4; ++q) _mm512_store_ps(lanes + 16 * q, vm[q]);
  for (float v : lanes) m = std::max(m, v);
#else
#pragma omp simd reduction(max : m)
  for (int i = 0; i < V; ++i) m = std::max(m, x[i]);
#endif
  return m;
}

// max and sum_i exp(x_i - max) of one row, in two passes (see Note [Softmax statistics with
// the exponentials kept] in docs/notes/memory-bound-kernels.md): the max (the row's read from
// memory), then the exponentials from L2 (a GPT-2 row is 201 KB). With `e` not null,
// exp(x_i - max) is also stored in e[i] (e may be x: each vector is read before it is written),
// so that the loss's gradient needs no second exponential. prefetch: a row to fetch into L2
// during the exponentials, which leave memory idle (null: none), a cache line per vector of x.
// Sixteen partial sums (lanes) in element order, then their total in double: a float sum over
// 50257 terms in one accumulator drifts by ~4e-5 relative. Lanes and order depend on V only, so
// the result does not depend on the thread that computes it.
inline void softmax_row_stats(const float* x, int V, float* maxv, float* sum, float* e = nullptr,
                              const float* prefetch = nullptr) {
  const float m = row_max(x, V);
#if HR_AVX512_KERNELS
  // Every element through exp16, the last partial vector masked (no scalar tail); four vectors
  // at a time, added to the lanes in element order.
  const __m512 vmax = _mm512_set1_ps(m);
  __m512 part = _mm512_setzero_ps();
  for_each64(
      0, V,
      [&](int64_t i, __mmask16 k) {
        if (prefetch != nullptr) {
          _mm_prefetch(reinterpret_cast<const char*>(prefetch + i), _MM_HINT_T1);
        }
        const __m512 v = exp16<true>(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vmax));
        if (e != nullptr) _mm512_mask_storeu_ps(e + i, k, v);
        part = _mm512_mask_add_ps(part, k, part, v);
      },
      [&](int64_t i) {
        __m512 v[4];
        for (int q = 0; q < 4; ++q) {
          if (prefetch != nullptr) {
            _mm_prefetch(reinterpret_cast<const char*>(prefetch + i + 16 * q), _MM_HINT_T1);
          }
          v[q] = exp16<true>(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16 * q), vmax));
        }
        for (int q = 0; q < 4; ++q) {
          if (e != nullptr) _mm512_storeu_ps(e + i + 16 * q, v[q]);
          part = _mm512_add_ps(part, v[q]);
        }
      });
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, part);
  double s = 0.0;
  for (int j = 0; j < 16; ++j) s += lanes[j];
#else
  (void)prefetch;
  constexpr int kLanes = 16;
  float part[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    float v[kLanes];
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) v[j] = fast_exp(x[i + j] - m);
    if (e != nullptr) {
      for (int j = 0; j < kLanes; ++j) e[i + j] = v[j];
    }
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) part[j] += v[j];
  }
  double s = 0.0;  // the last V % 16 terms, then the lanes
  for (; i < V; ++i) {
    const float v = fast_exp(x[i] - m);
    if (e != nullptr) e[i] = v;
    s += v;
  }
  for (int j = 0; j < kLanes; ++j) s += part[j];
#endif
  *maxv = m;
  *sum = static_cast<float>(s);
}

// The same statistics as a log-sum-exp, log(sum_i exp(x_i)) = max + log(sum), in double before
// the one rounding to float.
inline double softmax_row_lse(const float* x, int V, const float* prefetch = nullptr) {
  float m, s;
  softmax_row_stats(x, V, &m, &s, nullptr, prefetch);
  return std::log(static_cast<double>(s)) + m;
}

}  // namespace headroom::cpu
