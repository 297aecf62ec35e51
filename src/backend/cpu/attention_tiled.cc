// Tiled causal attention (see fused_kernels.h): the forward keeps a running max and sum per query
// row (online softmax) over 64 x 64 tiles and saves only the row log-sum-exp; the backward
// recomputes each tile's probabilities from it (FlashAttention-2). See Note [Tiled attention] in
// docs/notes/fused-kernels.md.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "backend/cpu/amx_gemm.h"
#include "backend/cpu/bf16.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/fused_kernels.h"
#include "core/check.h"

// GCC 12 warns of its own intrinsics' undefined vectors (-Wmaybe-uninitialized) when they are
// inlined (_mm512_reduce_*_ps, and any intrinsic inlined into a function with a target
// attribute): a false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace headroom::cpu {
namespace {

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
  // The whole vectors left in one tile (one pass over K), then the scalar columns.
  switch ((N - c0) / kW) {
    case 3:
      tile<R, 3>(K, A, ars, acs, B + c0, ldb, C + c0, ldc, acc);
      break;
    case 2:
      tile<R, 2>(K, A, ars, acs, B + c0, ldb, C + c0, ldc, acc);
      break;
    case 1:
      tile<R, 1>(K, A, ars, acs, B + c0, ldb, C + c0, ldc, acc);
      break;
    default:
      break;
  }
  c0 += (N - c0) / kW * kW;
  if (c0 < N) tile_tail<R>(K, N - c0, A, ars, acs, B + c0, ldb, C + c0, ldc, acc);
}

// Products of a diagonal tile (query block == key block), where P and dS are 0 above the
// diagonal (key c > query r): each group of rows [r0, r0 + R) skips work that only adds those
// zeros, so the result is the same, bit for bit (a skipped fma(0, b, s) is s: b is finite).
//   kNone: the whole product;
//   kColsToRow: C = scores, columns c < r0 + R only (rounded up to whole vectors; the columns
//     past them are left unwritten: the caller masks them);
//   kKToRow: A = P or dS by query rows (k = key): k < r0 + R only;
//   kKFromRow: A = P^T or dS^T (C rows = keys, k = query): k >= r0 only.
enum class Causal { kNone, kColsToRow, kKToRow, kKFromRow };

template <int R>
inline void causal_row_group(Causal causal, int r0, int N, int K, const float* A, int64_t ars,
                             int64_t acs, const float* B, int64_t ldb, float* C, int64_t ldc,
                             bool acc) {
  switch (causal) {
    case Causal::kNone:
      row_group<R>(N, K, A, ars, acs, B, ldb, C, ldc, acc);
      break;
    case Causal::kColsToRow:
      row_group<R>(std::min(N, (r0 + R + kW - 1) / kW * kW), K, A, ars, acs, B, ldb, C, ldc, acc);
      break;
    case Causal::kKToRow:
      row_group<R>(N, std::min(K, r0 + R), A, ars, acs, B, ldb, C, ldc, acc);
      break;
    case Causal::kKFromRow: {
      const int k0 = std::min(K, r0);
      row_group<R>(N, K - k0, A + k0 * acs, ars, acs, B + k0 * ldb, ldb, C, ldc, acc);
      break;
    }
  }
}

// C[M,N] = A[M,K] x B[K,N], or C += ... when acc. Single-threaded (called inside tasks). The sum
// over k runs in order for every element, so the result depends on the shapes only.
void small_gemm(int M, int N, int K, const float* A, int64_t ars, int64_t acs, const float* B,
                int64_t ldb, float* C, int64_t ldc, bool acc, Causal causal = Causal::kNone) {
  int r0 = 0;
  for (; r0 + kRows <= M; r0 += kRows) {
    causal_row_group<kRows>(causal, r0, N, K, A + r0 * ars, ars, acs, B, ldb, C + r0 * ldc, ldc,
                            acc);
  }
  const float* a = A + r0 * ars;
  float* c = C + r0 * ldc;
  switch (M - r0) {
    case 3:
      causal_row_group<3>(causal, r0, N, K, a, ars, acs, B, ldb, c, ldc, acc);
      break;
    case 2:
      causal_row_group<2>(causal, r0, N, K, a, ars, acs, B, ldb, c, ldc, acc);
      break;
    case 1:
      causal_row_group<1>(causal, r0, N, K, a, ars, acs, B, ldb, c, ldc, acc);
      break;
    default:
      break;
  }
}

// dst[d*kB + c] = src[c*ld + d] for c < n, d < HS; columns [n, kB) are zeroed, so a tile's
// padding keys give score 0 (always masked: only the last, diagonal, key block is partial).
// 16 x 16 blocks transposed in registers (the loads masked at the head's and the block's edge).
void pack_transposed(float* dst, const float* src, int64_t ld, int n, int HS) {
#if defined(__AVX512F__)
  for (int c0 = 0; c0 < kB; c0 += 16) {
    for (int d0 = 0; d0 < HS; d0 += 16) {
      const int nd = std::min(16, HS - d0);
      const auto dmask = static_cast<__mmask16>(nd == 16 ? 0xFFFFu : (1u << nd) - 1u);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = c0 + i < n ? _mm512_maskz_loadu_ps(dmask, src + (c0 + i) * ld + d0)
                          : _mm512_setzero_ps();
      }
      transpose16x16(r);
      for (int i = 0; i < nd; ++i) _mm512_storeu_ps(dst + int64_t{d0 + i} * kB + c0, r[i]);
    }
  }
#else
  for (int d = 0; d < HS; ++d) {
    float* row = dst + int64_t{d} * kB;
    for (int c = 0; c < n; ++c) row[c] = src[c * ld + d];
    for (int c = n; c < kB; ++c) row[c] = 0.0f;
  }
#endif
}

// dst[r*HS + d] = src[r*ld + d] for r < n, d < HS: rows gathered to a contiguous block.
void pack_rows(float* dst, const float* src, int64_t ld, int n, int HS) {
  for (int r = 0; r < n; ++r) {
    float* d = dst + int64_t{r} * HS;
    const float* x = src + r * ld;
#if defined(__AVX512F__)  // (memcpy's call costs as much as a 64-float row)
    int c = 0;
    for (; c + 16 <= HS; c += 16) _mm512_storeu_ps(d + c, _mm512_loadu_ps(x + c));
    if (c < HS) {
      const auto m = static_cast<__mmask16>((1u << (HS - c)) - 1u);
      _mm512_mask_storeu_ps(d + c, m, _mm512_maskz_loadu_ps(m, x + c));
    }
#else
    std::memcpy(d, x, sizeof(float) * HS);
#endif
  }
}

inline int num_blocks(int T) { return (T + kB - 1) / kB; }

#if defined(__x86_64__)
// Mask of the columns c0 + [0, 16) that are < ncols.
inline __mmask16 cols_mask(int c0, int ncols) {
  const int n = std::clamp(ncols - c0, 0, 16);
  return static_cast<__mmask16>((1u << n) - 1u);
}
#endif

#if HR_AVX512_HELPERS
// A score row of kB floats in kB / 16 vectors times scale (x), and the max of its first ncols
// (the columns up to the causal edge): the first half of both forwards' online softmax.
HR_AVX512_TARGET inline float scaled_row_max(const float* row, __m512 vscale, int ncols,
                                             __m512 (&x)[kB / 16]) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int c = 0; c < kB / 16; ++c) {
    x[c] = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * c), vscale);
    vmax = _mm512_mask_max_ps(vmax, cols_mask(16 * c, ncols), vmax, x[c]);
  }
  return _mm512_reduce_max_ps(vmax);
}
#endif

// Slots (Note [Tiled attention]): per head, each key block packed once for all the query blocks
// that use it, keys transposed ([HS, kB] per block, contiguous, so a tile product's B operand
// is 16 KiB that stays in L1: the rows of qkv at their stride of 3C floats fall on few cache
// sets and evicted each other) and values (and the backward's keys) as rows [T, HS].
//   forward:  k^T blocks, v rows, s [kB, kB], l [kB];
//   backward: k^T and v^T blocks, k rows, q and dout rows of the query block, P and dS [kB, kB],
//             D [kB].
size_t forward_slot_floats(int T, int HS) {
  return size_t{2} * num_blocks(T) * kB * HS + kB * kB + kB;
}
size_t backward_slot_floats(int T, int HS) {
  return size_t{3} * num_blocks(T) * kB * HS + size_t{2} * kB * HS + 2 * kB * kB + kB;
}

// Threads for `tasks` tasks with `slots` scratch slots: thread i uses slot i.
inline int workers_for(int slots) { return std::max(1, std::min(omp_get_max_threads(), slots)); }

