// A transposing copy of 16-bit matrices (bf16, f16), so that the bf16 weight-gradient GEMMs can
// read both operands K-contiguous (docs/gemm.md, "Transposed operands for the bf16 weight
// gradients"): oneDNN's own reorder ran at about 5 GB/s there and cost more than it saved.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace headroom::cpu {

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols: dst is the [cols, rows]
// transpose of the [rows, cols] src. Elements are copied bit for bit (any 16-bit type).
// REQUIRES: rows, cols >= 0; ld_src >= cols; ld_dst >= rows; dst and src do not overlap.
// OpenMP-parallel over tiles (every element is written once, so the result does not depend on
// the thread count); AVX-512 16 x 16 tiles through registers where the CPU has them.
void transpose_16bit(uint16_t* dst, int64_t ld_dst, const uint16_t* src, int64_t ld_src,
                     int64_t rows, int64_t cols);
inline void transpose(bf16_t* dst, int64_t ld_dst, const bf16_t* src, int64_t ld_src, int64_t rows,
                      int64_t cols) {
  transpose_16bit(reinterpret_cast<uint16_t*>(dst), ld_dst, reinterpret_cast<const uint16_t*>(src),
                  ld_src, rows, cols);
}

}  // namespace headroom::cpu
