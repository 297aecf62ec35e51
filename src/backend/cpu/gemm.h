// fp32 GEMM for the CPU kernels: one entry point over oneDNN matmul with a cache of primitives,
// so the hot path neither re-creates primitives nor allocates data-sized buffers.
#pragma once

#include <cstddef>

#include "core/dtype.h"

namespace headroom::cpu {

// C[M,N] = op(A)[M,K] x op(B)[K,N] (+ bias[N]), or C += ... when accumulate is true.
// All matrices are row-major with leading dimensions lda, ldb, ldc (in elements).
// op(A) = A (A is [M,K]) or, with trans_a, A^T (A is stored [K,M]); likewise for B.
// Thread safety: callable from any thread; concurrent calls are serialised (each call already
// uses every OpenMP thread). Calls made from inside an OpenMP parallel region run on one thread.
// The first call of a shape creates and caches a primitive (keyed by shape, strides, bias,
// accumulate and the OpenMP thread count); later calls only set data pointers and execute.
void gemm(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda, const float* B,
          int ldb, float* C, int ldc, const float* bias, bool accumulate);

// The same with element types per operand: A and B f32 or bf16 (both the same), C f32 or bf16;
// the bias is f32 and accumulation happens in f32 inside the primitive (C += is rounded once into
// C's type). bf16 x bf16 runs on AMX / AVX512-BF16 where the CPU has them: on our own AMX kernel
// (amx_gemm.h) with A not transposed and a K it takes, else on oneDNN's.
void gemm_ex(bool trans_a, bool trans_b, int M, int N, int K, DType ab_type, const void* A, int lda,
             const void* B, int ldb, DType c_type, void* C, int ldc, const float* bias,
             bool accumulate);

// The oneDNN implementation chosen for a shape (e.g. "brg:avx512_core"), for benchmarks and
// docs. Creates and caches the primitive if needed.
const char* gemm_impl_name(bool trans_a, bool trans_b, int M, int N, int K, int lda, int ldb,
                           int ldc, bool has_bias, bool accumulate, DType ab_type = DType::kF32,
                           DType c_type = DType::kF32);

// Bytes held by the one shared oneDNN scratchpad (user mode; sized to the largest cached
// primitive, grown only when a new primitive is created), and the number of cached primitives.
size_t gemm_scratchpad_bytes();
size_t gemm_cached_primitives();

}  // namespace headroom::cpu