// One query block of one (b, h): the online softmax over key blocks 0..ib.
//   q: the block's query rows (stride ldq); kt, vr: the head's packed keys and values;
//   o: the block's output rows (stride ldo); m: the block's lse entries, holding the running
//   max until the end; s, l: [kB, kB] and [kB] of the slot.
void forward_block(float* o, float* m, const float* q, const float* kt, const float* vr,
                   int64_t ldq, int64_t ldo, int HS, int ib, int nq, float scale, float* s,
                   float* l) {
  for (int jb = 0; jb <= ib; ++jb) {
    const bool diag = jb == ib;
    const int nk = diag ? nq : kB;
    const int64_t j0 = int64_t{jb} * kB;
    const Causal cols = diag ? Causal::kColsToRow : Causal::kNone;
    small_gemm(nq, kB, HS, q, ldq, 1, kt + j0 * HS, kB, s, kB, false, cols);
    for (int r = 0; r < nq; ++r) {
      float* row = s + r * kB;
      const int ncols = diag ? r + 1 : kB;  // causal: key j0+c <= query i0+r
#if HR_AVX512_KERNELS
      // The row in four vectors: scale and max, then exp and sum, columns past the causal edge
      // (and the padding past nk) stored as 0.
      const __m512 vscale = _mm512_set1_ps(scale);
      __m512 x[kB / 16];
      const float mx = scaled_row_max(row, vscale, ncols, x);
      const float m_new = jb == 0 ? mx : std::max(m[r], mx);
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps();
      for (int c = 0; c < kB / 16; ++c) {
        const __m512 e =
            _mm512_maskz_mov_ps(cols_mask(16 * c, ncols), exp16(_mm512_sub_ps(x[c], vm)));
        vsum = _mm512_add_ps(vsum, e);
        _mm512_storeu_ps(row + 16 * c, e);
      }
      const float sum = _mm512_reduce_add_ps(vsum);
#else
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
#endif
      if (jb == 0) {
        l[r] = sum;
      } else if (m_new != m[r]) {  // rescale what the earlier key blocks accumulated
        const float alpha = std::exp(m[r] - m_new);
        l[r] = l[r] * alpha + sum;
        float* orow = o + r * ldo;
#pragma omp simd
        for (int d = 0; d < HS; ++d) orow[d] *= alpha;
      } else {
        l[r] += sum;
      }
      m[r] = m_new;
    }
    // o (+)= p x v; the first key block overwrites, so out needs no zeroing.
    small_gemm(nq, HS, nk, s, kB, 1, vr + j0 * HS, HS, o, ldo, jb > 0,
               diag ? Causal::kKToRow : Causal::kNone);
  }
  for (int r = 0; r < nq; ++r) {
    const float inv = 1.0f / l[r];
    float* orow = o + r * ldo;
#pragma omp simd
    for (int d = 0; d < HS; ++d) orow[d] *= inv;
    m[r] = m[r] + std::log(l[r]);
  }
}

// One (b, h) of the forward: its keys and values packed once, then each query block.
//   q, k, v: the head's rows (stride ld); o: its output rows (stride ldo); L: lse[b, h, :].
void forward_head(float* o, float* L, const float* q, const float* k, const float* v, int64_t ld,
                  int64_t ldo, int T, int HS, float scale, float* slot) {
  const int nb = num_blocks(T);
  const int64_t TH = int64_t{nb} * kB * HS;
  float* kt = slot;        // per key block [HS, kB]
  float* vr = kt + TH;     // [T, HS]
  float* s = vr + TH;      // [kB, kB] scores, then probabilities
  float* l = s + kB * kB;  // [kB] running sums
  for (int blk = 0; blk < nb; ++blk) {
    const int64_t j0 = int64_t{blk} * kB;
    const int n = std::min<int64_t>(kB, T - j0);
    pack_transposed(kt + j0 * HS, k + j0 * ld, ld, n, HS);
    pack_rows(vr + j0 * HS, v + j0 * ld, ld, n, HS);
  }
  for (int ib = 0; ib < nb; ++ib) {
    const int64_t i0 = int64_t{ib} * kB;
    const int nq = std::min<int64_t>(kB, T - i0);
    forward_block(o + i0 * ldo, L + i0, q + i0 * ld, kt, vr, ld, ldo, HS, ib, nq, scale, s, l);
  }
}

// The backward's per-(b, kv head) packing: each key block of the kv head's keys and values
// transposed ([HS, kB] per block) and its keys as rows [T, HS], once for all the query heads of
// its group (grouped-query attention; one query head with NKV == NH).
//   k, v: the kv head's rows (stride ld).
void backward_pack_kv(const float* k, const float* v, int64_t ld, int T, int HS, float* slot) {
  const int nb = num_blocks(T);
  const int64_t TH = int64_t{nb} * kB * HS;
  float* kt = slot;     // per key block [HS, kB]
  float* vt = kt + TH;  // per key block [HS, kB]
  float* kr = vt + TH;  // [T, HS]
  for (int blk = 0; blk < nb; ++blk) {
    const int64_t j0 = int64_t{blk} * kB;
    const int n = std::min<int64_t>(kB, T - j0);
    pack_transposed(kt + j0 * HS, k + j0 * ld, ld, n, HS);
    pack_transposed(vt + j0 * HS, v + j0 * ld, ld, n, HS);
    pack_rows(kr + j0 * HS, k + j0 * ld, ld, n, HS);
  }
}

// One query head of the backward, all tiles in a fixed order: query blocks outer, key blocks
// inner, on the kv head packed by backward_pack_kv.
//   q: the query head's rows, dq: the same rows of dqkv, dk, dv: its kv head's rows of dqkv (all
//   stride ld3). dQ's block is overwritten by its first product (key block 0); dK's and dV's
//   blocks by theirs (the diagonal tile, the first query block that sees them) unless acc_kv,
//   when every product adds to them (the group's later query heads: dk and dv are summed over
//   the group in fp32, in query-head order), so they need no zeroing;
//   dy, y: dout and out rows (stride ld1); L: lse[b, h, :].
void backward_query_head(float* dq, float* dk, float* dv, const float* q, const float* dy,
                         const float* y, const float* L, int64_t ld3, int64_t ld1, int T, int HS,
                         float scale, bool acc_kv, float* slot) {
  const int nb = num_blocks(T);
  const int64_t TH = int64_t{nb} * kB * HS;
  const float* kt = slot;              // per key block [HS, kB]
  const float* vt = kt + TH;           // per key block [HS, kB]
  const float* kr = vt + TH;           // [T, HS]
  float* qb = slot + 3 * TH;           // [kB, HS] the query block's q rows
  float* dyb = qb + int64_t{kB} * HS;  // [kB, HS] and dout rows
  float* p = dyb + int64_t{kB} * HS;   // [kB, kB] probabilities
  float* ds = p + kB * kB;             // [kB, kB] dP, then dS
  float* D = ds + kB * kB;             // [kB] rowsum(dy * y)
  for (int ib = 0; ib < nb; ++ib) {
    const int64_t i0 = int64_t{ib} * kB;
    const int nq = std::min<int64_t>(kB, T - i0);
    const float* Li = L + i0;
    pack_rows(qb, q + i0 * ld3, ld3, nq, HS);
    pack_rows(dyb, dy + i0 * ld1, ld1, nq, HS);
    for (int r = 0; r < nq; ++r) {
      const float* a = dyb + r * HS;
      const float* b = y + (i0 + r) * ld1;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int d = 0; d < HS; ++d) sum += a[d] * b[d];
      D[r] = sum;
    }
    for (int jb = 0; jb <= ib; ++jb) {
      const bool diag = jb == ib;
      const int nk = diag ? nq : kB;
      const int64_t j0 = int64_t{jb} * kB;
      const Causal cols = diag ? Causal::kColsToRow : Causal::kNone;
      const Causal k_to = diag ? Causal::kKToRow : Causal::kNone;
      const Causal k_from = diag ? Causal::kKFromRow : Causal::kNone;
      small_gemm(nq, kB, HS, qb, HS, 1, kt + j0 * HS, kB, p, kB, false, cols);    // scores
      small_gemm(nq, kB, HS, dyb, HS, 1, vt + j0 * HS, kB, ds, kB, false, cols);  // dP = dy v^T
      // P = exp(scale s - lse), dS = P (dP - D) scale (the score's scale folded in), 0 past the
      // causal edge and the padding past nk.
      for (int r = 0; r < nq; ++r) {
        float* prow = p + r * kB;
        float* drow = ds + r * kB;
        const int ncols = diag ? r + 1 : kB;
        const float lse = Li[r], Dr = D[r];
#if HR_AVX512_KERNELS
        const __m512 vscale = _mm512_set1_ps(scale), vlse = _mm512_set1_ps(lse),
                     vD = _mm512_set1_ps(Dr);
        for (int c = 0; c < kB; c += 16) {
          const __mmask16 mask = cols_mask(c, ncols);
          const __m512 pr = _mm512_maskz_mov_ps(
              mask, exp16(_mm512_fmsub_ps(_mm512_loadu_ps(prow + c), vscale, vlse)));
          const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(drow + c), vD);
          _mm512_storeu_ps(prow + c, pr);
          // (masked: on a diagonal tile the columns past the row's vectors were not computed)
          _mm512_storeu_ps(drow + c, _mm512_maskz_mul_ps(mask, _mm512_mul_ps(pr, d), vscale));
        }
#else
#pragma omp simd
        for (int c = 0; c < ncols; ++c) {
          const float pr = fast_exp(prow[c] * scale - lse);
          prow[c] = pr;
          drow[c] = pr * (drow[c] - Dr) * scale;
        }
        for (int c = ncols; c < nk; ++c) prow[c] = drow[c] = 0.0f;
#endif
      }
      const bool acc = acc_kv || !diag;
      small_gemm(nk, HS, nq, p, 1, kB, dyb, HS, dv + j0 * ld3, ld3, acc, k_from);  // dV += P^T dy
      small_gemm(nk, HS, nq, ds, 1, kB, qb, HS, dk + j0 * ld3, ld3, acc, k_from);  // dK += dS^T q
      small_gemm(nq, HS, nk, ds, kB, 1, kr + j0 * HS, HS, dq + i0 * ld3, ld3, jb > 0,
                 k_to);  // dQ += dS k
    }
  }
}

