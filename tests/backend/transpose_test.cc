// The 16-bit transposing copy (transpose.h) against a scalar transpose: odd shapes (ragged tile
// edges), padded strides whose padding must stay untouched, the non-temporal path of large
// aligned copies, and thread counts.
#include <gtest/gtest.h>

#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

#include "backend/cpu/transpose.h"

namespace headroom::cpu {
namespace {

constexpr uint16_t kCanary = 0x7fc1;

// src [rows, ld_src] of distinct values (the low 16 bits of a hash of the position).
std::vector<uint16_t> make_src(int64_t rows, int64_t ld_src) {
  std::vector<uint16_t> s(size_t(rows * ld_src));
  for (size_t i = 0; i < s.size(); ++i) s[i] = uint16_t((i * 2654435761u) >> 7);
  return s;
}

// Transposes into dst (ld_dst, canaries elsewhere) and checks every element and canary.
void check(uint16_t* dst, int64_t rows, int64_t cols, int64_t ld_src, int64_t ld_dst) {
  SCOPED_TRACE(testing::Message() << rows << " x " << cols << ", ld " << ld_src << " -> "
                                  << ld_dst);
  const std::vector<uint16_t> src = make_src(rows, ld_src);
  std::fill(dst, dst + cols * ld_dst, kCanary);
  transpose_16bit(dst, ld_dst, src.data(), ld_src, rows, cols);
  int64_t bad = 0;
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < ld_dst; ++r) {
      const uint16_t want = r < rows ? src[size_t(r * ld_src + c)] : kCanary;
      if (dst[c * ld_dst + r] != want && bad++ < 5) {
        ADD_FAILURE() << "dst[" << c << "][" << r << "] = " << dst[c * ld_dst + r] << ", want "
                      << want;
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

struct AlignedFree {
  void operator()(uint16_t* p) const { ::operator delete[](p, std::align_val_t(64)); }
};
std::unique_ptr<uint16_t[], AlignedFree> aligned(size_t n) {
  return std::unique_ptr<uint16_t[], AlignedFree>(
      static_cast<uint16_t*>(::operator new[](n * 2, std::align_val_t(64))));
}

TEST(Transpose, MatchesScalarAtOddShapes) {
  for (int64_t rows : {1, 15, 16, 17, 31, 32, 33, 64, 95, 130}) {
    for (int64_t cols : {1, 7, 16, 17, 40, 255, 256, 257, 300}) {
      for (int64_t pad : {0, 3}) {
        const int64_t ld_src = cols + pad, ld_dst = rows + 2 * pad;
        std::vector<uint16_t> dst(size_t(cols * ld_dst) + 1);
        check(dst.data() + 1, rows, cols, ld_src, ld_dst);  // unaligned dst
      }
    }
  }
}

// 1024 x 600 (1.2 MB, 64-byte aligned rows): the non-temporal whole-line stores, with a ragged
// edge; and the same with a padded, still aligned, dst stride.
TEST(Transpose, LargeAlignedCopyStreams) {
  for (int64_t ld_dst : {1024, 1056}) {
    auto dst = aligned(size_t(600 * ld_dst));
    check(dst.get(), 1024, 600, 610, ld_dst);
  }
  auto dst = aligned(size_t(2001 * 1040));
  check(dst.get(), 1030, 2001, 2001, 1040);  // ragged rows and columns
}

TEST(Transpose, ThreadCountInvariant) {
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    auto dst = aligned(size_t(700 * 800));
    check(dst.get(), 800, 700, 700, 800);
  }
  omp_set_num_threads(saved);
}

TEST(Transpose, EmptyIsANoOp) {
  transpose_16bit(nullptr, 0, nullptr, 0, 0, 0);
  uint16_t x = kCanary;
  transpose_16bit(&x, 1, &x, 0, 1, 0);
  EXPECT_EQ(x, kCanary);
}

TEST(TransposeDeathTest, RejectsShortStrides) {
  std::vector<uint16_t> a(64), b(64);
  EXPECT_DEATH(transpose_16bit(a.data(), 4, b.data(), 7, 8, 8), "source.s row stride");
  EXPECT_DEATH(transpose_16bit(a.data(), 7, b.data(), 8, 8, 8), "destination.s row stride");
}

}  // namespace
}  // namespace headroom::cpu
