// Element access for kernels that are written once over their storage type (float, bf16_t or
// f16_t): load as float, compute in float, store with one round to nearest even. Written as plain
// scalar code that GCC vectorises inside `omp simd` loops (the bf16 round is integer arithmetic
// plus a select for NaN; the f16 conversions are the compiler's _Float16 conversions, which
// become F16C / AVX512-FP16 vcvtph2ps / vcvtps2ph), so the vector and scalar paths give the same
// bits. Without _Float16 the f16 conversions fall back to core/dtype.h's portable ones.
#pragma once

#include <immintrin.h>

#include <bit>
#include <cstdint>
#include <type_traits>

#include "core/dtype.h"

namespace headroom::cpu {

inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t x) { return std::bit_cast<float>(uint32_t(x.bits) << 16); }

#if defined(__FLT16_MANT_DIG__)
inline float to_f32(f16_t x) { return static_cast<float>(std::bit_cast<_Float16>(x.bits)); }
#else
inline float to_f32(f16_t x) { return f16_bits_to_f32(x.bits); }
#endif

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

// Round to nearest even (IEEE), overflow to infinity, NaN stays NaN (quieted), as
// core/dtype.h's f32_to_f16_bits (which may differ in a NaN's payload bits only).
template <>
inline f16_t from_f32<f16_t>(float x) {
#if defined(__FLT16_MANT_DIG__)
  return f16_t{std::bit_cast<uint16_t>(static_cast<_Float16>(x))};
#else
  return f16_t{f32_to_f16_bits(x)};
#endif
}

// x rounded to the nearest f16 value, as a float (exact: every f16 is a float).
inline float round_f16(float x) { return to_f32(from_f32<f16_t>(x)); }

#if defined(__AVX512F__)
// 16 floats to bf16 with the same rounding (and NaN handling) as from_f32<bf16_t>. (The maskz
// forms with a full mask avoid GCC 12's false -Wmaybe-uninitialized in the plain ones.)
inline __m256i cvt_ps_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb =
      _mm512_and_si512(_mm512_maskz_srli_epi32(0xFFFF, u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  return _mm512_maskz_cvtepi32_epi16(0xFFFF, _mm512_maskz_srli_epi32(0xFFFF, r, 16));
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