// bf16 storage: each task first widens the rows it reads into fp32 copies in its slot, runs the
// fp32 code above on them, and rounds its output once. The copies hold `rows` rows of one head.
size_t forward_widen_floats(int T, int HS) { return size_t{1} * T * 4 * HS; }
size_t backward_widen_floats(int T, int HS) { return size_t{1} * T * 8 * HS; }

// dst[r*ld_dst + c] = src[r*ld_src + c] as float, for r < rows, c < cols.
template <typename T>
void widen(float* dst, int64_t ld_dst, const T* src, int64_t ld_src, int64_t rows, int cols) {
  for (int64_t r = 0; r < rows; ++r) {
    float* d = dst + r * ld_dst;
    const T* s = src + r * ld_src;
#pragma omp simd
    for (int c = 0; c < cols; ++c) d[c] = to_f32(s[c]);
  }
}
template <typename T>
void narrow(T* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int cols) {
  for (int64_t r = 0; r < rows; ++r) {
    T* d = dst + r * ld_dst;
    const float* s = src + r * ld_src;
#pragma omp simd
    for (int c = 0; c < cols; ++c) d[c] = from_f32<T>(s[c]);
  }
}

// ---- bf16 tile products on AVX512-BF16 ---------------------------------------------------------
// With bf16 storage on a CPU with AVX512-BF16, the tile products take bf16 operands and
// accumulate in fp32 (vdpbf16ps: two products and a sum per lane, twice the fp32 FMA rate), as
// FlashAttention does in bf16: q, k, v and dout are bf16 already; P and dS are rounded to bf16
// before their products; scores, the softmax, and every accumulator stay fp32.
//
// Operand layouts. A: bf16 rows with the summed index contiguous, read two at a time as one
// 32-bit pair (broadcast). B: "pair-interleaved", Bv[p][n] = (B[2p][n], B[2p+1][n]) as one
// uint32, so one 512-bit load holds 16 columns x 2 k. Head sizes are padded to HSp, a multiple
// of 32, and blocks to 64 rows, with zeros, so every product is whole vectors and whole pairs.
//
// The kernel asked for: HEADROOM_BF16_ATTENTION (auto, amx, avx512bf16 or widen; read once, for
// measuring one against another in whole training steps), then set_attention_bf16_kernel.
AttentionBf16Kernel kernel_from_env() {
  const char* v = std::getenv("HEADROOM_BF16_ATTENTION");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return AttentionBf16Kernel::kAuto;
  if (std::strcmp(v, "amx") == 0) return AttentionBf16Kernel::kAmx;
  if (std::strcmp(v, "avx512bf16") == 0) return AttentionBf16Kernel::kAvx512Bf16;
  if (std::strcmp(v, "widen") == 0) return AttentionBf16Kernel::kWidenFp32;
  throw std::invalid_argument(std::string("HEADROOM_BF16_ATTENTION=") + v +
                              ": expected auto, amx, avx512bf16 or widen");
}
std::atomic<int> g_bf16_kernel{-1};  // -1: not yet read from the environment

// The kernel that bf16 storage runs now: the one asked for, or the next one down that the CPU
// has (AMX, then AVX512-BF16, then the fp32 kernels on widened copies).
AttentionBf16Kernel resolved_kernel() {
  int k = g_bf16_kernel.load(std::memory_order_relaxed);
  if (k < 0) {
    const int from_env = static_cast<int>(kernel_from_env());
    g_bf16_kernel.compare_exchange_strong(k, from_env, std::memory_order_relaxed);
    k = g_bf16_kernel.load(std::memory_order_relaxed);
  }
  const auto asked = static_cast<AttentionBf16Kernel>(k);
  if ((asked == AttentionBf16Kernel::kAuto || asked == AttentionBf16Kernel::kAmx) && amx_usable()) {
    return AttentionBf16Kernel::kAmx;
  }
  if (asked != AttentionBf16Kernel::kWidenFp32 && cpu_has_avx512bf16()) {
    return AttentionBf16Kernel::kAvx512Bf16;
  }
  return AttentionBf16Kernel::kWidenFp32;
}

inline int padded_head(int HS) { return (HS + 31) / 32 * 32; }

size_t forward_bf16_slot_floats(int T, int HS) {
  const size_t HSp = padded_head(HS), Tp = size_t{1} * num_blocks(T) * kB;
  // per head: q rows [Tp, HSp] bf16; k^T pairs [HSp/2, 64] and v pairs [32, HSp] per block
  // (u32); per query block: s [64, 64], p [64, 64] bf16, o [64, HSp], l [64].
  return 3 * Tp * HSp / 2 + kB * kB + kB * kB / 2 + HSp * kB + kB;
}

size_t backward_bf16_slot_floats(int T, int HS) {
  const size_t HSp = padded_head(HS), Tp = size_t{1} * num_blocks(T) * kB;
  // per head: k, v rows [Tp, HSp] bf16; q^T and dout^T pairs [HSp/2, 64] and q, dout, k pairs
  // [32, HSp] per block (u32); dq, dk, dv [Tp, HSp] fp32 (q and dout rows staged in dk first);
  // D [Tp]. Per tile: s, dp [64, 64] fp32 (then P^T rows and dS^T pairs in place); dS^T rows,
  // then dS rows, [64, 64] bf16.
  const size_t head = 2 * Tp * HSp / 2 + 2 * Tp * HSp / 2 + 3 * Tp * HSp / 2 + 3 * Tp * HSp + Tp;
  const size_t tile = 2 * kB * kB + kB * kB / 2;
  return head + tile;
}

#if defined(__x86_64__) && defined(__GNUC__)
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
// 16, P of 16. Needs amx_tiles_begin() (amx_gemm.h) on the calling thread.

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

// A diagonal tile's 32 x 32 blocks (tile rows and columns both start at the block's first
// query = first key) that AMX skips, where the causal mask makes them never read or all zeros:
//   kSkipUpper: C blocks above the diagonal (S, rows = queries: keys past every query), left
//     unwritten (the softmax never reads them);
//   kSkipLower: C blocks below it (S^T, dP^T, rows = keys), left unwritten likewise;
//   kKToRow: A = P or dS by query rows, K = keys: block row m sums keys < m + 32 only;
//   kKFromRow: A = P^T or dS^T by key rows, K = queries: block row m sums queries >= m only.
// The last two skip products of exact zeros (P and dS are stored 0 past the causal edge): c + 0
// is c, so the sums are those of the whole product (Note [Tiled attention]).
enum class DiagSkip { kNone, kSkipUpper, kSkipLower, kKToRow, kKFromRow };

HR_BF16_TARGET void amx_gemm(int M, int N, int P, const bf16_t* A, int64_t lda, const uint32_t* B,
                             int64_t ldb, float* C, int64_t ldc, bool acc, DiagSkip skip) {
  for (int m = 0; m < M; m += 32) {
    const bool m2 = m + 32 <= M;
    // The pairs [p0, p1) this block row sums (AMX steps of 16 pairs = 32 rows of K).
    int p0 = 0, p1 = P;
    if (skip == DiagSkip::kKToRow) p1 = std::min(P, m / 2 + 16);
    if (skip == DiagSkip::kKFromRow) p0 = std::min(P, m / 2);
    const bf16_t* a = A + int64_t{m} * lda + 2 * p0;
    const uint32_t* b = B + int64_t{p0} * ldb;
    float* c = C + int64_t{m} * ldc;
    for (int n = 0; n < N; n += 32) {
      if ((skip == DiagSkip::kSkipUpper && n > m) || (skip == DiagSkip::kSkipLower && m > n)) {
        continue;
      }
      const bool n2 = n + 32 <= N;
      if (m2 && n2) {
        amx_block<2, 2>(p1 - p0, a, lda, b + n, ldb, c + n, ldc, acc);
      } else if (m2) {
        amx_block<2, 1>(p1 - p0, a, lda, b + n, ldb, c + n, ldc, acc);
      } else if (n2) {
        amx_block<1, 2>(p1 - p0, a, lda, b + n, ldb, c + n, ldc, acc);
      } else {
        amx_block<1, 1>(p1 - p0, a, lda, b + n, ldb, c + n, ldc, acc);
      }
    }
  }
}

