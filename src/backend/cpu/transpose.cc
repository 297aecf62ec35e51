// The 16-bit transposing copy (transpose.h): 16 x 16 tiles transposed in registers in four
// unpack stages, walked in blocks of 32 rows x 256 columns. A block reads 32 row segments of 512
// contiguous bytes (consecutive cache sets whatever the row stride: a tall narrow block read one
// 64-byte line per row, and with a 6144-byte stride its lines all fell into two L1 sets) and
// writes 256 whole 64-byte lines.
#include "backend/cpu/transpose.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "core/check.h"

namespace headroom::cpu {
namespace {

constexpr int64_t kBlockCols = 256;  // src columns (dst rows) per block
constexpr int64_t kBlockRows = 32;   // src rows (dst columns) per block
// Copies of at least this many bytes store whole lines non-temporally: a transposed copy larger
// than L2 ran 2x faster so (no read for ownership), and the smaller ones measured no slower even
// though the GEMM reads them right after (docs/gemm.md).
constexpr int64_t kStreamBytes = int64_t(1) << 20;

// The scalar copy of the sub-matrix [r0, r1) x [c0, c1).
inline void transpose_scalar(uint16_t* dst, int64_t ld_dst, const uint16_t* src, int64_t ld_src,
                             int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) {
    for (int64_t r = r0; r < r1; ++r) dst[c * ld_dst + r] = src[r * ld_src + c];
  }
}

#if defined(__AVX512F__)
// A 16 x 16 tile transposed in registers: s points at src[r][c]; on return o[j] holds column
// c + j of the 16 rows.
inline void transpose16x16(__m256i o[16], const uint16_t* s, int64_t ld_src) {
  __m256i a[16], b[16];
  for (int i = 0; i < 16; ++i) {
    a[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i * ld_src));
  }
  // Within each 128-bit half (columns 0-7 | 8-15): pairs of rows interleaved by 16 bits, then
  // 32 bits, then 64 bits, after which b[k] holds column j | j + 8 of eight rows.
  for (int i = 0; i < 8; ++i) {
    b[2 * i] = _mm256_unpacklo_epi16(a[2 * i], a[2 * i + 1]);      // cols 0-3 | 8-11
    b[2 * i + 1] = _mm256_unpackhi_epi16(a[2 * i], a[2 * i + 1]);  // cols 4-7 | 12-15
  }
  for (int g = 0; g < 4; ++g) {  // rows 4g .. 4g+3
    const int k = 4 * g;
    a[k] = _mm256_unpacklo_epi32(b[k], b[k + 2]);          // cols 0,1 | 8,9
    a[k + 1] = _mm256_unpackhi_epi32(b[k], b[k + 2]);      // cols 2,3 | 10,11
    a[k + 2] = _mm256_unpacklo_epi32(b[k + 1], b[k + 3]);  // cols 4,5 | 12,13
    a[k + 3] = _mm256_unpackhi_epi32(b[k + 1], b[k + 3]);  // cols 6,7 | 14,15
  }
  for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h+7
    const int k = 8 * h;
    for (int j = 0; j < 4; ++j) {
      b[k + 2 * j] = _mm256_unpacklo_epi64(a[k + j], a[k + 4 + j]);      // col 2j | 2j+8
      b[k + 2 * j + 1] = _mm256_unpackhi_epi64(a[k + j], a[k + 4 + j]);  // col 2j+1 | 2j+9
    }
  }
  for (int j = 0; j < 8; ++j) {  // b[j]: rows 0-7, b[8 + j]: rows 8-15
    o[j] = _mm256_permute2x128_si256(b[j], b[8 + j], 0x20);
    o[j + 8] = _mm256_permute2x128_si256(b[j], b[8 + j], 0x31);
  }
}

// A 32-row x 16-column tile: s points at src[r][c], d at dst[c][r]; each of the 16 dst rows gets
// one 64-byte store (a whole cache line when d is 64-byte aligned), non-temporal with Stream.
template <bool Stream>
inline void transpose32x16(uint16_t* d, int64_t ld_dst, const uint16_t* s, int64_t ld_src) {
  __m256i lo[16], hi[16];
  transpose16x16(lo, s, ld_src);
  transpose16x16(hi, s + 16 * ld_src, ld_src);
  for (int j = 0; j < 16; ++j) {
    // (The maskz form with a full mask: GCC 12 warns falsely about the plain one, as in bf16.h.)
    const __m512i v = _mm512_maskz_inserti64x4(0xFF, _mm512_castsi256_si512(lo[j]), hi[j], 1);
    if constexpr (Stream) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + j * ld_dst), v);
    } else {
      _mm512_storeu_si512(d + j * ld_dst, v);
    }
  }
}
#endif

// One block [r0, r1) x [c0, c1): full 32 x 16 tiles in registers, the ragged edges scalar.
template <bool Stream>
void transpose_block(uint16_t* dst, int64_t ld_dst, const uint16_t* src, int64_t ld_src, int64_t r0,
                     int64_t r1, int64_t c0, int64_t c1) {
  int64_t rf = r0, cf = c0;  // ends of the part covered by full tiles
#if defined(__AVX512F__)
  rf = r0 + (r1 - r0) / 32 * 32;
  cf = c0 + (c1 - c0) / 16 * 16;
  for (int64_t r = r0; r < rf; r += 32) {
    for (int64_t c = c0; c < cf; c += 16) {
      transpose32x16<Stream>(dst + c * ld_dst + r, ld_dst, src + r * ld_src + c, ld_src);
    }
  }
#endif
  transpose_scalar(dst, ld_dst, src, ld_src, r0, rf, cf, c1);  // right edge
  transpose_scalar(dst, ld_dst, src, ld_src, rf, r1, c0, c1);  // bottom edge
}

template <bool Stream>
void transpose_all(uint16_t* dst, int64_t ld_dst, const uint16_t* src, int64_t ld_src, int64_t rows,
                   int64_t cols) {
  const int64_t col_blocks = (cols + kBlockCols - 1) / kBlockCols;
  const int64_t row_blocks = (rows + kBlockRows - 1) / kBlockRows;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < col_blocks * row_blocks; ++t) {
    const int64_t c0 = (t / row_blocks) * kBlockCols, r0 = (t % row_blocks) * kBlockRows;
    transpose_block<Stream>(dst, ld_dst, src, ld_src, r0, std::min(rows, r0 + kBlockRows), c0,
                            std::min(cols, c0 + kBlockCols));
  }
#if defined(__AVX512F__)
  if constexpr (Stream) _mm_sfence();
#endif
}

}  // namespace

void transpose_16bit(uint16_t* dst, int64_t ld_dst, const uint16_t* src, int64_t ld_src,
                     int64_t rows, int64_t cols) {
  HR_CHECK(rows >= 0 && cols >= 0);
  HR_CHECK_MSG(ld_src >= cols, "transpose: the source's row stride is shorter than its rows");
  HR_CHECK_MSG(ld_dst >= rows, "transpose: the destination's row stride is shorter than its rows");
  if (rows == 0 || cols == 0) return;
  HR_CHECK(dst != nullptr && src != nullptr);
  const bool aligned = reinterpret_cast<uintptr_t>(dst) % 64 == 0 && ld_dst % 32 == 0;
  if (aligned && rows * cols * 2 >= kStreamBytes) {
    transpose_all<true>(dst, ld_dst, src, ld_src, rows, cols);
  } else {
    transpose_all<false>(dst, ld_dst, src, ld_src, rows, cols);
  }
}

}  // namespace headroom::cpu
