// The chunked LM head's GEMMs and dlogits storage, shared by the fused cross-entropy head
// (fused_head.cc) and the distillation head (distill_kernels.cc), so that the two compute a
// chunk's student logits with the same calls and the same bits. Internal to backend/cpu.
#pragma once

#include <cstdint>
#include <type_traits>

#include "backend/cpu/bf16.h"
#include "backend/cpu/gemm.h"
#include "backend/cpu/kernels.h"
#include "core/dtype.h"

namespace headroom::cpu::head_chunks {

// The row stride of a chunk's logits and dlogits (logits_row_stride); columns [V, ld) are unused.
inline int head_ld(int V) { return int(logits_row_stride(V)); }

// logits[n, V] (row stride ld) = x[n, C] x wte[V, C]^T (the kOutIn matmul_forward); fp32 logits.
inline void chunk_logits(float* logits, const float* x, const float* wte, int n, int C, int V,
                         int ld) {
  gemm(false, true, n, V, C, x, C, wte, C, logits, ld, nullptr, false);
}
inline void chunk_logits(float* logits, const bf16_t* x, const bf16_t* wte, int n, int C, int V,
                         int ld) {
  gemm_ex(false, true, n, V, C, DType::kBF16, x, C, wte, C, DType::kF32, logits, ld, nullptr,
          false);
}

inline void chunk_logits(float* logits, const f16_t* x, const float* wte, int n, int C, int V,
                         int ld) {
  gemm_f16(false, true, n, V, C, x, C, wte, C, logits, ld, nullptr, false);
}

// dx[n, C] = dlogits x wte; dwte += dlogits^T x x (the kOutIn matmul_backward).
inline void chunk_backward(float* dx, float* dwte, const float* dlogits, const float* x,
                           const float* wte, int n, int C, int V, int ld) {
  if (dx != nullptr) gemm(false, false, n, C, V, dlogits, ld, wte, C, dx, C, nullptr, false);
  if (dwte != nullptr) gemm(true, false, V, C, n, dlogits, ld, x, C, dwte, C, nullptr, true);
}
// bf16: dlogits in bf16, as autocast feeds the bf16 GEMMs; dwte accumulates in fp32.
inline void chunk_backward(bf16_t* dx, float* dwte, const bf16_t* dlogits, const bf16_t* x,
                           const bf16_t* wte, int n, int C, int V, int ld) {
  const DType bf = DType::kBF16;
  if (dx != nullptr) {
    gemm_ex(false, false, n, C, V, bf, dlogits, ld, wte, C, bf, dx, C, nullptr, false);
  }
  if (dwte != nullptr) {
    gemm_ex(true, false, V, C, n, bf, dlogits, ld, x, C, DType::kF32, dwte, C, nullptr, true);
  }
}

// f16: dlogits are fp32 holding f16 values (in place over the logits).
inline void chunk_backward(f16_t* dx, float* dwte, const float* dlogits, const f16_t* x,
                           const float* wte, int n, int C, int V, int ld) {
  if (dx != nullptr) gemm_f16(false, false, n, C, V, dlogits, ld, wte, C, dx, C, nullptr);
  if (dwte != nullptr) gemm_f16(true, false, V, C, n, dlogits, ld, x, C, dwte, C, nullptr, true);
}

// The storage of the chunk's dlogits for activations of type T: bf16 for bf16; fp32 otherwise
// (holding f16 values for f16).
template <typename T>
using DlogitsT = std::conditional_t<std::is_same_v<T, bf16_t>, bf16_t, float>;
template <typename T>
inline DlogitsT<T> to_dlogit(float x) {
  if constexpr (std::is_same_v<T, f16_t>) {
    return round_f16(x);
  } else {
    return from_f32<T>(x);
  }
}

// The columns a chunk's logits GEMM computes: all ld where wte holds ld rows (dense output rows,
// which oneDNN's AMX brgemm wants; the columns past V are never read), else V.
inline int chunk_cols(int V, int ld, int wte_rows) { return wte_rows >= ld ? ld : V; }

}  // namespace headroom::cpu::head_chunks