// The product for kernel K: M is rounded up to 16 for AMX (the callers' A and C have those rows;
// the extra rows of C are never read). skip: what a diagonal tile may leave out (AMX only; the
// AVX512-BF16 products are whole).
template <bool kAmx>
HR_BF16_TARGET inline void mm(int M, int N, int P, const bf16_t* A, int64_t lda, const uint32_t* B,
                              int64_t ldb, float* C, int64_t ldc, bool acc,
                              DiagSkip skip = DiagSkip::kNone) {
  if constexpr (kAmx) {
    amx_gemm((M + 15) / 16 * 16, N, P, A, lda, B, ldb, C, ldc, acc, skip);
  } else {
    dp_gemm(M, N, P, A, lda, B, ldb, C, ldc, acc);
  }
}

// Two fp32 vectors to 32 bf16: lo's 16 in the lower half, hi's in the upper (vcvtne2ps2bf16: the
// bits of cvt_ps_bf16 on each, whose integer form it takes when a lane is denormal).
HR_BF16_TARGET inline __m512i cvt2_ps_bf16(__m512 lo, __m512 hi) {
  if (__builtin_expect((_mm512_fpclass_ps_mask(lo, 0x20) | _mm512_fpclass_ps_mask(hi, 0x20)) == 0,
                       1)) {
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  }
  return _mm512_inserti64x4(_mm512_castsi256_si512(cvt_ps_bf16(lo)), cvt_ps_bf16(hi), 1);
}

// [a_0..a_15 | b_0..b_15] (16-bit) to the pairs (a_i, b_i) in 32-bit lane i.
HR_BF16_TARGET inline __m512i pairs_of_halves(__m512i v) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, v);
}

// ---- ingest: a head's rows read straight from the strided qkv / dout / out rows --------------
// Each head's row is 2*HS bytes of a 2*3C-byte qkv row (a new page every row or so). The kernels
// read a head's streams 16 rows at a time, all of them together (q, k, v; and dout, out in the
// backward), and pack them for the tile products from registers: no row copies staged in the
// slot first. Touching each row's streams in one pass (and asking for the rows 32 ahead) costs
// about a third of reading them in separate passes over the head (Note [Tiled attention], the
// issue 6 section of 2026-12-01 morning).

// 32 bf16 of the row at src from column c: zeros past HS, and everywhere if !valid (a row past
// T: nothing is read).
HR_BF16_TARGET inline __m512i load_row32(const bf16_t* src, int c, bool valid, int HS) {
  const int left = valid ? std::clamp(HS - c, 0, 32) : 0;
  const __mmask32 mask = left == 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
  return _mm512_maskz_loadu_epi16(mask, src + c);
}

// x[i] = load_row32 of row t0 + i (row stride ld) for i < 16.
HR_BF16_TARGET inline void load_rows16(__m512i (&x)[16], const bf16_t* src, int64_t ld, int t0,
                                       int T, int c, int HS) {
  for (int i = 0; i < 16; ++i) x[i] = load_row32(src + (t0 + i) * ld, c, t0 + i < T, HS);
}

