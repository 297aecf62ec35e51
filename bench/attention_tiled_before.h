// The fp32 tiled attention kernels as they were before the per-head packing (session of issue 6:
// keys re-packed per tile by scalar transposes, values and the backward's q/dout/k read in place
// at row strides of 3C and C, dqkv zeroed first), kept only so that fused_kernels_bench can time
// them against the current ones in the same run. Not part of the library.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cpu/bf16.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/fused_kernels.h"
#include "core/check.h"

namespace headroom::cpu::before {
constexpr int kB = kAttentionBlock;

// ---- a register-blocked small GEMM ----------------------------------------------------------
// The build uses -std=c++20, under which GCC does not contract a*b+c into an FMA, so the inner
// product is written with intrinsics (and a scalar fallback for other targets).
#if defined(__AVX512F__)
constexpr int kW = 16;
using Vec = __m512;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vfma(float a, Vec b, Vec c) { return _mm512_fmadd_ps(_mm512_set1_ps(a), b, c); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kW = 8;
using Vec = __m256;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(float a, Vec b, Vec c) { return _mm256_fmadd_ps(_mm256_set1_ps(a), b, c); }
#else
constexpr int kW = 1;
using Vec = float;
inline Vec vload(const float* p) { return *p; }
inline void vstore(float* p, Vec v) { *p = v; }
inline Vec vzero() { return 0.0f; }
inline Vec vfma(float a, Vec b, Vec c) { return std::fma(a, b, c); }
#endif

constexpr int kRows = 4;  // rows of C per register tile
constexpr int kVecs = 4;  // vectors of C per row per register tile (4 x 4 = 16 accumulators)

// C[r, c] (+)= sum_k A[r*ars + k*acs] * B[k*ldb + c] for r < R, c < NV*kW. A is read by element
// (broadcast), so any strides work, transposed included; B and C rows are contiguous.
template <int R, int NV>
inline void tile(int K, const float* A, int64_t ars, int64_t acs, const float* B, int64_t ldb,
                 float* C, int64_t ldc, bool acc) {
  Vec c[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) c[r][v] = acc ? vload(C + r * ldc + v * kW) : vzero();
  }
  for (int k = 0; k < K; ++k) {
    Vec b[NV];
    for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * kW);
    for (int r = 0; r < R; ++r) {
      const float a = A[r * ars + k * acs];
      for (int v = 0; v < NV; ++v) c[r][v] = vfma(a, b[v], c[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) vstore(C + r * ldc + v * kW, c[r][v]);
  }
}

// The columns left over after whole vectors (HS not a multiple of the vector width).
template <int R>
inline void tile_tail(int K, int ncols, const float* A, int64_t ars, int64_t acs, const float* B,
                      int64_t ldb, float* C, int64_t ldc, bool acc) {
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < ncols; ++j) {
      float s = acc ? C[r * ldc + j] : 0.0f;
      for (int k = 0; k < K; ++k) s = std::fma(A[r * ars + k * acs], B[k * ldb + j], s);
      C[r * ldc + j] = s;
    }
  }
}

template <int R>
inline void row_group(int N, int K, const float* A, int64_t ars, int64_t acs, const float* B,
                      int64_t ldb, float* C, int64_t ldc, bool acc) {
  int c0 = 0;
  for (; c0 + kVecs * kW <= N; c0 += kVecs * kW) {
    tile<R, kVecs>(K, A, ars, acs, B + c0, ldb, C + c0, ldc, acc);
  }
  for (; c0 + kW <= N; c0 += kW) tile<R, 1>(K, A, ars, acs, B + c0, ldb, C + c0, ldc, acc);
  if (c0 < N) tile_tail<R>(K, N - c0, A, ars, acs, B + c0, ldb, C + c0, ldc, acc);
}

// C[M,N] = A[M,K] x B[K,N], or C += ... when acc. Single-threaded (called inside tasks). The sum
// over k runs in order for every element, so the result depends on the shapes only.
inline void small_gemm(int M, int N, int K, const float* A, int64_t ars, int64_t acs,
                       const float* B, int64_t ldb, float* C, int64_t ldc, bool acc) {
  int r0 = 0;
  for (; r0 + kRows <= M; r0 += kRows) {
    row_group<kRows>(N, K, A + r0 * ars, ars, acs, B, ldb, C + r0 * ldc, ldc, acc);
  }
  const float* a = A + r0 * ars;
  float* c = C + r0 * ldc;
  switch (M - r0) {
    case 3:
      row_group<3>(N, K, a, ars, acs, B, ldb, c, ldc, acc);
      break;
    case 2:
      row_group<2>(N, K, a, ars, acs, B, ldb, c, ldc, acc);
      break;
    case 1:
      row_group<1>(N, K, a, ars, acs, B, ldb, c, ldc, acc);
      break;
    default:
      break;
  }
}

// dst[d*kB + c] = src[c*ld + d] for c < n, d < HS; columns [n, kB) are zeroed, so a tile's
// padding keys give score 0 (always masked: only the last, diagonal, key block is partial).
inline void pack_transposed(float* dst, const float* src, int64_t ld, int n, int HS) {
  for (int d = 0; d < HS; ++d) {
    float* row = dst + int64_t{d} * kB;
    for (int c = 0; c < n; ++c) row[c] = src[c * ld + d];
    for (int c = n; c < kB; ++c) row[c] = 0.0f;
  }
}

inline int num_blocks(int T) { return (T + kB - 1) / kB; }

