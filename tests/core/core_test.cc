// Unit tests for core/: status, dtype conversions, byte units, shapes.
#include <gtest/gtest.h>

#include <cmath>

#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/units.h"

namespace headroom {
namespace {

Result<int> half_of(int x) {
  if (x % 2) return Status::invalid_argument("odd: " + std::to_string(x));
  return x / 2;
}

Status use_half(int x, int* out) {
  HR_ASSIGN_OR_RETURN(int h, half_of(x));
  *out = h;
  return Status::ok();
}

TEST(Status, ResultAndMacros) {
  int out = 0;
  EXPECT_TRUE(use_half(8, &out).is_ok());
  EXPECT_EQ(out, 4);
  Status s = use_half(3, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.to_string(), "InvalidArgument: odd: 3");
  EXPECT_EQ(s.with_context("file.json").message(), "file.json: odd: 3");
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(bf16_bits_to_f32(0x3f80), 1.0f);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (1.0).
  EXPECT_EQ(f32_to_bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3*2^-8 ties upwards to the even neighbour 1 + 2^-6.
  EXPECT_EQ(f32_to_bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(NAN))));
}

TEST(DType, F16RoundTrip) {
  for (float f : {0.0f, 1.0f, -2.5f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f, 0.1f}) {
    float back = f16_bits_to_f32(f32_to_f16_bits(f));
    EXPECT_NEAR(back, f, std::fabs(f) * 1e-3 + 1e-8) << f;
  }
  EXPECT_EQ(f32_to_f16_bits(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16_bits(1e6f), 0x7c00);  // overflow to +inf
  EXPECT_EQ(f16_bits_to_f32(0x0001), std::ldexp(1.0f, -24));
}

TEST(Units, ParseBytes) {
  EXPECT_EQ(*parse_bytes("4GiB"), 4 * kGiB);
  EXPECT_EQ(*parse_bytes("512MiB"), 512 * kMiB);
  EXPECT_EQ(*parse_bytes("24GB"), 24000000000ull);
  EXPECT_EQ(*parse_bytes("1.5g"), 3 * kGiB / 2);
  EXPECT_EQ(*parse_bytes("1048576"), kMiB);
  EXPECT_EQ(*parse_bytes(" 2 KiB "), 2048u);
  EXPECT_FALSE(parse_bytes("lots").is_ok());
  EXPECT_FALSE(parse_bytes("4 parsecs").is_ok());
  EXPECT_FALSE(parse_bytes("").is_ok());
  EXPECT_NE(parse_bytes("4XB").status().message().find("4XB"), std::string::npos);
}

TEST(Units, FormatBytes) {
  EXPECT_EQ(format_bytes(812), "812 B");
  EXPECT_EQ(format_bytes(4 * kGiB), "4.00 GiB");
  EXPECT_EQ(format_bytes(512 * kMiB), "512 MiB");
}

TEST(Shape, Numel) {
  Shape s{2, 16, 64};
  EXPECT_EQ(s.numel(), 2048);
  EXPECT_EQ(s.to_string(), "[2, 16, 64]");
}

}  // namespace
}  // namespace headroom