// Asks for the 2*HS bytes of rows [t0, t0 + 16) (those < T) of a stream into L1.
HR_BF16_TARGET inline void prefetch_rows16(const bf16_t* src, int64_t ld, int t0, int T, int HS) {
  const int t1 = std::min(t0 + 16, T);
  for (int t = t0; t < t1; ++t) {
    const char* row = reinterpret_cast<const char*>(src + t * ld);
    for (int b = 0; b < 2 * HS; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

// Rows ahead of the ingest asked for (about a page a row: the hardware prefetchers do not cross).
constexpr int kIngestAhead = 32;

// Asks for the 2*HS bytes of rows [0, n) (stride ld) for writing (their lines owned before the
// stores that fill them reach them: each is a cache miss otherwise, paid when the stores drain).
HR_BF16_TARGET inline void prefetch_rows_for_write(const bf16_t* dst, int64_t ld, int n, int HS) {
  for (int t = 0; t < n; ++t) {
    const char* row = reinterpret_cast<const char*>(dst + t * ld);
    for (int b = 0; b < 2 * HS; b += 64) __builtin_prefetch(row + b, 1, 3);
  }
}

// Rows x (16 rows, pairs [c/2, c/2 + 16)) as columns n0 + [0, 16) of a block's pairs transposed,
// the B of x k^T: dst[p * kB + n] = (row n's bf16 2p, 2p + 1). Transposes x in place.
HR_BF16_TARGET inline void store_pairs_transposed(uint32_t* dst, int n0, int c, __m512i (&x)[16]) {
  __m512 f[16];
  for (int i = 0; i < 16; ++i) f[i] = _mm512_castsi512_ps(x[i]);
  transpose16x16(f);
  for (int j = 0; j < 16; ++j) {
    _mm512_storeu_si512(dst + int64_t{c / 2 + j} * kB + n0, _mm512_castps_si512(f[j]));
  }
}

// Rows x (16 rows t0.., bf16 [c, c + 32)) as 8 pairs of rows, the B of x v: dst[p * HSp + d] =
// (row 2p's bf16 d, row 2p + 1's), p = p0 + [0, 8).
HR_BF16_TARGET inline void store_row_pairs(uint32_t* dst, int p0, int HSp, int c,
                                           const __m512i (&x)[16]) {
  for (int i = 0; i < 8; ++i) {
    uint32_t* out = dst + int64_t{p0 + i} * HSp + c;
    for (int h = 0; h < 2; ++h) {
      const __m256i r0 =
          h == 0 ? _mm512_castsi512_si256(x[2 * i]) : _mm512_extracti64x4_epi64(x[2 * i], 1);
      const __m256i r1 = h == 0 ? _mm512_castsi512_si256(x[2 * i + 1])
                                : _mm512_extracti64x4_epi64(x[2 * i + 1], 1);
      const __m512i lo = _mm512_maskz_cvtepu16_epi32(0xFFFF, r0);
      const __m512i hi = _mm512_maskz_cvtepu16_epi32(0xFFFF, r1);
      _mm512_storeu_si512(out + 16 * h, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// Rows x as rows: dst[i * HSp + c + [0, 32)] = x[i].
HR_BF16_TARGET inline void store_rows(bf16_t* dst, int HSp, int c, const __m512i (&x)[16]) {
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + int64_t{i} * HSp + c, x[i]);
}

// The bf16 row dot product sum_d x[d] * y[d] in fp32 over d < HSp, reading d < HS (zeros past
// it, and 0 if !valid): the sums of a copy padded with zeros, bit for bit.
HR_BF16_TARGET inline float dot_bf16_row(const bf16_t* x, const bf16_t* y, bool valid, int HSp,
                                         int HS) {
  __m512 acc = _mm512_setzero_ps();
  for (int c = 0; c < HSp; c += 16) {
    const __mmask16 m = valid ? cols_mask(c, HS) : 0;
    const __m512 a = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x + c)), 16));
    const __m512 b = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, y + c)), 16));
    acc = _mm512_fmadd_ps(a, b, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols (both multiples of 16): a
// transpose of 32-bit elements, 16 x 16 blocks in registers.
HR_BF16_TARGET void transpose32(uint32_t* dst, int64_t ld_dst, const uint32_t* src, int64_t ld_src,
                                int rows, int cols) {
  for (int r = 0; r < rows; r += 16) {
    for (int c = 0; c < cols; c += 16) {
      __m512 x[16];
      for (int i = 0; i < 16; ++i) {
        x[i] = _mm512_castsi512_ps(_mm512_loadu_si512(src + int64_t{r + i} * ld_src + c));
      }
      transpose16x16(x);
      for (int i = 0; i < 16; ++i) {
        _mm512_storeu_si512(dst + int64_t{c + i} * ld_dst + r, _mm512_castps_si512(x[i]));
      }
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
    mm<kAmx>(nq, kB, HSp / 2, qs, HSp, kt, kB, s, kB, false,
             diag ? DiagSkip::kSkipUpper : DiagSkip::kNone);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int r = 0; r < nq; ++r) {
      float* row = s + r * kB;
      const int ncols = diag ? r + 1 : kB;
      __m512 x[kB / 16];
      const float mx = scaled_row_max(row, vscale, ncols, x);
      const float m_new = jb == 0 ? mx : std::max(m[r], mx);
      // The row sum is of the fp32 probabilities; the product with v takes them rounded.
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps();
      bf16_t* prow = pb + r * kB;
      for (int c = 0; c < kB / 16; ++c) {
        auto* dst = reinterpret_cast<__m256i*>(prow + 16 * c);
        if (16 * c >= ncols) {  // wholly past the causal edge (diagonal tile): zeros, no exp
          _mm256_storeu_si256(dst, _mm256_setzero_si256());
          continue;
        }
        const __m512 e =
            _mm512_maskz_mov_ps(cols_mask(16 * c, ncols), exp16(_mm512_sub_ps(x[c], vm)));
        vsum = _mm512_add_ps(vsum, e);
        _mm256_storeu_si256(dst, cvt_ps_bf16(e));
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
    mm<kAmx>(nq, HSp, kB / 2, pb, kB, v2, HSp, o, HSp, jb > 0,
             diag ? DiagSkip::kKToRow : DiagSkip::kNone);
  }
  for (int r = 0; r < nq; ++r) {
    narrow_row(out + r * C, o + r * HSp, HS, 1.0f / l[r]);
    m[r] = m[r] + std::log(l[r]);
  }
}

// The rows the next head of this thread will read (its q, k, v and, for the backward, dout and
// out rows), asked into L2 a slice at a time while the current head computes: a head's rows lie
// 2 * 3C bytes apart, a new page every row or two, and copying them was a fifth of the bf16
// backward's own time waiting for memory (perf).
struct NextRows {
  const bf16_t* base[5] = {};
  int64_t ld[5] = {};
  int n = 0;      // streams in use
  int T = 0;      // rows
  int bytes = 0;  // bytes per row
};
HR_BF16_TARGET inline void prefetch_slice(const NextRows& next, int part, int parts) {
  const int r0 = static_cast<int>(int64_t{part} * next.T / parts);
  const int r1 = static_cast<int>(int64_t{part + 1} * next.T / parts);
  for (int i = 0; i < next.n; ++i) {
    for (int r = r0; r < r1; ++r) {
      const char* row = reinterpret_cast<const char*>(next.base[i] + r * next.ld[i]);
      for (int b = 0; b < next.bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
    }
  }
}

// One (b, h) of the forward, bf16: forward_block's online softmax for each query block, the
// tile products in bf16. The head's keys and values are packed once for all its query blocks.
//   q, k, v: the (b, h) rows of qkv (row stride C3); out: its output rows (stride C);
//   lse: lse[b, h, :], holding the running max until the end.
template <bool kAmx>
HR_BF16_TARGET void forward_head_bf16(bf16_t* out, float* lse, const bf16_t* q, const bf16_t* k,
                                      const bf16_t* v, int64_t C3, int64_t C, int T, int HS,
                                      float scale, float* slot, const NextRows& next) {
  const int HSp = padded_head(HS), nb = num_blocks(T), Tp = nb * kB;
  const int64_t TH = int64_t{Tp} * HSp;
  auto* qh = reinterpret_cast<bf16_t*>(slot);           // [Tp, HSp] q rows
  auto* kt_all = reinterpret_cast<uint32_t*>(qh + TH);  // per block [HSp/2, 64]
  uint32_t* v2_all = kt_all + TH / 2;                   // per block [32, HSp]
  auto* s = reinterpret_cast<float*>(v2_all + TH / 2);  // [64, 64]
  auto* pb = reinterpret_cast<bf16_t*>(s + kB * kB);    // [64, 64]
  auto* o = reinterpret_cast<float*>(pb + kB * kB);     // [64, HSp]
  float* l = o + int64_t{kB} * HSp;                     // [64]
  // Ingest: q rows, k^T pairs and v pairs, 16 rows of all three at a time (zeros past T).
  for (int t0 = 0; t0 < kIngestAhead; t0 += 16) {
    for (const bf16_t* src : {q, k, v}) prefetch_rows16(src, C3, t0, T, HS);
  }
  for (int t0 = 0; t0 < Tp; t0 += 16) {
    for (const bf16_t* src : {q, k, v}) prefetch_rows16(src, C3, t0 + kIngestAhead, T, HS);
    const int64_t blk = int64_t{t0 / kB} * kB * HSp / 2;
    const int n0 = t0 % kB;
    for (int c = 0; c < HSp; c += 32) {
      __m512i x[16];
      load_rows16(x, k, C3, t0, T, c, HS);
      store_pairs_transposed(kt_all + blk, n0, c, x);
      load_rows16(x, v, C3, t0, T, c, HS);
      store_row_pairs(v2_all + blk, n0 / 2, HSp, c, x);
      load_rows16(x, q, C3, t0, T, c, HS);
      store_rows(qh + int64_t{t0} * HSp, HSp, c, x);
    }
  }
  for (int ib = 0; ib < nb; ++ib) {
    const int64_t i0 = int64_t{ib} * kB;
    const int nq = std::min<int64_t>(kB, T - i0);
    float* m = lse + i0;
    prefetch_slice(next, ib, nb);
    // out's rows of the block are written at its end: their lines asked for now, for writing.
    prefetch_rows_for_write(out + i0 * C, C, nq, HS);
    forward_tiles_bf16<kAmx>(out + i0 * C, m, qh + i0 * HSp, kt_all, v2_all, C, HS, ib, nq, scale,
                             s, pb, o, l);
  }
}

// One (b, h) of the backward, bf16: the fp32 backward_head's tiles in the same order, each tile
// computed transposed (rows = keys, columns = queries), so that dK and dV come out as rows:
//   S^T = k q^T, dP^T = v dout^T (k, v rows x pairs of q^T, dout^T),
//   P^T and dS^T rows from them (lse and D vary along a row),
//   dV += P^T dout, dK += dS^T q (P^T, dS^T rows x pairs of query rows of dout, q),
//   dQ += dS k (dS rows, a 32-bit transpose of dS^T's pairs of key rows, x pairs of k).
// Every element sums the same products in the same order as the untransposed tiles (AMX and
// vdpbf16ps take a pair's two products in order, and a*b = b*a), so the bits are those of the
// untransposed kernel; no accumulator needs transposing at the end (see Note [Tiled attention]).
// Grouped-query attention: the task is one (b, kv head), and this runs once per query head of
// its group, in order: `first` ingests the kv head's rows too (with the first query head's, in
// the same pass, as for NKV == NH) and overwrites dK and dV as above; later query heads ingest
// their q, dout and out rows only, and every product adds to dK and dV (fp32, in the slot);
// `last` rounds dk and dv out (dq is each query head's own, rounded after it).
//   dq, q: the query head's rows, dk, dv, k, v: the kv head's (row stride ld3); dy, y: the
//   query head's dout and out rows (stride C).
template <bool kAmx>
HR_BF16_TARGET void backward_head_bf16(bf16_t* dq, bf16_t* dk, bf16_t* dv, const bf16_t* q,
                                       const bf16_t* k, const bf16_t* v, const bf16_t* dy,
                                       const bf16_t* y, const float* L, int64_t C3, int64_t C,
                                       int T, int HS, float scale, float* slot,
                                       const NextRows& next, bool first, bool last) {
  const int HSp = padded_head(HS), nb = num_blocks(T), Tp = nb * kB;
  const int64_t TH = int64_t{Tp} * HSp;
  auto* kh = reinterpret_cast<bf16_t*>(slot);  // [Tp, HSp] each: A of S^T, dP^T
  bf16_t* vh = kh + TH;
  auto* qt2 = reinterpret_cast<uint32_t*>(vh + TH);  // per block [HSp/2, 64]: B of S^T, dP^T
  uint32_t* dyt2 = qt2 + TH / 2;
  uint32_t* q2 = dyt2 + TH / 2;  // per block [32, HSp]: B of dK, dV, dQ
  uint32_t* dy2 = q2 + TH / 2;
  uint32_t* k2 = dy2 + TH / 2;
  auto* dQ = reinterpret_cast<float*>(k2 + TH / 2);  // [Tp, HSp] each
  float* dK = dQ + TH;
  float* dV = dK + TH;
  float* D = dV + TH;  // [Tp]
  float* s = D + Tp;   // [64, 64]
  float* dp = s + kB * kB;
  auto* dsr = reinterpret_cast<bf16_t*>(dp + kB * kB);  // [64, 64]: dS^T rows, then dS rows
  // P^T rows (bf16) and dS^T as pairs of key rows ([32, 64] u32) overwrite s and dP^T in place:
  // rows r, r + 1 land on floats [32 r, 32 r + 64), stored once both rows are read.
  auto* pT = reinterpret_cast<bf16_t*>(s);
  auto* ds2 = reinterpret_cast<uint32_t*>(dp);
  // Ingest: 16 rows of q, k, v, dout and out at a time (zeros past T), packed from registers:
  // q^T, dout^T pairs (B of S^T, dP^T), q, dout, k pairs (B of dK, dV, dQ), k, v rows (A of S^T,
  // dP^T), and D = rowsum(dout * out) while dout's and out's rows are in L1.
  // (Later query heads of a group: the first three streams only, the kv head's packed rows kept.)
  const bf16_t* const streams[5] = {q, dy, y, k, v};
  const int64_t lds[5] = {C3, C, C, C3, C3};
  const int nstreams = first ? 5 : 3;
  for (int t0 = 0; t0 < kIngestAhead; t0 += 16) {
    for (int i = 0; i < nstreams; ++i) prefetch_rows16(streams[i], lds[i], t0, T, HS);
  }
  for (int t0 = 0; t0 < Tp; t0 += 16) {
    for (int i = 0; i < nstreams; ++i) {
      prefetch_rows16(streams[i], lds[i], t0 + kIngestAhead, T, HS);
    }
    const int64_t blk = int64_t{t0 / kB} * kB * HSp / 2;
    const int n0 = t0 % kB;
    for (int c = 0; c < HSp; c += 32) {
      __m512i x[16];
      load_rows16(x, q, C3, t0, T, c, HS);
      store_row_pairs(q2 + blk, n0 / 2, HSp, c, x);
      store_pairs_transposed(qt2 + blk, n0, c, x);
      load_rows16(x, dy, C, t0, T, c, HS);
      store_row_pairs(dy2 + blk, n0 / 2, HSp, c, x);
      store_pairs_transposed(dyt2 + blk, n0, c, x);
      if (!first) continue;
      load_rows16(x, k, C3, t0, T, c, HS);
      store_rows(kh + int64_t{t0} * HSp, HSp, c, x);
      store_row_pairs(k2 + blk, n0 / 2, HSp, c, x);
      load_rows16(x, v, C3, t0, T, c, HS);
      store_rows(vh + int64_t{t0} * HSp, HSp, c, x);
    }
    for (int t = t0; t < t0 + 16; ++t) D[t] = dot_bf16_row(dy + t * C, y + t * C, t < T, HSp, HS);
  }

  const int tiles = nb * (nb + 1) / 2;
  int tile = 0;
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i vzero = _mm512_setzero_si512();
  for (int ib = 0; ib < nb; ++ib) {
    const int64_t i0 = int64_t{ib} * kB;
    const int nq = std::min<int64_t>(kB, T - i0);
    const int64_t ioff = i0 * HSp;
    // lse and D of the block's queries, one vector per 16 columns (zeros past the last query).
    __m512 vl[kB / 16], vd[kB / 16];
    __mmask16 qm[kB / 16];
    for (int c = 0; c < kB / 16; ++c) {
      qm[c] = cols_mask(16 * c, nq);
      vl[c] = _mm512_maskz_loadu_ps(qm[c], L + i0 + 16 * c);
      vd[c] = _mm512_loadu_ps(D + i0 + 16 * c);
    }
    for (int jb = 0; jb <= ib; ++jb) {
      // dqkv's rows of the head, written at its end: their lines asked for, for writing, a
      // slice per tile (as the next head's rows).
      {
        const int r0 = static_cast<int>(int64_t{tile} * T / tiles);
        const int r1 = static_cast<int>(int64_t{tile + 1} * T / tiles);
        prefetch_rows_for_write(dq + r0 * C3, C3, r1 - r0, HS);
        if (last) {
          for (bf16_t* d : {dk, dv}) prefetch_rows_for_write(d + r0 * C3, C3, r1 - r0, HS);
        }
      }
      prefetch_slice(next, tile++, tiles);
      const bool diag = jb == ib;
      const int64_t j0 = int64_t{jb} * kB, joff = j0 * HSp;
      const DiagSkip lower = diag ? DiagSkip::kSkipLower : DiagSkip::kNone;
      mm<kAmx>(kB, kB, HSp / 2, kh + joff, HSp, qt2 + ioff / 2, kB, s, kB, false, lower);    // S^T
      mm<kAmx>(kB, kB, HSp / 2, vh + joff, HSp, dyt2 + ioff / 2, kB, dp, kB, false, lower);  // dP^T
      // P^T = exp(scale s - lse), dS^T = P^T (dP^T - D) scale, zero where the key is past the
      // query (diagonal tile) and past the last query; to bf16 as rows (P^T, dS^T) and as pairs
      // of key rows (dS^T). Vectors wholly past the causal edge are zeros without arithmetic.
      for (int r = 0; r < kB; r += 2) {
        __m512i pc[kB / 16], dc[kB / 16];
        for (int c = 0; c < kB / 16; ++c) {
          if (16 * c >= nq || (diag && 16 * c + 15 < r)) {
            pc[c] = vzero;
            dc[c] = vzero;
            continue;
          }
          __m512 pv[2], dv2[2];
          for (int h = 0; h < 2; ++h) {
            const int rr = r + h;
            // Queries 16c + lane >= key rr on the diagonal tile.
            const __mmask16 mask =
                diag && rr > 16 * c ? __mmask16(qm[c] & ~((1u << std::min(rr - 16 * c, 16)) - 1u))
                                    : qm[c];
            const __m512 e =
                exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + rr * kB + 16 * c), vscale, vl[c]));
            pv[h] = _mm512_maskz_mov_ps(mask, e);
            const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(dp + rr * kB + 16 * c), vd[c]);
            dv2[h] = _mm512_maskz_mul_ps(mask, _mm512_mul_ps(pv[h], d), vscale);
          }
          pc[c] = cvt2_ps_bf16(pv[0], pv[1]);  // [row r | row r + 1]
          dc[c] = cvt2_ps_bf16(dv2[0], dv2[1]);
        }
        for (int c = 0; c < kB / 16; ++c) {
          auto* p0 = reinterpret_cast<__m256i*>(pT + r * kB + 16 * c);
          auto* p1 = reinterpret_cast<__m256i*>(pT + (r + 1) * kB + 16 * c);
          auto* d0 = reinterpret_cast<__m256i*>(dsr + r * kB + 16 * c);
          auto* d1 = reinterpret_cast<__m256i*>(dsr + (r + 1) * kB + 16 * c);
          _mm256_storeu_si256(p0, _mm512_castsi512_si256(pc[c]));
          _mm256_storeu_si256(p1, _mm512_extracti64x4_epi64(pc[c], 1));
          _mm256_storeu_si256(d0, _mm512_castsi512_si256(dc[c]));
          _mm256_storeu_si256(d1, _mm512_extracti64x4_epi64(dc[c], 1));
          _mm512_storeu_si512(ds2 + (r / 2) * kB + 16 * c, pairs_of_halves(dc[c]));
        }
      }
      // dV, dK rows [j0, j0 + 64) start at the diagonal tile (the first query block that sees
      // them) of the group's first query head, dQ's rows at key block 0: overwritten there, so
      // no zeroing.
      const DiagSkip from = diag ? DiagSkip::kKFromRow : DiagSkip::kNone;
      const bool acc_kv = !first || !diag;
      mm<kAmx>(kB, HSp, kB / 2, pT, kB, dy2 + ioff / 2, HSp, dV + joff, HSp, acc_kv,
               from);  // P^T dy
      mm<kAmx>(kB, HSp, kB / 2, dsr, kB, q2 + ioff / 2, HSp, dK + joff, HSp, acc_kv,
               from);  // dS^T q
      // dS rows: dsr32[i][p] = ds2[p][i] = (dS[i][2p], dS[i][2p + 1]).
      transpose32(reinterpret_cast<uint32_t*>(dsr), kB / 2, ds2, kB, kB / 2, kB);
      mm<kAmx>(nq, HSp, kB / 2, dsr, kB, k2 + joff / 2, HSp, dQ + ioff, HSp, jb > 0,
               diag ? DiagSkip::kKToRow : DiagSkip::kNone);  // dQ += dS k
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t o = int64_t{t} * HSp;
    narrow_row(dq + t * C3, dQ + o, HS, 1.0f);
    if (last) {
      narrow_row(dk + t * C3, dK + o, HS, 1.0f);
      narrow_row(dv + t * C3, dV + o, HS, 1.0f);
    }
  }
}
#endif  // x86-64

// Heads narrower than 32 take the fallback: the bf16 layouts pad HS to 32 (AMX's 32-element
// rows), which for HS = 16 doubles the product work and makes the scratch larger than the
// fallback's.
constexpr int kMinTileHead = 32;
bool use_bf16_products(int HS) {
  return HS >= kMinTileHead && resolved_kernel() != AttentionBf16Kernel::kWidenFp32;
}

}  // namespace

