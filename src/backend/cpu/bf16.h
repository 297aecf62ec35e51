// Element access for kernels that are written once over their storage type (float, bf16_t or
// f16_t): load as float, compute in float, store with one round to nearest even. Written as plain
// scalar code that GCC vectorises inside `omp simd` loops (the bf16 and f16 rounds are integer
// arithmetic plus selects), so the vector and scalar paths give the same bits, on any CPU. Bulk
// f16 conversions (the GEMM staging, casts) use F16C / AVX-512 vcvtph2ps / vcvtps2ph directly
// (kernels.cc), with these as their portable tail.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>

#include "backend/cpu/fast_math.h"
#include "core/dtype.h"

namespace headroom::cpu {

inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t x) { return std::bit_cast<float>(uint32_t(x.bits) << 16); }

// f16 -> fp32, exact. Branch-free integer arithmetic that GCC vectorises inside `omp simd`
// loops (GCC 12 keeps `_Float16` conversions scalar there, and will not if-convert an int ->
// float conversion for the subnormals under -ftrapping-math: measured, GELU's f16 backward ran
// 15-30x slower than fp32's until this). Subnormals (m 2^-24, m < 2^10) are normalised with a
// count of leading zeros (vplzcntd with AVX512CD).
inline float to_f32(f16_t x) {
  const uint32_t em = x.bits & 0x7fffu;  // exponent and mantissa
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  // Normal: rebias the exponent (15 -> 127); infinity and NaN (exponent 31) go to 255, keeping a
  // NaN's payload and quiet bit.
  const uint32_t normal = (em << 13) + (em >= 0x7c00u ? 0x70000000u : 0x38000000u);
  const uint32_t lz = uint32_t(__builtin_clz(em | 1u));  // 22..31 for a subnormal
  const uint32_t subnormal =
      em == 0 ? 0u : (((134u - lz) << 23) | ((em << (lz - 8u)) & 0x007fffffu));
  return std::bit_cast<float>((em < 0x0400u ? subnormal : normal) | sign);
}

template <typename T>
inline T from_f32(float x);
template <>
inline float from_f32<float>(float x) {
  return x;
}
template <>
inline bf16_t from_f32<bf16_t>(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return bf16_t{uint16_t(nan ? ((u >> 16) | 0x40u) : rounded)};
}

// fp32 -> f16, round to nearest even, overflow to infinity, NaN stays NaN (quieted): the same
// bits as core/dtype.h's f32_to_f16_bits (a NaN's payload aside) and as vcvtps2ph. Branch-free
// integer arithmetic, vectorised by GCC inside `omp simd` loops (see to_f32 above).
template <>
inline f16_t from_f32<f16_t>(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal f16 (|x| >= 2^-14): drop 13 mantissa bits, rounding to nearest even; a carry into
  // the exponent is the right answer (up to infinity, 0x7c00, from 65520 on).
  const uint32_t normal = (a - 0x38000000u + 0x0fffu + ((a >> 13) & 1u)) >> 13;
  // Subnormal f16 (|x| < 2^-14): the significand with its implicit bit, shifted right by
  // 126 - exponent (>= 14; clamped at 31, where everything rounds to zero), rounded to even.
  // Computed for every x and discarded for normal ones: clamped at 1 from below too, so that no
  // shift is by a negative amount (undefined behaviour, which UBSan reports) for large |x|.
  const uint32_t m = (a & 0x007fffffu) | 0x00800000u;
  const int32_t sh = std::clamp(126 - int32_t(a >> 23), 1, 31);
  const uint32_t half = m >> sh, rem = m & ((1u << sh) - 1u), mid = 1u << (sh - 1);
  const uint32_t subnormal = half + ((rem > mid || (rem == mid && (half & 1u))) ? 1u : 0u);
  const uint32_t finite = a >= 0x38800000u ? normal : subnormal;
  const uint32_t big = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x3ffu)) : 0x7c00u;
  return f16_t{uint16_t(sign | (a >= 0x47800000u ? big : finite))};
}

// x rounded to the nearest f16 value, as a float (exact: every f16 is a float).
inline float round_f16(float x) { return to_f32(from_f32<f16_t>(x)); }

