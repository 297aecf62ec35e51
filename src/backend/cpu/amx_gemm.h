// bf16 x bf16 GEMM on AMX tiles, for the shapes of a transformer's step (docs/gemm.md, "Our own
// AMX GEMM"): oneDNN 2.6's AMX matmul reached 40-60% of the tile unit's rate here, and a plain
// blocked kernel of our own was 10-20% faster on GPT-2's shapes with cold operands.
#pragma once

#include <cstddef>

#include "core/dtype.h"

namespace headroom::cpu {

// AMX-BF16 in the CPU and the kernel's permission to use its tile data (Linux 5.16+ keeps it off
// until the process asks with arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), as oneDNN
// also does; asked once, and a refusal means no AMX).
bool amx_usable();
// AVX-512 F/BW/VL/DQ and AVX512-BF16 in the CPU.
bool cpu_has_avx512bf16();

// The tile configuration both AMX kernels use (this GEMM and tiled attention's): tiles 0-7 of 16
// rows x 64 bytes, loaded on the calling thread; amx_tiles_end releases the tile state. Only
// where amx_usable().
void amx_tiles_begin();
void amx_tiles_end();

// Whether amx_gemm takes a product with this K and C type: AMX usable, and with a bf16 C, K <= 4096
// (one pass over K, the sums kept in tiles; an fp32 C takes any K, in chunks). Any M, N and
// layout. The environment's HEADROOM_BF16_GEMM (read per call) chooses: "auto" (unset: amx where
// it applies) or "onednn" (never); anything else throws std::invalid_argument naming the
// variable.
bool amx_gemm_takes(int K, DType c_type);

// C[M,N] = op(A) op(B) (+ bias[N]), or C += ... when accumulate is true: the contract of gemm_ex
// for bf16 A and B (row-major, leading dimensions in elements), where amx_gemm_takes. B is packed
// into the tiles' pair-interleaved layout 1 MiB at a time (two buffers of the process); op(A)'s
// rows are read by the tile loads in place, or staged 32 at a time (A transposed, K not a
// multiple of 32, C's last rows) in a buffer per thread. The buffers are allocated at the first
// call and kept (amx_gemm_buffer_bytes). Each element of C sums its K products in the same order
// whatever the thread count (threads split C's rows), so the result depends on the shapes only.
// bf16 C is rounded once, to nearest even.
void amx_gemm(bool trans_a, bool trans_b, int M, int N, int K, const bf16_t* A, int lda,
              const bf16_t* B, int ldb, DType c_type, void* C, int ldc, const float* bias,
              bool accumulate);

// Bytes held by amx_gemm's packing buffers (0 before its first call).
size_t amx_gemm_buffer_bytes();

}  // namespace headroom::cpu