size_t attention_tiled_scratch_floats(int B, int T, int C, int NH, int NKV, DType storage) {
  // Tasks are query heads on every path (each packs its kv head's rows: O(T HS) against the
  // head's O(T^2 HS) products), so the slots do not depend on NKV.
  (void)NKV;
  const int64_t slots = std::min<int64_t>(int64_t{B} * NH, kAttentionMaxWorkers);
  if (storage == DType::kBF16 && use_bf16_products(C / NH)) {
    return static_cast<size_t>(slots) * forward_bf16_slot_floats(T, C / NH);
  }
  size_t slot = forward_slot_floats(T, C / NH);
  if (storage != DType::kF32) slot += forward_widen_floats(T, C / NH);
  return static_cast<size_t>(slots) * slot;
}
size_t attention_tiled_scratch_floats(int B, int T, int C, int NH, DType storage) {
  return attention_tiled_scratch_floats(B, T, C, NH, NH, storage);
}

size_t attention_tiled_backward_scratch_floats(int B, int T, int C, int NH, int NKV,
                                               DType storage) {
  // Tasks are (b, kv head) pairs on every path: the group's query heads run inside the task, one
  // after another, so that dk and dv are summed without a race (Note [Tiled attention]).
  const int64_t slots = std::min<int64_t>(int64_t{B} * NKV, kAttentionMaxWorkers);
  size_t slot = backward_slot_floats(T, C / NH);
  if (storage == DType::kBF16 && use_bf16_products(C / NH)) {
    slot = backward_bf16_slot_floats(T, C / NH);
  } else if (storage != DType::kF32) {
    slot += backward_widen_floats(T, C / NH);
  }
  return static_cast<size_t>(slots) * slot;
}
size_t attention_tiled_backward_scratch_floats(int B, int T, int C, int NH, DType storage) {
  return attention_tiled_backward_scratch_floats(B, T, C, NH, NH, storage);
}

