// Tiled causal attention (see fused_kernels.h): the forward keeps a running max and sum per query
// row (online softmax) over 64 x 64 tiles and saves only the row log-sum-exp; the backward
// recomputes each tile's probabilities from it (FlashAttention-2). See Note [Tiled attention] in
// docs/notes/fused-kernels.md.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/bf16.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/fused_kernels.h"
#include "core/check.h"

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
  for (; c0 + kW <= N; c0 += kW) tile<R, 1>(K, A, ars, acs, B + c0, ldb, C + c0, ldc, acc);
  if (c0 < N) tile_tail<R>(K, N - c0, A, ars, acs, B + c0, ldb, C + c0, ldc, acc);
}

// C[M,N] = A[M,K] x B[K,N], or C += ... when acc. Single-threaded (called inside tasks). The sum
// over k runs in order for every element, so the result depends on the shapes only.
void small_gemm(int M, int N, int K, const float* A, int64_t ars, int64_t acs, const float* B,
                int64_t ldb, float* C, int64_t ldc, bool acc) {
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
void pack_transposed(float* dst, const float* src, int64_t ld, int n, int HS) {
  for (int d = 0; d < HS; ++d) {
    float* row = dst + int64_t{d} * kB;
    for (int c = 0; c < n; ++c) row[c] = src[c * ld + d];
    for (int c = n; c < kB; ++c) row[c] = 0.0f;
  }
}

inline int num_blocks(int T) { return (T + kB - 1) / kB; }

size_t forward_slot_floats(int HS) { return size_t{1} * HS * kB + kB * kB + kB; }
size_t backward_slot_floats(int HS) { return size_t{2} * HS * kB + 2 * kB * kB + kB; }

// Threads for `tasks` tasks with `slots` scratch slots: thread i uses slot i.
inline int workers_for(int slots) { return std::max(1, std::min(omp_get_max_threads(), slots)); }

// One query block of one (b, h): the online softmax over key blocks 0..ib.
//   q, k, v: the (b, h) rows of qkv (row stride C3); o: the block's output rows (stride C);
//   m: the block's lse entries, holding the running max until the end.
void forward_block(float* o, float* m, const float* q, const float* k, const float* v, int64_t C3,
                   int64_t C, int HS, int ib, int nq, float scale, float* slot) {
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
void backward_head(float* dq, float* dk, float* dv, const float* q, const float* k, const float* v,
                   const float* dy, const float* y, const float* L, int64_t C3, int64_t C, int T,
                   int HS, float scale, float* slot) {
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

// bf16 storage: each task first widens the rows it reads into fp32 copies in its slot, runs the
// fp32 code above on them, and rounds its output once. The copies hold `rows` rows of one head.
size_t forward_widen_floats(int T, int HS) { return size_t{1} * T * 3 * HS + size_t{kB} * HS; }
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

}  // namespace

size_t attention_tiled_scratch_floats(int B, int T, int C, int NH, DType storage) {
  const int64_t tasks = int64_t{B} * NH * num_blocks(T);
  const int64_t slots = std::min<int64_t>(tasks, kAttentionMaxWorkers);
  size_t slot = forward_slot_floats(C / NH);
  if (storage != DType::kF32) slot += forward_widen_floats(T, C / NH);
  return static_cast<size_t>(slots) * slot;
}

size_t attention_tiled_backward_scratch_floats(int B, int T, int C, int NH, DType storage) {
  const int64_t slots = std::min<int64_t>(int64_t{B} * NH, kAttentionMaxWorkers);
  size_t slot = backward_slot_floats(C / NH);
  if (storage != DType::kF32) slot += backward_widen_floats(T, C / NH);
  return static_cast<size_t>(slots) * slot;
}

namespace {
template <typename TS>
void attention_tiled_forward_low(TS* out, float* lse, const TS* qkv, int B, int T, int C, int NH,
                                 float* scratch) {
  HR_CHECK(NH > 0 && C % NH == 0 && T >= 1);
  const int HS = C / NH;
  const int64_t C3 = int64_t{3} * C, H3 = int64_t{3} * HS;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const int nb = num_blocks(T);
  const int BH = B * NH;
  const int tasks = BH * nb;
  const int slots = std::min(tasks, kAttentionMaxWorkers);
  const size_t slot_floats = forward_slot_floats(HS) + forward_widen_floats(T, HS);
#pragma omp parallel num_threads(workers_for(slots))
  {
    float* slot = scratch + omp_get_thread_num() * slot_floats;
    float* rows = slot + forward_slot_floats(HS);  // [i0 + nq, 3 HS]: q | k | v of the head
    float* o = rows + int64_t{T} * H3;             // [nq, HS]
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < tasks; ++task) {
      const int ib = nb - 1 - task / BH;
      const int bh = task % BH;
      const int b = bh / NH, h = bh % NH;
      const int64_t i0 = int64_t{ib} * kB;
      const int nq = std::min<int64_t>(kB, T - i0);
      const TS* base = qkv + int64_t{b} * T * C3 + int64_t{h} * HS;
      for (int part = 0; part < 3; ++part) {
        widen(rows + part * HS, H3, base + part * C, C3, i0 + nq, HS);
      }
      forward_block(o, lse + int64_t{bh} * T + i0, rows + i0 * H3, rows + HS, rows + 2 * HS, H3, HS,
                    HS, ib, nq, scale, slot);
      narrow(out + (int64_t{b} * T + i0) * C + int64_t{h} * HS, C, o, HS, nq, HS);
    }
  }
}

template <typename TS>
void attention_tiled_backward_low(TS* dqkv, const TS* dout, const TS* qkv, const TS* out,
                                  const float* lse, int B, int T, int C, int NH, float* scratch) {
  HR_CHECK(NH > 0 && C % NH == 0 && T >= 1);
  const int HS = C / NH;
  const int64_t C3 = int64_t{3} * C, H3 = int64_t{3} * HS, H2 = int64_t{2} * HS;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const int BH = B * NH;
  const int slots = std::min(BH, kAttentionMaxWorkers);
  const size_t slot_floats = backward_slot_floats(HS) + backward_widen_floats(T, HS);
#pragma omp parallel num_threads(workers_for(slots))
  {
    float* slot = scratch + omp_get_thread_num() * slot_floats;
    float* rows = slot + backward_slot_floats(HS);  // [T, 3 HS]: q | k | v
    float* ys = rows + int64_t{T} * H3;             // [T, 2 HS]: dout | out
    float* drows = ys + int64_t{T} * H2;            // [T, 3 HS]: dq | dk | dv
#pragma omp for schedule(dynamic, 1)
    for (int bh = 0; bh < BH; ++bh) {
      const int b = bh / NH, h = bh % NH;
      const int64_t off3 = int64_t{b} * T * C3 + int64_t{h} * HS;
      const int64_t off1 = int64_t{b} * T * C + int64_t{h} * HS;
      for (int part = 0; part < 3; ++part) {
        widen(rows + part * HS, H3, qkv + off3 + part * C, C3, T, HS);
      }
      widen(ys, H2, dout + off1, C, T, HS);
      widen(ys + HS, H2, out + off1, C, T, HS);
      backward_head(drows, drows + HS, drows + 2 * HS, rows, rows + HS, rows + 2 * HS, ys, ys + HS,
                    lse + int64_t{bh} * T, H3, H2, T, HS, scale, slot);
      for (int part = 0; part < 3; ++part) {
        narrow(dqkv + off3 + part * C, C3, drows + part * HS, H3, T, HS);
      }
    }
  }
}

}  // namespace

void attention_tiled_forward(bf16_t* out, float* lse, const bf16_t* qkv, int B, int T, int C,
                             int NH, float* scratch) {
  attention_tiled_forward_low(out, lse, qkv, B, T, C, NH, scratch);
}
void attention_tiled_backward(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv,
                              const bf16_t* out, const float* lse, int B, int T, int C, int NH,
                              float* scratch) {
  attention_tiled_backward_low(dqkv, dout, qkv, out, lse, B, T, C, NH, scratch);
}
void attention_tiled_forward(f16_t* out, float* lse, const f16_t* qkv, int B, int T, int C, int NH,
                             float* scratch) {
  attention_tiled_forward_low(out, lse, qkv, B, T, C, NH, scratch);
}
void attention_tiled_backward(f16_t* dqkv, const f16_t* dout, const f16_t* qkv, const f16_t* out,
                              const float* lse, int B, int T, int C, int NH, float* scratch) {
  attention_tiled_backward_low(dqkv, dout, qkv, out, lse, B, T, C, NH, scratch);
}

void attention_tiled_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH,
                             float* scratch) {
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

void attention_tiled_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                              const float* lse, int B, int T, int C, int NH, float* scratch) {
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

}  // namespace headroom::cpu