inline size_t forward_slot_floats(int HS) { return size_t{1} * HS * kB + kB * kB + kB; }
inline size_t backward_slot_floats(int HS) { return size_t{2} * HS * kB + 2 * kB * kB + kB; }

// Threads for `tasks` tasks with `slots` scratch slots: thread i uses slot i.
inline int workers_for(int slots) { return std::max(1, std::min(omp_get_max_threads(), slots)); }

// One query block of one (b, h): the online softmax over key blocks 0..ib.
//   q, k, v: the (b, h) rows of qkv (row stride C3); o: the block's output rows (stride C);
//   m: the block's lse entries, holding the running max until the end.
inline void forward_block(float* o, float* m, const float* q, const float* k, const float* v,
                          int64_t C3, int64_t C, int HS, int ib, int nq, float scale, float* slot) {
  float* kt = slot;                  // [HS, kB] keys of the current block, transposed
  float* s = kt + int64_t{HS} * kB;  // [kB, kB] scores, then probabilities
  float* l = s + kB * kB;            // [kB] running sums
  for (int jb = 0; jb <= ib; ++jb) {
    const bool diag = jb == ib;
    const int nk = diag ? nq : kB;
    const int64_t j0 = int64_t{jb} * kB;
    pack_transposed(kt, k + j0 * C3, C3, nk, HS);
    small_gemm(nq, kB, HS, q, C3, 1, kt, kB, s, kB, false);
    for (int r = 0; r < nq; ++r) {
      float* row = s + r * kB;
      const int ncols = diag ? r + 1 : kB;  // causal: key j0+c <= query i0+r
      float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
      for (int c = 0; c < ncols; ++c) {
        row[c] *= scale;
        mx = std::max(mx, row[c]);
      }
      const float m_new = jb == 0 ? mx : std::max(m[r], mx);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int c = 0; c < ncols; ++c) {
        const float p = fast_exp(row[c] - m_new);
        row[c] = p;
        sum += p;
      }
      for (int c = ncols; c < nk; ++c) row[c] = 0.0f;
      if (jb == 0) {
        l[r] = sum;
      } else if (m_new != m[r]) {  // rescale what the earlier key blocks accumulated
        const float alpha = std::exp(m[r] - m_new);
        l[r] = l[r] * alpha + sum;
        float* orow = o + r * C;
#pragma omp simd
        for (int d = 0; d < HS; ++d) orow[d] *= alpha;
      } else {
        l[r] += sum;
      }
      m[r] = m_new;
    }
    // o (+)= p x v; the first key block overwrites, so out needs no zeroing.
    small_gemm(nq, HS, nk, s, kB, 1, v + j0 * C3, C3, o, C, jb > 0);
  }
  for (int r = 0; r < nq; ++r) {
    const float inv = 1.0f / l[r];
    float* orow = o + r * C;
#pragma omp simd
    for (int d = 0; d < HS; ++d) orow[d] *= inv;
    m[r] = m[r] + std::log(l[r]);
  }
}

// One (b, h) of the backward, all tiles in a fixed order: query blocks outer, key blocks inner.
//   q, k, v: the (b, h) rows of qkv; dq, dk, dv: the same rows of dqkv (stride C3);
//   dy, y: dout and out rows (stride C); L: lse[b, h, :].
inline void backward_head(float* dq, float* dk, float* dv, const float* q, const float* k,
                          const float* v, const float* dy, const float* y, const float* L,
                          int64_t C3, int64_t C, int T, int HS, float scale, float* slot) {
  float* kt = slot;                   // [HS, kB]
  float* vt = kt + int64_t{HS} * kB;  // [HS, kB]
  float* p = vt + int64_t{HS} * kB;   // [kB, kB] probabilities
  float* ds = p + kB * kB;            // [kB, kB] dP, then dS
  float* D = ds + kB * kB;            // [kB] rowsum(dy * y)
  for (int t = 0; t < T; ++t) {
    std::fill(dq + t * C3, dq + t * C3 + HS, 0.0f);
    std::fill(dk + t * C3, dk + t * C3 + HS, 0.0f);
    std::fill(dv + t * C3, dv + t * C3 + HS, 0.0f);
  }
  const int nb = num_blocks(T);
  for (int ib = 0; ib < nb; ++ib) {
    const int64_t i0 = int64_t{ib} * kB;
    const int nq = std::min<int64_t>(kB, T - i0);
    const float* qi = q + i0 * C3;
    const float* dyi = dy + i0 * C;
    const float* Li = L + i0;
    for (int r = 0; r < nq; ++r) {
      const float* a = dyi + r * C;
      const float* b = y + (i0 + r) * C;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int d = 0; d < HS; ++d) sum += a[d] * b[d];
      D[r] = sum;
    }
    for (int jb = 0; jb <= ib; ++jb) {
      const bool diag = jb == ib;
      const int nk = diag ? nq : kB;
      const int64_t j0 = int64_t{jb} * kB;
      pack_transposed(kt, k + j0 * C3, C3, nk, HS);
      pack_transposed(vt, v + j0 * C3, C3, nk, HS);
      small_gemm(nq, kB, HS, qi, C3, 1, kt, kB, p, kB, false);   // scores
      small_gemm(nq, kB, HS, dyi, C, 1, vt, kB, ds, kB, false);  // dP = dy v^T
      for (int r = 0; r < nq; ++r) {
        float* prow = p + r * kB;
        float* drow = ds + r * kB;
        const int ncols = diag ? r + 1 : kB;
        const float lse = Li[r], Dr = D[r];
#pragma omp simd
        for (int c = 0; c < ncols; ++c) {
          const float pr = fast_exp(prow[c] * scale - lse);
          prow[c] = pr;
          drow[c] = pr * (drow[c] - Dr) * scale;  // dS, with the score's scale folded in
        }
        for (int c = ncols; c < nk; ++c) prow[c] = drow[c] = 0.0f;
      }
      small_gemm(nk, HS, nq, p, 1, kB, dyi, C, dv + j0 * C3, C3, true);            // dV += P^T dy
      small_gemm(nk, HS, nq, ds, 1, kB, qi, C3, dk + j0 * C3, C3, true);           // dK += dS^T q
      small_gemm(nq, HS, nk, ds, kB, 1, k + j0 * C3, C3, dq + i0 * C3, C3, true);  // dQ += dS k
    }
  }
}