namespace {
// Grouped-query attention's layout (fused_kernels.h): a qkv row holds the NH q heads, then the NKV
// k heads, then the NKV v heads, HS channels each; query head h reads kv head h / group. With
// NKV == NH, the [q | k | v] rows of 3C of multi-head attention.
struct Gqa {
  int NH, NKV, HS, group;
  int64_t W;  // qkv's row stride, (NH + 2 NKV) HS
  int64_t q(int h) const { return int64_t{h} * HS; }
  int64_t k(int j) const { return int64_t{NH + j} * HS; }
  int64_t v(int j) const { return int64_t{NH + NKV + j} * HS; }
};
Gqa gqa_shape(int C, int NH, int NKV) {
  HR_CHECK(NH > 0 && NKV > 0 && NH % NKV == 0 && C % NH == 0);
  const int HS = C / NH;
  return Gqa{NH, NKV, HS, NH / NKV, int64_t{NH + 2 * NKV} * HS};
}

template <typename TS>
void attention_tiled_forward_low(TS* out, float* lse, const TS* qkv, int B, int T, int C, int NH,
                                 int NKV, float* scratch) {
  HR_CHECK(T >= 1);
  const Gqa g = gqa_shape(C, NH, NKV);
  const int HS = g.HS;
  const int64_t H3 = int64_t{3} * HS;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const int BH = B * NH;
  const int slots = std::min(BH, kAttentionMaxWorkers);
  const size_t slot_floats = forward_slot_floats(T, HS) + forward_widen_floats(T, HS);
#pragma omp parallel num_threads(workers_for(slots))
  {
    float* slot = scratch + omp_get_thread_num() * slot_floats;
    float* rows = slot + forward_slot_floats(T, HS);  // [T, 3 HS]: q | k | v of the head
    float* o = rows + int64_t{T} * H3;                // [T, HS]
#pragma omp for schedule(dynamic, 1)
    for (int bh = 0; bh < BH; ++bh) {
      const int b = bh / NH, h = bh % NH, j = h / g.group;
      const TS* base = qkv + int64_t{b} * T * g.W;
      widen(rows, H3, base + g.q(h), g.W, T, HS);
      widen(rows + HS, H3, base + g.k(j), g.W, T, HS);
      widen(rows + 2 * HS, H3, base + g.v(j), g.W, T, HS);
      forward_head(o, lse + int64_t{bh} * T, rows, rows + HS, rows + 2 * HS, H3, HS, T, HS, scale,
                   slot);
      narrow(out + int64_t{b} * T * C + int64_t{h} * HS, C, o, HS, T, HS);
    }
  }
}

template <typename TS>
void attention_tiled_backward_low(TS* dqkv, const TS* dout, const TS* qkv, const TS* out,
                                  const float* lse, int B, int T, int C, int NH, int NKV,
                                  float* scratch) {
  HR_CHECK(T >= 1);
  const Gqa g = gqa_shape(C, NH, NKV);
  const int HS = g.HS;
  const int64_t H3 = int64_t{3} * HS, H2 = int64_t{2} * HS;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const int BK = B * NKV;
  const int slots = std::min(BK, kAttentionMaxWorkers);
  const size_t slot_floats = backward_slot_floats(T, HS) + backward_widen_floats(T, HS);
#pragma omp parallel num_threads(workers_for(slots))
  {
    float* slot = scratch + omp_get_thread_num() * slot_floats;
    float* rows = slot + backward_slot_floats(T, HS);  // [T, 3 HS]: q | k | v
    float* ys = rows + int64_t{T} * H3;                // [T, 2 HS]: dout | out
    float* drows = ys + int64_t{T} * H2;               // [T, 3 HS]: dq | dk | dv
#pragma omp for schedule(dynamic, 1)
    for (int bk = 0; bk < BK; ++bk) {
      const int b = bk / NKV, j = bk % NKV;
      const int64_t row0 = int64_t{b} * T * g.W;
      widen(rows + HS, H3, qkv + row0 + g.k(j), g.W, T, HS);
      widen(rows + 2 * HS, H3, qkv + row0 + g.v(j), g.W, T, HS);
      backward_pack_kv(rows + HS, rows + 2 * HS, H3, T, HS, slot);
      for (int i = 0; i < g.group; ++i) {  // dk, dv summed in fp32 in drows, in this order
        const int h = j * g.group + i;
        const int64_t off1 = int64_t{b} * T * C + int64_t{h} * HS;
        widen(rows, H3, qkv + row0 + g.q(h), g.W, T, HS);
        widen(ys, H2, dout + off1, C, T, HS);
        widen(ys + HS, H2, out + off1, C, T, HS);
        backward_query_head(drows, drows + HS, drows + 2 * HS, rows, ys, ys + HS,
                            lse + (int64_t{b} * NH + h) * T, H3, H2, T, HS, scale, i > 0, slot);
        narrow(dqkv + row0 + g.q(h), g.W, drows, H3, T, HS);
      }
      narrow(dqkv + row0 + g.k(j), g.W, drows + HS, H3, T, HS);
      narrow(dqkv + row0 + g.v(j), g.W, drows + 2 * HS, H3, T, HS);
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// The bf16 kernels with AMX or AVX512-BF16 tile products: `tasks` tasks (query heads forward,
// (b, kv head) pairs backward), each in a fixed order, so the results are bit-identical for any
// thread count. One slot of slot_size floats per worker; the tasks in contiguous equal chunks per
// thread (static: all cost the same, and each task knows the next one, whose rows it
// prefetches); on AMX the tile configuration loaded on each worker (it is per thread).
// task(i, next, slot): next is the task this thread runs after i (i + 1 under the static
// schedule), or -1.
template <bool kAmx, typename Task>
void for_each_task_bf16(int tasks, size_t slot_size, float* scratch, const Task& task) {
  const int slots = std::min(tasks, kAttentionMaxWorkers);
#pragma omp parallel num_threads(workers_for(slots))
  {
    float* slot = scratch + omp_get_thread_num() * slot_size;
    if constexpr (kAmx) amx_tiles_begin();
#pragma omp for schedule(static)
    for (int i = 0; i < tasks; ++i) task(i, i + 1 < tasks ? i + 1 : -1, slot);
    if constexpr (kAmx) amx_tiles_end();
  }
}

template <bool kAmx>
void attention_tiled_forward_dp(bf16_t* out, float* lse, const bf16_t* qkv, int B, int T, int C,
                                int NH, int NKV, float* scratch) {
  HR_CHECK(T >= 1);
  const Gqa g = gqa_shape(C, NH, NKV);
  const float scale = 1.0f / std::sqrt(static_cast<float>(g.HS));
  // The q, k and v rows of query head bh = b * NH + h.
  auto rows_of = [&](int bh, const bf16_t*(&r)[3]) {
    const int h = bh % NH, j = h / g.group;
    const bf16_t* base = qkv + int64_t{bh / NH} * T * g.W;
    r[0] = base + g.q(h);
    r[1] = base + g.k(j);
    r[2] = base + g.v(j);
  };
  for_each_task_bf16<kAmx>(
      B * NH, forward_bf16_slot_floats(T, g.HS), scratch, [&](int bh, int next_bh, float* slot) {
        const bf16_t* r[3];
        rows_of(bh, r);
        NextRows next;
        if (next_bh >= 0) {
          const bf16_t* n[3];
          rows_of(next_bh, n);
          next = {{n[0], n[1], n[2]}, {g.W, g.W, g.W}, 3, T, 2 * g.HS};
        }
        const int b = bh / NH, h = bh % NH;
        forward_head_bf16<kAmx>(out + int64_t{b} * T * C + int64_t{h} * g.HS, lse + int64_t{bh} * T,
                                r[0], r[1], r[2], g.W, C, T, g.HS, scale, slot, next);
      });
}

template <bool kAmx>
void attention_tiled_backward_dp(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv,
                                 const bf16_t* out, const float* lse, int B, int T, int C, int NH,
                                 int NKV, float* scratch) {
  HR_CHECK(T >= 1);
  const Gqa g = gqa_shape(C, NH, NKV);
  const float scale = 1.0f / std::sqrt(static_cast<float>(g.HS));
  const int64_t W = g.W;
  // Task bk = b * NKV + j: kv head j of batch element b, and its group's query heads in order.
  for_each_task_bf16<kAmx>(
      B * NKV, backward_bf16_slot_floats(T, g.HS), scratch, [&](int bk, int next_bk, float* slot) {
        const int b = bk / NKV, j = bk % NKV;
        const int64_t row0 = int64_t{b} * T * W;
        for (int i = 0; i < g.group; ++i) {
          const int h = j * g.group + i;
          const int64_t off1 = int64_t{b} * T * C + int64_t{h} * g.HS;
          // The rows read next: the group's next query head's, or the next task's (its kv head's
          // and its first query head's).
          NextRows next;
          if (i + 1 < g.group) {
            const int64_t n1 = off1 + g.HS;
            next = {{qkv + row0 + g.q(h + 1), dout + n1, out + n1}, {W, C, C}, 3, T, 2 * g.HS};
          } else if (next_bk >= 0) {
            const int nb = next_bk / NKV, nj = next_bk % NKV, nh = nj * g.group;
            const bf16_t* nbase = qkv + int64_t{nb} * T * W;
            const int64_t n1 = int64_t{nb} * T * C + int64_t{nh} * g.HS;
            next = {{nbase + g.q(nh), nbase + g.k(nj), nbase + g.v(nj), dout + n1, out + n1},
                    {W, W, W, C, C},
                    5,
                    T,
                    2 * g.HS};
          }
          backward_head_bf16<kAmx>(dqkv + row0 + g.q(h), dqkv + row0 + g.k(j), dqkv + row0 + g.v(j),
                                   qkv + row0 + g.q(h), qkv + row0 + g.k(j), qkv + row0 + g.v(j),
                                   dout + off1, out + off1, lse + (int64_t{b} * NH + h) * T, W, C,
                                   T, g.HS, scale, slot, next, i == 0, i + 1 == g.group);
        }
      });
}
#endif

}  // namespace

void set_attention_bf16_kernel(AttentionBf16Kernel kernel) {
  g_bf16_kernel.store(static_cast<int>(kernel), std::memory_order_relaxed);
}

AttentionBf16Kernel attention_bf16_kernel() { return resolved_kernel(); }

void attention_tiled_forward(bf16_t* out, float* lse, const bf16_t* qkv, int B, int T, int C,
                             int NH, int NKV, float* scratch) {
#if defined(__x86_64__) && defined(__GNUC__)
  const AttentionBf16Kernel kernel = resolved_kernel();
  if (NH > 0 && C % NH == 0 && use_bf16_products(C / NH)) {  // the kernels check the rest
    if (kernel == AttentionBf16Kernel::kAmx) {
      attention_tiled_forward_dp<true>(out, lse, qkv, B, T, C, NH, NKV, scratch);
    } else {
      attention_tiled_forward_dp<false>(out, lse, qkv, B, T, C, NH, NKV, scratch);
    }
    return;
  }
#endif
  attention_tiled_forward_low(out, lse, qkv, B, T, C, NH, NKV, scratch);
}
void attention_tiled_backward(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv,
                              const bf16_t* out, const float* lse, int B, int T, int C, int NH,
                              int NKV, float* scratch) {
#if defined(__x86_64__) && defined(__GNUC__)
  const AttentionBf16Kernel kernel = resolved_kernel();
  if (NH > 0 && C % NH == 0 && use_bf16_products(C / NH)) {  // the kernels check the rest
    if (kernel == AttentionBf16Kernel::kAmx) {
      attention_tiled_backward_dp<true>(dqkv, dout, qkv, out, lse, B, T, C, NH, NKV, scratch);
    } else {
      attention_tiled_backward_dp<false>(dqkv, dout, qkv, out, lse, B, T, C, NH, NKV, scratch);
    }
    return;
  }
#endif
  attention_tiled_backward_low(dqkv, dout, qkv, out, lse, B, T, C, NH, NKV, scratch);
}
void attention_tiled_forward(f16_t* out, float* lse, const f16_t* qkv, int B, int T, int C, int NH,
                             int NKV, float* scratch) {
  attention_tiled_forward_low(out, lse, qkv, B, T, C, NH, NKV, scratch);
}
void attention_tiled_backward(f16_t* dqkv, const f16_t* dout, const f16_t* qkv, const f16_t* out,
                              const float* lse, int B, int T, int C, int NH, int NKV,
                              float* scratch) {
  attention_tiled_backward_low(dqkv, dout, qkv, out, lse, B, T, C, NH, NKV, scratch);
}

void attention_tiled_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH,
                             int NKV, float* scratch) {
  HR_CHECK(T >= 1);
  const Gqa g = gqa_shape(C, NH, NKV);
  const int HS = g.HS;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const int BH = B * NH;
  const int slots = std::min(BH, kAttentionMaxWorkers);
  const size_t slot_floats = forward_slot_floats(T, HS);
#pragma omp parallel num_threads(workers_for(slots))
  {
    float* slot = scratch + omp_get_thread_num() * slot_floats;
#pragma omp for schedule(dynamic, 1)
    for (int bh = 0; bh < BH; ++bh) {
      const int b = bh / NH, h = bh % NH, j = h / g.group;
      const float* base = qkv + int64_t{b} * T * g.W;
      forward_head(out + int64_t{b} * T * C + int64_t{h} * HS, lse + int64_t{bh} * T, base + g.q(h),
                   base + g.k(j), base + g.v(j), g.W, C, T, HS, scale, slot);
    }
  }
}

void attention_tiled_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                              const float* lse, int B, int T, int C, int NH, int NKV,
                              float* scratch) {
  HR_CHECK(T >= 1);
  const Gqa g = gqa_shape(C, NH, NKV);
  const int HS = g.HS;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const int BK = B * NKV;
  const int slots = std::min(BK, kAttentionMaxWorkers);
  const size_t slot_floats = backward_slot_floats(T, HS);
#pragma omp parallel num_threads(workers_for(slots))
  {
    float* slot = scratch + omp_get_thread_num() * slot_floats;
#pragma omp for schedule(dynamic, 1)
    for (int bk = 0; bk < BK; ++bk) {
      const int b = bk / NKV, j = bk % NKV;
      const int64_t row0 = int64_t{b} * T * g.W;
      backward_pack_kv(qkv + row0 + g.k(j), qkv + row0 + g.v(j), g.W, T, HS, slot);
      // The group's query heads in order: dk and dv of kv head j summed over them in fp32, in
      // place in dqkv (overwritten by the first).
      for (int i = 0; i < g.group; ++i) {
        const int h = j * g.group + i;
        const int64_t off1 = int64_t{b} * T * C + int64_t{h} * HS;
        backward_query_head(dqkv + row0 + g.q(h), dqkv + row0 + g.k(j), dqkv + row0 + g.v(j),
                            qkv + row0 + g.q(h), dout + off1, out + off1,
                            lse + (int64_t{b} * NH + h) * T, g.W, C, T, HS, scale, i > 0, slot);
      }
    }
  }
}

// Multi-head attention: the same kernels with one query head per kv head.
void attention_tiled_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH,
                             float* scratch) {
  attention_tiled_forward(out, lse, qkv, B, T, C, NH, NH, scratch);
}
void attention_tiled_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                              const float* lse, int B, int T, int C, int NH, float* scratch) {
  attention_tiled_backward(dqkv, dout, qkv, out, lse, B, T, C, NH, NH, scratch);
}
void attention_tiled_forward(bf16_t* out, float* lse, const bf16_t* qkv, int B, int T, int C,
                             int NH, float* scratch) {
  attention_tiled_forward(out, lse, qkv, B, T, C, NH, NH, scratch);
}
void attention_tiled_backward(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv,
                              const bf16_t* out, const float* lse, int B, int T, int C, int NH,
                              float* scratch) {
  attention_tiled_backward(dqkv, dout, qkv, out, lse, B, T, C, NH, NH, scratch);
}
void attention_tiled_forward(f16_t* out, float* lse, const f16_t* qkv, int B, int T, int C, int NH,
                             float* scratch) {
  attention_tiled_forward(out, lse, qkv, B, T, C, NH, NH, scratch);
}
void attention_tiled_backward(f16_t* dqkv, const f16_t* dout, const f16_t* qkv, const f16_t* out,
                              const float* lse, int B, int T, int C, int NH, float* scratch) {
  attention_tiled_backward(dqkv, dout, qkv, out, lse, B, T, C, NH, NH, scratch);
}

}  // namespace headroom::cpu

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
