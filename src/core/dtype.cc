// Names of dtypes and the IEEE half conversions (bit manipulation, round to nearest even).
#include "core/dtype.h"

#include <string>

namespace headroom {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kI32:
      return "i32";
    case DType::kU16:
      return "u16";
    case DType::kI64:
      return "i64";
    case DType::kU8:
      return "u8";
  }
  return "?";
}

std::string_view dtype_safetensors_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kI32:
      return "I32";
    case DType::kU16:
      return "U16";
    case DType::kI64:
      return "I64";
    case DType::kU8:
      return "U8";
  }
  return "?";
}

Result<DType> dtype_from_safetensors_name(std::string_view name) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kU16, DType::kI64}) {
    if (dtype_safetensors_name(t) == name) return t;
  }
  return Status::unsupported("dtype '" + std::string(name) +
                             "' is not supported (expected F32, BF16, F16, I32, U16 or I64)");
}

uint16_t f32_to_f16_bits(float f) {
  uint32_t x = f32_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t mant = x & 0x007fffffu;
  int32_t exp = int32_t((x >> 23) & 0xff);
  if (exp == 0xff) return uint16_t(sign | 0x7c00u | (mant ? 0x200u : 0u));  // inf / nan
  int32_t e = exp - 127 + 15;
  if (e >= 0x1f) return uint16_t(sign | 0x7c00u);  // overflow to inf
  if (e <= 0) {
    if (e < -10) return uint16_t(sign);  // underflow to zero
    mant |= 0x00800000u;
    uint32_t shift = uint32_t(14 - e);
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) half++;
    return uint16_t(sign | half);
  }
  uint32_t half = sign | (uint32_t(e) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++;  // may carry into exponent: fine
  return uint16_t(half);
}

float f16_bits_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return f32_from_bits(sign);
    // subnormal: normalise
    int e = -1;
    do {
      e++;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    mant &= 0x3ffu;
    return f32_from_bits(sign | (uint32_t(127 - 15 - e) << 23) | (mant << 13));
  }
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (mant << 13));
  return f32_from_bits(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

}  // namespace headroom