inline void attention_tiled_forward(float* out, float* lse, const float* qkv, int B, int T, int C,
                                    int NH, float* scratch) {
  HR_CHECK(NH > 0 && C % NH == 0 && T >= 1);
  const int HS = C / NH;
  const int64_t C3 = int64_t{3} * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const int nb = num_blocks(T);
  const int BH = B * NH;
  const int tasks = BH * nb;
  const int slots = std::min(tasks, kAttentionMaxWorkers);
  const size_t slot_floats = forward_slot_floats(HS);
#pragma omp parallel num_threads(workers_for(slots))
  {
    float* slot = scratch + omp_get_thread_num() * slot_floats;
    // Largest query blocks (most key blocks) first, so the dynamic schedule ends balanced.
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < tasks; ++task) {
      const int ib = nb - 1 - task / BH;
      const int bh = task % BH;
      const int b = bh / NH, h = bh % NH;
      const int64_t i0 = int64_t{ib} * kB;
      const int nq = std::min<int64_t>(kB, T - i0);
      const float* base = qkv + int64_t{b} * T * C3 + int64_t{h} * HS;
      forward_block(out + (int64_t{b} * T + i0) * C + int64_t{h} * HS, lse + int64_t{bh} * T + i0,
                    base + i0 * C3, base + C, base + 2 * C, C3, C, HS, ib, nq, scale, slot);
    }
  }
}

inline void attention_tiled_backward(float* dqkv, const float* dout, const float* qkv,
                                     const float* out, const float* lse, int B, int T, int C,
                                     int NH, float* scratch) {
  HR_CHECK(NH > 0 && C % NH == 0 && T >= 1);
  const int HS = C / NH;
  const int64_t C3 = int64_t{3} * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const int BH = B * NH;
  const int slots = std::min(BH, kAttentionMaxWorkers);
  const size_t slot_floats = backward_slot_floats(HS);
#pragma omp parallel num_threads(workers_for(slots))
  {
    float* slot = scratch + omp_get_thread_num() * slot_floats;
#pragma omp for schedule(dynamic, 1)
    for (int bh = 0; bh < BH; ++bh) {
      const int b = bh / NH, h = bh % NH;
      const int64_t off3 = int64_t{b} * T * C3 + int64_t{h} * HS;
      const int64_t off1 = int64_t{b} * T * C + int64_t{h} * HS;
      const float* base = qkv + off3;
      float* dbase = dqkv + off3;
      backward_head(dbase, dbase + C, dbase + 2 * C, base, base + C, base + 2 * C, dout + off1,
                    out + off1, lse + int64_t{bh} * T, C3, C, T, HS, scale, slot);
    }
  }
}

// The scratch the kernels above need (fp32).
inline size_t attention_tiled_scratch_floats(int B, int T, int C, int NH) {
  const int64_t slots = std::min<int64_t>(int64_t{B} * NH * num_blocks(T), kAttentionMaxWorkers);
  return static_cast<size_t>(slots) * forward_slot_floats(C / NH);
}
inline size_t attention_tiled_backward_scratch_floats(int B, int T, int C, int NH) {
  const int64_t slots = std::min<int64_t>(int64_t{B} * NH, kAttentionMaxWorkers);
  return static_cast<size_t>(slots) * backward_slot_floats(C / NH);
}

// ---- the bf16 kernels (AMX and AVX512-BF16 tile products) as they were before issue 6's
// second part (transposes by gathers, ...); the library's kernel switch does not reach them:
// call attention_tiled_forward_dp<kAmx> directly, after the library has asked for AMX (any call
// with bf16 storage and AttentionBf16Kernel::kAuto/kAmx does).
inline int padded_head(int HS) { return (HS + 31) / 32 * 32; }

size_t forward_bf16_slot_floats(int T, int HS) {
  const size_t HSp = padded_head(HS), Tp = size_t{1} * num_blocks(T) * kB;
  // per head: k, then v, rows [Tp, HSp] bf16; k^T pairs [HSp/2, 64] and v pairs [32, HSp] per
  // block (u32); per query block: q [64, HSp] bf16, s [64, 64], p [64, 64] bf16, o [64, HSp],
  // l [64].
  return 3 * Tp * HSp / 2 + HSp * kB / 2 + kB * kB + kB * kB / 2 + HSp * kB + kB;
}

