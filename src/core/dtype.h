// Element types and conversions. bf16 and f16 are stored as uint16_t bit patterns; conversions
// round to nearest even, as PyTorch and oneDNN do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "core/status.h"

namespace headroom {

// kU8: bytes (sparsity masks, one byte per weight); not a safetensors weight dtype here.
enum class DType : uint8_t { kF32, kBF16, kF16, kI32, kU16, kI64, kU8 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kF16:
      return 2;
    case DType::kI32:
      return 4;
    case DType::kU16:
      return 2;
    case DType::kI64:
      return 8;
    case DType::kU8:
      return 1;
  }
  return 0;
}

// "f32", "bf16", ... (lower case, as on the command line).
std::string_view dtype_name(DType t);
// The safetensors spelling: "F32", "BF16", "F16", "I32", "U16", "I64".
std::string_view dtype_safetensors_name(DType t);
Result<DType> dtype_from_safetensors_name(std::string_view name);

struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu))
    return uint16_t((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);      // round to nearest even
  return uint16_t(u >> 16);
}
inline float bf16_bits_to_f32(uint16_t b) { return f32_from_bits(uint32_t(b) << 16); }

uint16_t f32_to_f16_bits(float f);
float f16_bits_to_f32(uint16_t h);

}  // namespace headroom