#if HR_AVX512_HELPERS
// 16 floats to bf16 with the same rounding (and NaN handling) as from_f32<bf16_t>, by integer
// arithmetic (AVX-512F). (The maskz forms with a full mask avoid GCC 12's false
// -Wmaybe-uninitialized in the plain ones.) With a target attribute, as fast_math.h's AVX-512
// forms: the bf16 attention kernels use it too.
HR_AVX512_TARGET inline __m256i cvt_ps_bf16_int(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb =
      _mm512_and_si512(_mm512_maskz_srli_epi32(0xFFFF, u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  return _mm512_maskz_cvtepi32_epi16(0xFFFF, _mm512_maskz_srli_epi32(0xFFFF, r, 16));
}

// The same bits as cvt_ps_bf16_int. With AVX512-BF16, vcvtneps2bf16 gives them in one instruction
// (round to nearest even; a NaN keeps its upper bits and is quieted with 0x40, as here) except for
// denormal inputs, which it flushes to zero: a vector holding one (|x| < 2^-126, rare in
// training) takes the integer form. About 8 instructions fewer per 16 values stored.
HR_AVX512_TARGET inline __m256i cvt_ps_bf16(__m512 v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) == 0, 1)) {  // 0x20: denormal
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  }
#endif
  return cvt_ps_bf16_int(v);
}
#endif

#if HR_AVX512_KERNELS
// Masked loads and stores of 16 elements as floats, for kernels whose vector loop is written
// out: lanes outside `m` are not read (they load as 0) and not written. bf16 widens exactly;
// f16 widens exactly (vcvtph2ps) and rounds to nearest even (vcvtps2ph: the bits of
// from_f32<f16_t>, a NaN's payload aside); bf16 rounds as from_f32<bf16_t> (cvt_ps_bf16).
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(
      _mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, h), 16));
}
inline __m512 load16(const f16_t* p, __mmask16 m) {
  return _mm512_maskz_cvtph_ps(0xFFFF, _mm256_maskz_loadu_epi16(m, p));
}
inline void store16(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(bf16_t* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, cvt_ps_bf16(v));
}
inline void store16(f16_t* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(
      p, m, _mm512_maskz_cvtps_ph(0xFFFF, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Two vectors' bf16 rounding, packed: words 0-15 from lo, 16-31 from hi; the bits of
// from_f32<bf16_t> (as cvt_ps_bf16). One vcvtne2ps2bf16 where neither vector holds a denormal
// (which it would flush), else the integer rounding of both.
inline __m512i cvt2_ps_bf16(__m512 lo, __m512 hi) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if (__builtin_expect((_mm512_fpclass_ps_mask(lo, 0x20) | _mm512_fpclass_ps_mask(hi, 0x20)) == 0,
                       1)) {
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  }
#endif
  const __m512i packed_lo =
      _mm512_maskz_inserti64x4(0xFF, _mm512_setzero_si512(), cvt_ps_bf16_int(lo), 0);
  return _mm512_maskz_inserti64x4(0xFF, packed_lo, cvt_ps_bf16_int(hi), 1);
}

// 32 consecutive values (lo the first 16) as bf16: the bits of two store16 calls, one conversion
// and one 512-bit store.
inline void store32(bf16_t* p, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(p, cvt2_ps_bf16(lo, hi));
}

// 32 bf16 values as two fp32 vectors, the even elements and the odd ones: one plain 512-bit load,
// then a shift (even: the low half of each 32-bit pair moved up) and an and (odd: already the
// upper half), where load16 widens 16 values with a lane-crossing vpmovzxwd. For elementwise maps
// (a lane's result depends only on that lane's input), whose results store32_eo puts back in
// order: about 14% fewer cycles for GELU's backward in L1 (see Note [Even and odd bf16 elements]
// in docs/notes/memory-bound-kernels.md).
inline void load32_eo(const bf16_t* p, __m512* even, __m512* odd) {
  const __m512i v = _mm512_loadu_si512(p);
  *even = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, v, 16));
  *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u))));
}
// The inverse of load32_eo: both vectors rounded as store16 rounds them (the bits of
// from_f32<bf16_t>), then interleaved back into element order by one vpermw.
inline void store32_eo(bf16_t* p, __m512 even, __m512 odd) {
  // Word 2j takes even's j (word j of the packed pair), word 2j + 1 odd's j (word 16 + j).
  const __m512i interleave =
      _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_storeu_si512(p, _mm512_permutexvar_epi16(interleave, cvt2_ps_bf16(even, odd)));
}
#endif

template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, bf16_t>) {
    return DType::kBF16;
  } else if constexpr (std::is_same_v<T, f16_t>) {
    return DType::kF16;
  } else {
    static_assert(std::is_same_v<T, float>);
    return DType::kF32;
  }
}

}  // namespace headroom::cpu