size_t backward_bf16_slot_floats(int T, int HS) {
  const size_t HSp = padded_head(HS), Tp = size_t{1} * num_blocks(T) * kB;
  // per head: q, dout rows [Tp, HSp] bf16; q^T, dout^T per block [HSp, 64] bf16; k^T and v^T
  // pairs [HSp/2, 64] and k pairs [32, HSp] per block (u32); dq [Tp, HSp], dk^T and dv^T
  // [HSp, Tp] fp32 (k and v rows staged there first); D [Tp]. Per tile: s, dp [64, 64] fp32
  // (then P and dS as pairs, in place); dS rows [64, 64] bf16.
  const size_t head = 2 * Tp * HSp / 2 + 2 * Tp * HSp / 2 + 3 * Tp * HSp / 2 + 3 * Tp * HSp + Tp;
  const size_t tile = 2 * kB * kB + kB * kB / 2;
  return head + tile;
}

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12 warns of its own intrinsics' undefined vectors (-Wmaybe-uninitialized) when they are
// inlined into functions with a target attribute: a false positive.
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define HR_BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

// C[r, 0:16*NV] (+)= sum_p A32[r*lda + p] . Bv[p*ldb + 0:16*NV] for r < R (A32: A as pairs).
template <int R, int NV>
HR_BF16_TARGET inline void dp_tile(int P, const uint32_t* A, int64_t lda, const uint32_t* B,
                                   int64_t ldb, float* C, int64_t ldc, bool acc) {
  __m512 c[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) {
      c[r][v] = acc ? _mm512_loadu_ps(C + r * ldc + v * 16) : _mm512_setzero_ps();
    }
  }
  for (int p = 0; p < P; ++p) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + p * ldb + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(A[r * lda + p]));
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + v * 16, c[r][v]);
  }
}

template <int R>
HR_BF16_TARGET inline void dp_rows(int N, int P, const uint32_t* A, int64_t lda, const uint32_t* B,
                                   int64_t ldb, float* C, int64_t ldc, bool acc) {
  int c0 = 0;
  for (; c0 + 64 <= N; c0 += 64) dp_tile<R, 4>(P, A, lda, B + c0, ldb, C + c0, ldc, acc);
  for (; c0 + 32 <= N; c0 += 32) dp_tile<R, 2>(P, A, lda, B + c0, ldb, C + c0, ldc, acc);
  for (; c0 < N; c0 += 16) dp_tile<R, 1>(P, A, lda, B + c0, ldb, C + c0, ldc, acc);
}

// C[M, N] (+)= A[M, 2P] x B[2P, N]: A bf16 rows of stride lda (elements, even), B pair-
// interleaved with row stride ldb (uint32), C fp32 of stride ldc. N a multiple of 16. Each
// element's sum runs over p in order: the result depends on the shapes only.
HR_BF16_TARGET void dp_gemm(int M, int N, int P, const bf16_t* A, int64_t lda, const uint32_t* B,
                            int64_t ldb, float* C, int64_t ldc, bool acc) {
  const auto* A32 = reinterpret_cast<const uint32_t*>(A);
  const int64_t lda32 = lda / 2;
  int r0 = 0;
  for (; r0 + 4 <= M; r0 += 4)
    dp_rows<4>(N, P, A32 + r0 * lda32, lda32, B, ldb, C + r0 * ldc, ldc, acc);
  const uint32_t* a = A32 + r0 * lda32;
  float* c = C + r0 * ldc;
  switch (M - r0) {
    case 3:
      dp_rows<3>(N, P, a, lda32, B, ldb, c, ldc, acc);
      break;
    case 2:
      dp_rows<2>(N, P, a, lda32, B, ldb, c, ldc, acc);
      break;
    case 1:
      dp_rows<1>(N, P, a, lda32, B, ldb, c, ldc, acc);
      break;
    default:
      break;
  }
}

// The same product on AMX: 16 x 16 fp32 tiles of C, 2 x 2 of them at a time (tmm0-3), A tiles of
// 16 rows x 32 bf16 (tmm4-5) and B tiles of 16 pairs x 16 columns (tmm6-7). M and N multiples of
// 16, P of 16. Needs amx_tile_config() loaded on the calling thread.
struct AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

HR_BF16_TARGET void amx_begin() {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}
HR_BF16_TARGET void amx_end() { _tile_release(); }

template <int MT, int NT>
HR_BF16_TARGET inline void amx_block(int P, const bf16_t* A, int64_t lda, const uint32_t* B,
                                     int64_t ldb, float* C, int64_t ldc, bool acc) {
  const int64_t sa = lda * 2, sb = ldb * 4, sc = ldc * 4;  // strides in bytes
  if (acc) {
    _tile_loadd(0, C, sc);
    if constexpr (NT == 2) _tile_loadd(1, C + 16, sc);
    if constexpr (MT == 2) _tile_loadd(2, C + 16 * ldc, sc);
    if constexpr (MT == 2 && NT == 2) _tile_loadd(3, C + 16 * ldc + 16, sc);
  } else {
    _tile_zero(0);
    if constexpr (NT == 2) _tile_zero(1);
    if constexpr (MT == 2) _tile_zero(2);
    if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  }
  for (int p = 0; p < P; p += 16) {
    _tile_loadd(4, A + 2 * p, sa);
    _tile_loadd(6, B + p * ldb, sb);
    if constexpr (NT == 2) _tile_loadd(7, B + p * ldb + 16, sb);
    if constexpr (MT == 2) _tile_loadd(5, A + 16 * lda + 2 * p, sa);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, C, sc);
  if constexpr (NT == 2) _tile_stored(1, C + 16, sc);
  if constexpr (MT == 2) _tile_stored(2, C + 16 * ldc, sc);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, C + 16 * ldc + 16, sc);
}

HR_BF16_TARGET void amx_gemm(int M, int N, int P, const bf16_t* A, int64_t lda, const uint32_t* B,
                             int64_t ldb, float* C, int64_t ldc, bool acc) {
  for (int m = 0; m < M; m += 32) {
    const bool m2 = m + 32 <= M;
    const bf16_t* a = A + int64_t{m} * lda;
    float* c = C + int64_t{m} * ldc;
    for (int n = 0; n < N; n += 32) {
      const bool n2 = n + 32 <= N;
      if (m2 && n2) {
        amx_block<2, 2>(P, a, lda, B + n, ldb, c + n, ldc, acc);
      } else if (m2) {
        amx_block<2, 1>(P, a, lda, B + n, ldb, c + n, ldc, acc);
      } else if (n2) {
        amx_block<1, 2>(P, a, lda, B + n, ldb, c + n, ldc, acc);
      } else {
        amx_block<1, 1>(P, a, lda, B + n, ldb, c + n, ldc, acc);
      }
    }
  }
}

// The product for kernel K: M is rounded up to 16 for AMX (the callers' A and C have those rows;
// the extra rows of C are never read).
template <bool kAmx>
HR_BF16_TARGET inline void mm(int M, int N, int P, const bf16_t* A, int64_t lda, const uint32_t* B,
                              int64_t ldb, float* C, int64_t ldc, bool acc) {
  if constexpr (kAmx) {
    amx_gemm((M + 15) / 16 * 16, N, P, A, lda, B, ldb, C, ldc, acc);
  } else {
    dp_gemm(M, N, P, A, lda, B, ldb, C, ldc, acc);
  }
}

// Two fp32 rows of 16 to one pair-interleaved vector: lane i = (bf16(x0[i]), bf16(x1[i])).
HR_BF16_TARGET inline __m512i interleave_bf16(__m512 x0, __m512 x1) {
  const __m512i lo = _mm512_maskz_cvtepu16_epi32(0xFFFF, cvt_ps_bf16(x0));
  const __m512i hi = _mm512_maskz_cvtepu16_epi32(0xFFFF, cvt_ps_bf16(x1));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// dst[r * HSp + d] = src[r * ld + d] for r < n, d < HS; zeros elsewhere in rows [0, rows).
HR_BF16_TARGET void copy_rows_padded(bf16_t* dst, int HSp, const bf16_t* src, int64_t ld, int n,
                                     int rows, int HS) {
  for (int r = 0; r < rows; ++r) {
    bf16_t* d = dst + int64_t{r} * HSp;
    const bf16_t* srow = src + r * ld;
    for (int c = 0; c < HSp; c += 32) {
      const int left = r < n ? std::clamp(HS - c, 0, 32) : 0;
      const __mmask32 mask = left == 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
      _mm512_storeu_si512(d + c, _mm512_maskz_loadu_epi16(mask, srow + c));
    }
  }
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows (a multiple of 16), c < cols: a
// transpose of 32-bit elements, 16 rows at a time by gathers.
HR_BF16_TARGET void transpose32(uint32_t* dst, int64_t ld_dst, const uint32_t* src, int64_t ld_src,
                                int rows, int cols) {
  const __m512i idx =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int>(ld_src)));
  for (int r = 0; r < rows; r += 16) {
    const uint32_t* s0 = src + int64_t{r} * ld_src;
    for (int c = 0; c < cols; ++c) {
      const __m512i v = _mm512_i32gather_epi32(idx, s0 + c, 4);
      _mm512_storeu_si512(dst + int64_t{c} * ld_dst + r, v);
    }
  }
}

// Keys (or values) of one 64-row block, rows [HSp], as the B of x k^T: kt[p*64 + n] = pair
// (k[n][2p], k[n][2p+1]), a transpose of 32-bit pairs.
HR_BF16_TARGET void pack_pairs_transposed(uint32_t* kt, const bf16_t* k, int HSp) {
  transpose32(kt, kB, reinterpret_cast<const uint32_t*>(k), HSp / 2, kB, HSp / 2);
}

// Mask of the columns c0 + [0, 16) that are < ncols.
inline __mmask16 cols_mask(int c0, int ncols) {
  const int n = std::clamp(ncols - c0, 0, 16);
  return static_cast<__mmask16>((1u << n) - 1u);
}

// Rows [2p, 2p+1] of a 64-row block (rows [HSp]) interleaved, as the B of x v: v2[p*HSp + d] =
// pair (v[2p][d], v[2p+1][d]).
HR_BF16_TARGET void pack_pairs(uint32_t* v2, const bf16_t* v, int HSp) {
  for (int p = 0; p < kB / 2; ++p) {
    const bf16_t* r0 = v + int64_t{2 * p} * HSp;
    const bf16_t* r1 = r0 + HSp;
    uint32_t* out = v2 + int64_t{p} * HSp;
    for (int d = 0; d < HSp; d += 16) {
      const __m512i lo = _mm512_maskz_cvtepu16_epi32(
          0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + d)));
      const __m512i hi = _mm512_maskz_cvtepu16_epi32(
          0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + d)));
      _mm512_storeu_si512(out + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// dst[d] = bf16(src[d] * mul) for d < n.
HR_BF16_TARGET inline void narrow_row(bf16_t* dst, const float* src, int n, float mul) {
  const __m512 vm = _mm512_set1_ps(mul);
  for (int d = 0; d < n; d += 16) {
    const __m256i v = cvt_ps_bf16(_mm512_mul_ps(_mm512_loadu_ps(src + d), vm));
    _mm256_mask_storeu_epi16(dst + d, cols_mask(d, n), v);
  }
}

// The key blocks 0..ib of one query block: online softmax, o accumulated in fp32, out written.
template <bool kAmx>
HR_BF16_TARGET void forward_tiles_bf16(bf16_t* out, float* m, const bf16_t* qs,
                                       const uint32_t* kt_all, const uint32_t* v2_all, int64_t C,
                                       int HS, int ib, int nq, float scale, float* s, bf16_t* pb,
                                       float* o, float* l) {
  const int HSp = padded_head(HS);
  for (int jb = 0; jb <= ib; ++jb) {
    const bool diag = jb == ib;
    const uint32_t* kt = kt_all + int64_t{jb} * kB * HSp / 2;
    const uint32_t* v2 = v2_all + int64_t{jb} * kB * HSp / 2;
    mm<kAmx>(nq, kB, HSp / 2, qs, HSp, kt, kB, s, kB, false);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int r = 0; r < nq; ++r) {
      float* row = s + r * kB;
      const int ncols = diag ? r + 1 : kB;
      __m512 x[kB / 16];
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      for (int c = 0; c < kB / 16; ++c) {
        x[c] = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * c), vscale);
        vmax = _mm512_mask_max_ps(vmax, cols_mask(16 * c, ncols), vmax, x[c]);
      }
      const float mx = _mm512_reduce_max_ps(vmax);
      const float m_new = jb == 0 ? mx : std::max(m[r], mx);
      // The row sum is of the fp32 probabilities; the product with v takes them rounded.
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps();
      bf16_t* prow = pb + r * kB;
      for (int c = 0; c < kB / 16; ++c) {
        const __m512 e =
            _mm512_maskz_mov_ps(cols_mask(16 * c, ncols), exp16(_mm512_sub_ps(x[c], vm)));
        vsum = _mm512_add_ps(vsum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + 16 * c), cvt_ps_bf16(e));
      }
      const float sum = _mm512_reduce_add_ps(vsum);
      if (jb == 0) {
        l[r] = sum;
      } else if (m_new != m[r]) {
        const float alpha = std::exp(m[r] - m_new);
        l[r] = l[r] * alpha + sum;
        float* orow = o + r * HSp;
        const __m512 va = _mm512_set1_ps(alpha);
        for (int d = 0; d < HSp; d += 16) {
          _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), va));
        }
      } else {
        l[r] += sum;
      }
      m[r] = m_new;
    }
    mm<kAmx>(nq, HSp, kB / 2, pb, kB, v2, HSp, o, HSp, jb > 0);
  }
  for (int r = 0; r < nq; ++r) {
    narrow_row(out + r * C, o + r * HSp, HS, 1.0f / l[r]);
    m[r] = m[r] + std::log(l[r]);
  }
}

// One (b, h) of the forward, bf16: forward_block's online softmax for each query block, the
// tile products in bf16. The head's keys and values are packed once for all its query blocks.
//   q, k, v: the (b, h) rows of qkv (row stride C3); out: its output rows (stride C);
//   lse: lse[b, h, :], holding the running max until the end.
template <bool kAmx>
HR_BF16_TARGET void forward_head_bf16(bf16_t* out, float* lse, const bf16_t* q, const bf16_t* k,
                                      const bf16_t* v, int64_t C3, int64_t C, int T, int HS,
                                      float scale, float* slot) {
  const int HSp = padded_head(HS), nb = num_blocks(T), Tp = nb * kB;
  const int64_t TH = int64_t{Tp} * HSp;
  auto* stage = reinterpret_cast<bf16_t*>(slot);               // [Tp, HSp]: k, then v
  auto* kt_all = reinterpret_cast<uint32_t*>(stage + TH);      // per block [HSp/2, 64]
  uint32_t* v2_all = kt_all + TH / 2;                          // per block [32, HSp]
  auto* qs = reinterpret_cast<bf16_t*>(v2_all + TH / 2);       // [64, HSp]
  auto* s = reinterpret_cast<float*>(qs + int64_t{kB} * HSp);  // [64, 64]
  auto* pb = reinterpret_cast<bf16_t*>(s + kB * kB);           // [64, 64]
  auto* o = reinterpret_cast<float*>(pb + kB * kB);            // [64, HSp]
  float* l = o + int64_t{kB} * HSp;                            // [64]
  copy_rows_padded(stage, HSp, k, C3, T, Tp, HS);
  for (int blk = 0; blk < nb; ++blk) {
    pack_pairs_transposed(kt_all + int64_t{blk} * kB * HSp / 2, stage + int64_t{blk} * kB * HSp,
                          HSp);
  }
  copy_rows_padded(stage, HSp, v, C3, T, Tp, HS);
  for (int blk = 0; blk < nb; ++blk) {
    pack_pairs(v2_all + int64_t{blk} * kB * HSp / 2, stage + int64_t{blk} * kB * HSp, HSp);
  }
  for (int ib = 0; ib < nb; ++ib) {
    const int64_t i0 = int64_t{ib} * kB;
    const int nq = std::min<int64_t>(kB, T - i0);
    float* m = lse + i0;
    copy_rows_padded(qs, HSp, q + i0 * C3, C3, nq, kB, HS);
    forward_tiles_bf16<kAmx>(out + i0 * C, m, qs, kt_all, v2_all, C, HS, ib, nq, scale, s, pb, o,
                             l);
  }
}

// One (b, h) of the backward, bf16: the fp32 backward_head's tiles in the same order, with
//   S = q k^T, dP = dout v^T (bf16 rows x pairs of k^T, v^T),
//   dV^T += dout^T P, dK^T += q^T dS (bf16 transposed rows x P, dS as pairs over queries),
//   dQ += dS k (dS rows x pairs of k),
// dK and dV accumulated transposed ([HSp, Tp]) so that no tile is transposed.
template <bool kAmx>
HR_BF16_TARGET void backward_head_bf16(bf16_t* dq, bf16_t* dk, bf16_t* dv, const bf16_t* q,
                                       const bf16_t* k, const bf16_t* v, const bf16_t* dy,
                                       const bf16_t* y, const float* L, int64_t C3, int64_t C,
                                       int T, int HS, float scale, float* slot) {
  const int HSp = padded_head(HS), nb = num_blocks(T), Tp = nb * kB;
  const int64_t TH = int64_t{Tp} * HSp;
  auto* qh = reinterpret_cast<bf16_t*>(slot);  // [Tp, HSp] each
  bf16_t* dyh = qh + TH;
  bf16_t* qT = dyh + TH;  // per block [HSp, 64]
  bf16_t* dyT = qT + TH;
  auto* kt = reinterpret_cast<uint32_t*>(dyT + TH);  // per block [HSp/2, 64]
  uint32_t* vt = kt + TH / 2;
  uint32_t* k2 = vt + TH / 2;                        // per block [32, HSp]
  auto* dQ = reinterpret_cast<float*>(k2 + TH / 2);  // [Tp, HSp]
  float* dKT = dQ + TH;                              // [HSp, Tp]
  float* dVT = dKT + TH;
  float* D = dVT + TH;  // [Tp]
  float* s = D + Tp;    // [64, 64]
  float* dp = s + kB * kB;
  auto* dsr = reinterpret_cast<bf16_t*>(dp + kB * kB);  // [64, 64]
  // P and dS as pairs of query rows ([32, 64] u32) overwrite s and dP in place: pair row r/2
  // lands on floats [32 r, 32 r + 64) of s, rows already read (row 0: the lanes just loaded).
  auto* p2 = reinterpret_cast<uint32_t*>(s);
  auto* ds2 = reinterpret_cast<uint32_t*>(dp);
  // k and v rows [Tp, HSp] bf16 staged in dK^T's place until the accumulators are zeroed.
  auto* kh = reinterpret_cast<bf16_t*>(dKT);
  bf16_t* vh = kh + TH;

  copy_rows_padded(qh, HSp, q, C3, T, Tp, HS);
  copy_rows_padded(kh, HSp, k, C3, T, Tp, HS);
  copy_rows_padded(vh, HSp, v, C3, T, Tp, HS);
  copy_rows_padded(dyh, HSp, dy, C, T, Tp, HS);
  for (int t = 0; t < Tp; ++t) {
    float sum = 0.0f;
    if (t < T) {
      const bf16_t* a = dy + t * C;
      const bf16_t* b = y + t * C;
#pragma omp simd reduction(+ : sum)
      for (int d = 0; d < HS; ++d) sum += to_f32(a[d]) * to_f32(b[d]);
    }
    D[t] = sum;
  }
  for (int blk = 0; blk < nb; ++blk) {
    const int64_t off = int64_t{blk} * kB * HSp;
    // q^T and dout^T as A operands summing over queries: pairs of query rows interleaved
    // (staged in dQ, not yet in use), transposed.
    auto* stage = reinterpret_cast<uint32_t*>(dQ);
    pack_pairs(stage, qh + off, HSp);
    transpose32(reinterpret_cast<uint32_t*>(qT + off), kB / 2, stage, HSp, kB / 2, HSp);
    pack_pairs(stage, dyh + off, HSp);
    transpose32(reinterpret_cast<uint32_t*>(dyT + off), kB / 2, stage, HSp, kB / 2, HSp);
    pack_pairs_transposed(kt + off / 2, kh + off, HSp);
    pack_pairs_transposed(vt + off / 2, vh + off, HSp);
    pack_pairs(k2 + off / 2, kh + off, HSp);
  }
  std::fill(dQ, dQ + 3 * TH, 0.0f);

  for (int ib = 0; ib < nb; ++ib) {
    const int64_t i0 = int64_t{ib} * kB;
    const int nq = std::min<int64_t>(kB, T - i0);
    const int64_t ioff = i0 * HSp;
    for (int jb = 0; jb <= ib; ++jb) {
      const bool diag = jb == ib;
      const int64_t j0 = int64_t{jb} * kB, joff = j0 * HSp;
      mm<kAmx>(nq, kB, HSp / 2, qh + ioff, HSp, kt + joff / 2, kB, s, kB, false);    // scores
      mm<kAmx>(nq, kB, HSp / 2, dyh + ioff, HSp, vt + joff / 2, kB, dp, kB, false);  // dP
      // P = exp(scale s - lse), dS = P (dP - D) scale, zero past the causal edge and the last
      // query; to bf16 as pairs of query rows (P, dS) and as rows (dS).
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int r = 0; r < kB; r += 2) {
        for (int c = 0; c < kB; c += 16) {
          __m512 pv[2], dv2[2];
          for (int h = 0; h < 2; ++h) {
            const int rr = r + h;
            const __mmask16 mask = rr >= nq ? 0 : diag ? cols_mask(c, rr + 1) : 0xFFFF;
            const float lse = rr < nq ? L[i0 + rr] : 0.0f, Dr = D[i0 + rr];
            const __m512 e = exp16(
                _mm512_fmsub_ps(_mm512_loadu_ps(s + rr * kB + c), vscale, _mm512_set1_ps(lse)));
            pv[h] = _mm512_maskz_mov_ps(mask, e);
            const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(dp + rr * kB + c), _mm512_set1_ps(Dr));
            dv2[h] = _mm512_maskz_mul_ps(mask, _mm512_mul_ps(pv[h], d), vscale);
          }
          _mm512_storeu_si512(p2 + (r / 2) * kB + c, interleave_bf16(pv[0], pv[1]));
          _mm512_storeu_si512(ds2 + (r / 2) * kB + c, interleave_bf16(dv2[0], dv2[1]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dsr + r * kB + c), cvt_ps_bf16(dv2[0]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dsr + (r + 1) * kB + c),
                              cvt_ps_bf16(dv2[1]));
        }
      }
      mm<kAmx>(HSp, kB, kB / 2, dyT + ioff, kB, p2, kB, dVT + j0, Tp, true);  // dV^T += dy^T P
      mm<kAmx>(HSp, kB, kB / 2, qT + ioff, kB, ds2, kB, dKT + j0, Tp, true);  // dK^T += q^T dS
      mm<kAmx>(nq, HSp, kB / 2, dsr, kB, k2 + joff / 2, HSp, dQ + ioff, HSp, true);  // dQ += dS k
    }
  }
  for (int t = 0; t < T; ++t) narrow_row(dq + t * C3, dQ + int64_t{t} * HSp, HS, 1.0f);
  // dK and dV back to rows through dQ's place.
  auto* rows = reinterpret_cast<uint32_t*>(dQ);
  transpose32(rows, HSp, reinterpret_cast<const uint32_t*>(dKT), Tp, HSp, Tp);
  for (int t = 0; t < T; ++t) narrow_row(dk + t * C3, dQ + int64_t{t} * HSp, HS, 1.0f);
  transpose32(rows, HSp, reinterpret_cast<const uint32_t*>(dVT), Tp, HSp, Tp);
  for (int t = 0; t < T; ++t) narrow_row(dv + t * C3, dQ + int64_t{t} * HSp, HS, 1.0f);
}
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // x86-64

#if defined(__x86_64__) && defined(__GNUC__)
// The bf16 kernels with AVX512-BF16 tile products: the same tasks, order and schedule as the
// fp32 kernels, so the results are bit-identical for any thread count.

// One (b, h) of the work: its indices (bh = b * NH + h), the head size, the softmax scale, and
// the running worker's slot of scratch.
struct HeadTask {
  int b, h, bh;
  int HS;
  float scale;
  float* slot;
};

// What the bf16 forward and backward share: the shape check, one slot of slot_floats(T, HS)
// floats per worker, the (b, h) pairs handed out one at a time (as the fp32 backward's), and on
// AMX the tile configuration loaded on each worker (it is per thread). head(task) runs one pair.
template <bool kAmx, typename Head>
void for_each_head_bf16(int B, int T, int C, int NH, size_t (*slot_floats)(int T, int HS),
                        float* scratch, const Head& head) {
  HR_CHECK(NH > 0 && C % NH == 0 && T >= 1);
  const int HS = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const int BH = B * NH;
  const int slots = std::min(BH, kAttentionMaxWorkers);
  const size_t slot_size = slot_floats(T, HS);
#pragma omp parallel num_threads(workers_for(slots))
  {
    float* slot = scratch + omp_get_thread_num() * slot_size;
    if constexpr (kAmx) amx_begin();
#pragma omp for schedule(dynamic, 1)
    for (int bh = 0; bh < BH; ++bh) head(HeadTask{bh / NH, bh % NH, bh, HS, scale, slot});
    if constexpr (kAmx) amx_end();
  }
}

template <bool kAmx>
void attention_tiled_forward_dp(bf16_t* out, float* lse, const bf16_t* qkv, int B, int T, int C,
                                int NH, float* scratch) {
  const int64_t C3 = int64_t{3} * C;
  for_each_head_bf16<kAmx>(B, T, C, NH, forward_bf16_slot_floats, scratch, [&](const HeadTask& t) {
    const bf16_t* base = qkv + int64_t{t.b} * T * C3 + int64_t{t.h} * t.HS;
    forward_head_bf16<kAmx>(out + int64_t{t.b} * T * C + int64_t{t.h} * t.HS,
                            lse + int64_t{t.bh} * T, base, base + C, base + 2 * C, C3, C, T, t.HS,
                            t.scale, t.slot);
  });
}

template <bool kAmx>
void attention_tiled_backward_dp(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv,
                                 const bf16_t* out, const float* lse, int B, int T, int C, int NH,
                                 float* scratch) {
  const int64_t C3 = int64_t{3} * C;
  for_each_head_bf16<kAmx>(B, T, C, NH, backward_bf16_slot_floats, scratch, [&](const HeadTask& t) {
    const int64_t off3 = int64_t{t.b} * T * C3 + int64_t{t.h} * t.HS;
    const int64_t off1 = int64_t{t.b} * T * C + int64_t{t.h} * t.HS;
    const bf16_t* base = qkv + off3;
    bf16_t* dbase = dqkv + off3;
    backward_head_bf16<kAmx>(dbase, dbase + C, dbase + 2 * C, base, base + C, base + 2 * C,
                             dout + off1, out + off1, lse + int64_t{t.bh} * T, C3, C, T, t.HS,
                             t.scale, t.slot);
  });
}
#endif

}  // namespace headroom::cpu::before
