// Tiled causal attention on CUDA (FlashAttention-2's algorithm, cuda_ops_impl.h): the forward
// keeps a running max and sum per query row over 64 x 64 tiles and saves the row log-sum-exp;
// the backward recomputes each tile's probabilities from it. No T x T buffer, no float atomics:
// every output element is summed by one thread in a fixed order. See docs/notes/cuda.md,
// "## attention".
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "backend/cuda/attention_kernels.h"
#include "backend/cuda/cuda_ops_impl.h"
#include "core/check.h"

namespace headroom::backend::cuda {
namespace {

// Tiles are kTile query rows x kTile keys; a block of kThreads = 16 x 16 threads, thread (ty, tx)
// owning the rows ty + 16 r (r < 4) and the columns tx + 16 c of every tile it computes, so the 16
// threads of one row are one half-warp (row reductions are shuffles within it).
constexpr int kTile = 64;
constexpr int kThreads = 256;
constexpr int kRows = kTile / 16;  // rows (and tile columns) per thread
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- storage types: every product and sum is fp32; values are widened once on load and rounded
// once on store (nearest even, as the CPU's conversions) -------------------------------------
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(bf16_t x) {
  __nv_bfloat16_raw r;
  r.x = x.bits;
  return __bfloat162float(__nv_bfloat16(r));
}
__device__ __forceinline__ float widen(f16_t x) {
  __half_raw r;
  r.x = x.bits;
  return __half2float(__half(r));
}
template <typename T>
__device__ __forceinline__ T narrow(float x);
template <>
__device__ __forceinline__ float narrow<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16_t narrow<bf16_t>(float x) {
  const __nv_bfloat16_raw r = __float2bfloat16_rn(x);
  return bf16_t{r.x};
}
template <>
__device__ __forceinline__ f16_t narrow<f16_t>(float x) {
  const __half_raw r = __float2half_rn(x);
  return f16_t{r.x};
}

// The shapes every kernel reads. W: qkv's row ((NH + 2 NKV) HS elements); C: out's and dout's
// row (NH HS); scale = 1 / sqrt(HS); scale_log2 = scale * log2(e) (scores in base-2 units, so
// the exponentials are exp2f).
struct Shape {
  int B, T, NH, NKV, HS, group;
  int64_t W, C;
  float scale, scale_log2;
};

// dst[r][d] (row stride D + 1: the padding column keeps column-wise reads conflict-free) =
// src[r * ld + d] widened, for r < rows and d < HS; zero elsewhere, so padded head dimensions add
// nothing to dot products and padded rows are finite. Consecutive threads read consecutive d:
// coalesced, whatever the alignment of src and ld (scalar loads).
template <int D, typename T>
__device__ __forceinline__ void load_tile(float* dst, const T* src, int64_t ld, int rows, int HS) {
  for (int idx = threadIdx.x; idx < kTile * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    float x = 0.0f;
    if (r < rows && d < HS) x = widen(src[r * ld + d]);
    dst[r * (D + 1) + d] = x;
  }
}

// Across the 16 threads of a row (one half-warp: lanes differing in their low four bits). Every
// lane ends with the same bits (each step adds the same two values, in either order).
__device__ __forceinline__ float row_max16(float x) {
  for (int off = 8; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ float row_sum16(float x) {
  for (int off = 8; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

template <int D>
constexpr size_t forward_smem_bytes() {
  return sizeof(float) * (3 * kTile * (D + 1) + kTile * (kTile + 1));
}
template <int D>
constexpr size_t backward_smem_bytes() {
  return sizeof(float) * (4 * kTile * (D + 1) + kTile * (kTile + 1) + 2 * kTile);
}

// ---- forward -------------------------------------------------------------------------------
// Block (query tile, head h, batch b); the last query tiles (the most key tiles) are scheduled
// first. Q's tile stays in shared memory; each key tile's K and V are loaded, S = Q K^T is taken
// in registers, the online softmax updates the row max m and sum l (the accumulator o is
// rescaled when m grows), P goes through shared memory to o += P V. out = o / l and
// lse = ln(sum_s exp(score_s)) = (m + log2 l) ln 2.
template <int D, typename T>
__global__ void __launch_bounds__(kThreads, 2)
    tiled_forward_kernel(T* __restrict__ out, float* __restrict__ lse, const T* __restrict__ qkv,
                         Shape s) {
  constexpr int kCols = D / 16;  // head dimensions per thread
  extern __shared__ float smem[];
  float* Qs = smem;
  float* Ks = Qs + kTile * (D + 1);
  float* Vs = Ks + kTile * (D + 1);
  float* Ps = Vs + kTile * (D + 1);  // [kTile][kTile + 1]
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / s.group;
  const int i0 = qt * kTile, nq = min(kTile, s.T - i0);
  const T* base = qkv + int64_t{b} * s.T * s.W;
  const T* k = base + int64_t{s.NH + kvh} * s.HS;
  const T* v = base + int64_t{s.NH + s.NKV + kvh} * s.HS;
  load_tile<D>(Qs, base + int64_t{i0} * s.W + int64_t{h} * s.HS, s.W, nq, s.HS);

  float m[kRows], l[kRows], o[kRows][kCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) o[r][c] = 0.0f;
  }
  for (int kt = 0; kt <= qt; ++kt) {
    const int j0 = kt * kTile, nk = min(kTile, s.T - j0);
    __syncthreads();  // the previous tile's reads of Ks, Vs and Ps are done
    load_tile<D>(Ks, k + int64_t{j0} * s.W, s.W, nk, s.HS);
    load_tile<D>(Vs, v + int64_t{j0} * s.W, s.W, nk, s.HS);
    __syncthreads();
    float sc[kRows][kRows] = {};
#pragma unroll 4
    for (int d = 0; d < D; ++d) {
      float a[kRows], bk[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) a[r] = Qs[(ty + 16 * r) * (D + 1) + d];
#pragma unroll
      for (int c = 0; c < kRows; ++c) bk[c] = Ks[(tx + 16 * c) * (D + 1) + d];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < kRows; ++c) sc[r][c] = fmaf(a[r], bk[c], sc[r][c]);
    }
    // Causal mask on the diagonal tile (key column > query row). Only the diagonal tile can hold
    // keys past T (the last tile), and those are past every valid row, so the same mask covers
    // them; every valid row keeps key 0 of the tile, so its max is finite.
    const bool diag = kt == qt;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = ty + 16 * r;
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < kRows; ++c) {
        const int col = tx + 16 * c;
        const float x = (diag && col > row) ? -INFINITY : sc[r][c] * s.scale_log2;
        sc[r][c] = x;
        mx = fmaxf(mx, x);
      }
      mx = row_max16(mx);
      const float m_new = fmaxf(m[r], mx);
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < kRows; ++c) {
        const float p = exp2f(sc[r][c] - m_new);  // 0 where masked
        Ps[row * (kTile + 1) + tx + 16 * c] = p;
        sum += p;
      }
      sum = row_sum16(sum);
      const float alpha = exp2f(m[r] - m_new);  // 0 on the first tile (m = -inf)
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
#pragma unroll
      for (int c = 0; c < kCols; ++c) o[r][c] *= alpha;
    }
    __syncthreads();
#pragma unroll 4
    for (int jj = 0; jj < kTile; ++jj) {
      float p[kRows], vv[kCols];
#pragma unroll
      for (int r = 0; r < kRows; ++r) p[r] = Ps[(ty + 16 * r) * (kTile + 1) + jj];
#pragma unroll
      for (int c = 0; c < kCols; ++c) vv[c] = Vs[jj * (D + 1) + tx + 16 * c];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < kCols; ++c) o[r][c] = fmaf(p[r], vv[c], o[r][c]);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = ty + 16 * r;
    if (row >= nq) continue;
    const float inv = 1.0f / l[r];
    T* orow = out + (int64_t{b} * s.T + i0 + row) * s.C + int64_t{h} * s.HS;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = tx + 16 * c;
      if (d < s.HS) orow[d] = narrow<T>(o[r][c] * inv);
    }
    if (tx == 0) lse[(int64_t{b} * s.NH + h) * s.T + i0 + row] = (m[r] + log2f(l[r])) * kLn2;
  }
}

// ---- backward ------------------------------------------------------------------------------
// D[b, h, t] = dout_t . out_t over the head's HS channels (FlashAttention-2's rowsum(dO * O)), in
// the backward's scratch; one warp per (b, t, h), lanes over channels, a fixed shuffle tree.
template <typename T>
__global__ void row_dot_kernel(float* __restrict__ Drow, const T* __restrict__ dout,
                               const T* __restrict__ out, Shape s) {
  const int64_t row = int64_t{blockIdx.x} * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= int64_t{s.B} * s.T * s.NH) return;  // whole warps return together
  const int64_t bt = row / s.NH;
  const int h = int(row % s.NH);
  const T* a = dout + bt * s.C + int64_t{h} * s.HS;
  const T* y = out + bt * s.C + int64_t{h} * s.HS;
  float sum = 0.0f;
  for (int d = lane; d < s.HS; d += 32) sum = fmaf(widen(a[d]), widen(y[d]), sum);
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    const int64_t b = bt / s.T, t = bt % s.T;
    Drow[(b * s.NH + h) * s.T + t] = sum;
  }
}

// Loads a query tile's rows of head h: q (from qkv), dout, lse (in base-2 units) and D.
template <int D, typename T>
__device__ __forceinline__ void load_query_side(float* Qs, float* dOs, float* Ls, float* Ds,
                                                const T* qkv, const T* dout, const float* lse,
                                                const float* Drow, const Shape& s, int b, int h,
                                                int i0, int nq) {
  load_tile<D>(Qs, qkv + (int64_t{b} * s.T + i0) * s.W + int64_t{h} * s.HS, s.W, nq, s.HS);
  load_tile<D>(dOs, dout + (int64_t{b} * s.T + i0) * s.C + int64_t{h} * s.HS, s.C, nq, s.HS);
  if (threadIdx.x < kTile) {
    const int r = threadIdx.x;
    const int64_t at = (int64_t{b} * s.NH + h) * s.T + i0 + r;
    Ls[r] = r < nq ? lse[at] * kLog2e : 0.0f;
    Ds[r] = r < nq ? Drow[at] : 0.0f;
  }
}

// dK and dV: block (key tile, kv head, batch b), key tile 0 (seen by every query tile) first.
// K and V stay in shared memory; the group's query heads in order, and for each the query tiles
// from the diagonal on, each give S^T and dP^T in registers (thread rows are keys, columns
// queries), P = exp(scale s - lse) and dS = P (dP - D) scale; P^T then dS^T go through shared
// memory to dV += P^T dO and dK += dS^T Q, which stay in registers for the whole group: each kv
// head's dk and dv are summed over its query heads in fp32 and rounded once.
template <int D, typename T>
__global__ void __launch_bounds__(kThreads)
    tiled_backward_dkdv_kernel(T* __restrict__ dqkv, const T* __restrict__ dout,
                               const T* __restrict__ qkv, const float* __restrict__ lse,
                               const float* __restrict__ Drow, Shape s) {
  constexpr int kCols = D / 16;
  extern __shared__ float smem[];
  float* Ks = smem;
  float* Vs = Ks + kTile * (D + 1);
  float* Qs = Vs + kTile * (D + 1);
  float* dOs = Qs + kTile * (D + 1);
  float* Ps = dOs + kTile * (D + 1);  // [kTile][kTile + 1]: P^T, then dS^T
  float* Ls = Ps + kTile * (kTile + 1);
  float* Ds = Ls + kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int kt = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int j0 = kt * kTile, nk = min(kTile, s.T - j0);
  const int nqt = (s.T + kTile - 1) / kTile;
  const T* base = qkv + int64_t{b} * s.T * s.W;
  const int64_t koff = int64_t{s.NH + kvh} * s.HS, voff = int64_t{s.NH + s.NKV + kvh} * s.HS;
  load_tile<D>(Ks, base + int64_t{j0} * s.W + koff, s.W, nk, s.HS);
  load_tile<D>(Vs, base + int64_t{j0} * s.W + voff, s.W, nk, s.HS);

  float dk[kRows][kCols] = {}, dv[kRows][kCols] = {};
  for (int g = 0; g < s.group; ++g) {
    const int h = kvh * s.group + g;
    for (int qt = kt; qt < nqt; ++qt) {
      const int i0 = qt * kTile, nq = min(kTile, s.T - i0);
      __syncthreads();  // the previous tile's reads of Qs, dOs, Ps, Ls and Ds are done
      load_query_side<D>(Qs, dOs, Ls, Ds, qkv, dout, lse, Drow, s, b, h, i0, nq);
      __syncthreads();
      float st[kRows][kRows] = {}, dpt[kRows][kRows] = {};
#pragma unroll 2
      for (int d = 0; d < D; ++d) {
        float kk[kRows], vv[kRows], qq[kRows], oo[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          kk[r] = Ks[(ty + 16 * r) * (D + 1) + d];
          vv[r] = Vs[(ty + 16 * r) * (D + 1) + d];
        }
#pragma unroll
        for (int c = 0; c < kRows; ++c) {
          qq[c] = Qs[(tx + 16 * c) * (D + 1) + d];
          oo[c] = dOs[(tx + 16 * c) * (D + 1) + d];
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int c = 0; c < kRows; ++c) {
            st[r][c] = fmaf(kk[r], qq[c], st[r][c]);
            dpt[r][c] = fmaf(vv[r], oo[c], dpt[r][c]);
          }
      }
      // P = 0 past the causal edge (key > query on the diagonal tile) and for query rows past T.
      const bool diag = qt == kt;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int key = ty + 16 * r;
#pragma unroll
        for (int c = 0; c < kRows; ++c) {
          const int qi = tx + 16 * c;
          const bool live = qi < nq && !(diag && key > qi);
          const float p = live ? exp2f(st[r][c] * s.scale_log2 - Ls[qi]) : 0.0f;
          Ps[key * (kTile + 1) + qi] = p;
          st[r][c] = p * (dpt[r][c] - Ds[qi]) * s.scale;  // dS^T, kept for after dV
        }
      }
      __syncthreads();
#pragma unroll 4
      for (int qi = 0; qi < kTile; ++qi) {
        float p[kRows], oo[kCols];
#pragma unroll
        for (int r = 0; r < kRows; ++r) p[r] = Ps[(ty + 16 * r) * (kTile + 1) + qi];
#pragma unroll
        for (int c = 0; c < kCols; ++c) oo[c] = dOs[qi * (D + 1) + tx + 16 * c];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int c = 0; c < kCols; ++c) dv[r][c] = fmaf(p[r], oo[c], dv[r][c]);
      }
      __syncthreads();  // every read of P^T is done: dS^T takes its place
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < kRows; ++c) Ps[(ty + 16 * r) * (kTile + 1) + tx + 16 * c] = st[r][c];
      __syncthreads();
#pragma unroll 4
      for (int qi = 0; qi < kTile; ++qi) {
        float ds[kRows], qq[kCols];
#pragma unroll
        for (int r = 0; r < kRows; ++r) ds[r] = Ps[(ty + 16 * r) * (kTile + 1) + qi];
#pragma unroll
        for (int c = 0; c < kCols; ++c) qq[c] = Qs[qi * (D + 1) + tx + 16 * c];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int c = 0; c < kCols; ++c) dk[r][c] = fmaf(ds[r], qq[c], dk[r][c]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int key = ty + 16 * r;
    if (key >= nk) continue;
    T* row = dqkv + (int64_t{b} * s.T + j0 + key) * s.W;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = tx + 16 * c;
      if (d < s.HS) {
        row[koff + d] = narrow<T>(dk[r][c]);
        row[voff + d] = narrow<T>(dv[r][c]);
      }
    }
  }
}

// dQ: block (query tile, head h, batch b), the last query tiles first. The query side (q, dout,
// lse, D) stays in shared memory; each key tile from 0 to the diagonal gives S and dP in
// registers, dS through shared memory, dQ += dS K in registers (FlashAttention-2's dq pass,
// without its atomics: one block owns each dq row).
template <int D, typename T>
__global__ void __launch_bounds__(kThreads)
    tiled_backward_dq_kernel(T* __restrict__ dqkv, const T* __restrict__ dout,
                             const T* __restrict__ qkv, const float* __restrict__ lse,
                             const float* __restrict__ Drow, Shape s) {
  constexpr int kCols = D / 16;
  extern __shared__ float smem[];
  float* Ks = smem;
  float* Vs = Ks + kTile * (D + 1);
  float* Qs = Vs + kTile * (D + 1);
  float* dOs = Qs + kTile * (D + 1);
  float* Ps = dOs + kTile * (D + 1);  // [kTile][kTile + 1]: dS
  float* Ls = Ps + kTile * (kTile + 1);
  float* Ds = Ls + kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / s.group;
  const int i0 = qt * kTile, nq = min(kTile, s.T - i0);
  const T* base = qkv + int64_t{b} * s.T * s.W;
  const int64_t koff = int64_t{s.NH + kvh} * s.HS, voff = int64_t{s.NH + s.NKV + kvh} * s.HS;
  load_query_side<D>(Qs, dOs, Ls, Ds, qkv, dout, lse, Drow, s, b, h, i0, nq);

  float dq[kRows][kCols] = {};
  for (int kt = 0; kt <= qt; ++kt) {
    const int j0 = kt * kTile, nk = min(kTile, s.T - j0);
    __syncthreads();  // the previous tile's reads of Ks and Ps are done
    load_tile<D>(Ks, base + int64_t{j0} * s.W + koff, s.W, nk, s.HS);
    load_tile<D>(Vs, base + int64_t{j0} * s.W + voff, s.W, nk, s.HS);
    __syncthreads();
    float sc[kRows][kRows] = {}, dp[kRows][kRows] = {};
#pragma unroll 2
    for (int d = 0; d < D; ++d) {
      float qq[kRows], oo[kRows], kk[kRows], vv[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        qq[r] = Qs[(ty + 16 * r) * (D + 1) + d];
        oo[r] = dOs[(ty + 16 * r) * (D + 1) + d];
      }
#pragma unroll
      for (int c = 0; c < kRows; ++c) {
        kk[c] = Ks[(tx + 16 * c) * (D + 1) + d];
        vv[c] = Vs[(tx + 16 * c) * (D + 1) + d];
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < kRows; ++c) {
          sc[r][c] = fmaf(qq[r], kk[c], sc[r][c]);
          dp[r][c] = fmaf(oo[r], vv[c], dp[r][c]);
        }
    }
    const bool diag = kt == qt;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int qi = ty + 16 * r;
#pragma unroll
      for (int c = 0; c < kRows; ++c) {
        const int key = tx + 16 * c;
        const bool live = qi < nq && !(diag && key > qi);
        const float p = live ? exp2f(sc[r][c] * s.scale_log2 - Ls[qi]) : 0.0f;
        Ps[qi * (kTile + 1) + key] = p * (dp[r][c] - Ds[qi]) * s.scale;
      }
    }
    __syncthreads();
#pragma unroll 4
    for (int key = 0; key < kTile; ++key) {
      float ds[kRows], kk[kCols];
#pragma unroll
      for (int r = 0; r < kRows; ++r) ds[r] = Ps[(ty + 16 * r) * (kTile + 1) + key];
#pragma unroll
      for (int c = 0; c < kCols; ++c) kk[c] = Ks[key * (D + 1) + tx + 16 * c];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < kCols; ++c) dq[r][c] = fmaf(ds[r], kk[c], dq[r][c]);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int qi = ty + 16 * r;
    if (qi >= nq) continue;
    T* row = dqkv + (int64_t{b} * s.T + i0 + qi) * s.W + int64_t{h} * s.HS;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = tx + 16 * c;
      if (d < s.HS) row[d] = narrow<T>(dq[r][c]);
    }
  }
}

// ---- tensor-core tiles (16-bit storage) -----------------------------------------------------
// The same blocks, tiles, loops and thread ownership as the kernels above, with the four tile
// products (S = Q K^T, dP = dO V^T, O += P V, dV += P^T dO, dK += dS^T Q, dQ += dS K) taken by
// WMMA 16 x 16 x 16 fragments (8 warps, fixed fragments per warp, fp32 accumulators, the sum over
// k in a fixed order: deterministic). q, k, v and dout stay in the storage type in shared memory
// (their bits copied, no conversion); P and dS are rounded to it before their products, as
// FlashAttention does; scores, the softmax and every accumulator are fp32. The element-wise steps
// (mask, softmax, P, dS) run on the 16 x 16 thread layout above, reading the products from shared
// memory, so no fragment's element layout is relied on.
//
// Shared-memory strides: 16-bit tiles [64][D + 8], S-like fp32 tiles [64][68], 16-bit P / dS
// [64][72], fp32 output staging [64][D + 4]: multiples of 8 (16-bit) and 4 (fp32) elements as
// WMMA's ldm must be, every fragment's first element on 32 bytes (16 rows of any of them are a
// multiple of 32 bytes, as is every region's size below), and rows shifted by 16 bytes against
// the banks.
constexpr int kLdS = kTile + 4;  // fp32 score tiles
constexpr int kLdP = kTile + 8;  // 16-bit P and dS tiles

template <typename T>
struct WmmaType;
template <>
struct WmmaType<bf16_t> {
  using type = __nv_bfloat16;
};
template <>
struct WmmaType<f16_t> {
  using type = __half;
};
template <typename T>
using Wt = typename WmmaType<T>::type;
template <typename T>
__device__ __forceinline__ const Wt<T>* wp(const T* p) {
  return reinterpret_cast<const Wt<T>*>(p);
}
using FragC = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>;
template <typename T, typename Layout>
using FragA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, Wt<T>, Layout>;
template <typename T, typename Layout>
using FragB = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, Wt<T>, Layout>;

// dst[r * ldd + d] = src[r * lds + d] (the bits) for r < rows and d < HS; zero elsewhere up to D.
// 16-byte loads (8 elements) when the head fills D and every row of src starts on 16 bytes (the
// usual case: HS 64 or 128 and an aligned qkv), else one element a thread. dst's rows (ldd = D +
// 8) and regions start on 16 bytes. The choice depends on the arguments only: uniform in a block.
template <int D, typename T>
__device__ __forceinline__ void load_tile16(T* dst, int ldd, const T* src, int64_t lds, int rows,
                                            int HS) {
  constexpr int kVec = 8;
  if (HS == D && lds % kVec == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    for (int idx = threadIdx.x; idx < kTile * D / kVec; idx += kThreads) {
      const int r = idx / (D / kVec), d = idx % (D / kVec) * kVec;
      uint4 x = make_uint4(0, 0, 0, 0);
      if (r < rows) x = *reinterpret_cast<const uint4*>(src + r * lds + d);
      *reinterpret_cast<uint4*>(dst + r * ldd + d) = x;
    }
    return;
  }
  for (int idx = threadIdx.x; idx < kTile * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    T x{0};
    if (r < rows && d < HS) x = src[r * lds + d];
    dst[r * ldd + d] = x;
  }
}

// C[64][64] (fp32, stride kLdS) = A B^T for A, B [64][D] (16-bit, stride D + 8): the warp's two
// output fragments, over the head dimension in order.
template <int D, typename T>
__device__ __forceinline__ void mma_abt(float* C, const T* A, const T* B) {
  using namespace nvcuda;
  constexpr int ld = D + 8;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int f = 2 * warp; f < 2 * warp + 2; ++f) {
    const int mi = f / 4, ni = f % 4;
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      FragA<T, wmma::row_major> a;
      FragB<T, wmma::col_major> b;  // B^T's (k, n) is B[n][k]
      wmma::load_matrix_sync(a, wp(A + mi * 16 * ld + kk * 16), ld);
      wmma::load_matrix_sync(b, wp(B + ni * 16 * ld + kk * 16), ld);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(C + mi * 16 * kLdS + ni * 16, acc, kLdS, wmma::mem_row_major);
  }
}

// acc (+)= A B for A [64][64] (16-bit, stride kLdP) and B [64][D] (16-bit, stride D + 8): the
// warp's D / 32 fragments of the [64][D] result, fragment f = warp * (D / 32) + i at block row
// f / (D / 16), block column f % (D / 16); over the 64 keys (or queries) in order.
template <int D, typename T>
__device__ __forceinline__ void mma_ab(FragC (&acc)[D / 32], const T* A, const T* B) {
  using namespace nvcuda;
  constexpr int ld = D + 8;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
    const int f = warp * (D / 32) + i, mi = f / (D / 16), ni = f % (D / 16);
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      FragA<T, wmma::row_major> a;
      FragB<T, wmma::row_major> b;
      wmma::load_matrix_sync(a, wp(A + mi * 16 * kLdP + kk * 16), kLdP);
      wmma::load_matrix_sync(b, wp(B + kk * 16 * ld + ni * 16), ld);
      wmma::mma_sync(acc[i], a, b, acc[i]);
    }
  }
}
// The fragments of mma_ab into C [64][D] (fp32, stride D + 4).
template <int D>
__device__ __forceinline__ void store_ab(float* C, const FragC (&acc)[D / 32]) {
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
    const int f = warp * (D / 32) + i, mi = f / (D / 16), ni = f % (D / 16);
    nvcuda::wmma::store_matrix_sync(C + mi * 16 * (D + 4) + ni * 16, acc[i], D + 4,
                                    nvcuda::wmma::mem_row_major);
  }
}
template <int D>
__device__ __forceinline__ void zero_ab(FragC (&acc)[D / 32]) {
#pragma unroll
  for (int i = 0; i < D / 32; ++i) nvcuda::wmma::fill_fragment(acc[i], 0.0f);
}

// rows [0, rows) of C [64][D] (fp32, stride D + 4), channels < HS, rounded into dst (row stride
// ld), on the 16 x 16 thread layout.
template <int D, typename T>
__device__ __forceinline__ void write_rows(T* dst, int64_t ld, const float* C, int rows, int HS) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = ty + 16 * r;
    if (row >= rows) continue;
#pragma unroll
    for (int c = 0; c < D / 16; ++c) {
      const int d = tx + 16 * c;
      if (d < HS) dst[row * ld + d] = narrow<T>(C[row * (D + 4) + d]);
    }
  }
}

template <int D>
constexpr size_t tc_tile16_bytes() {
  return size_t{2} * kTile * (D + 8);
}
template <int D>
constexpr size_t tc_forward_smem_bytes() {
  return 3 * tc_tile16_bytes<D>() + sizeof(float) * kTile * kLdS + 2 * kTile * kLdP +
         sizeof(float) * kTile * (D + 4);
}
template <int D>
constexpr size_t tc_backward_smem_bytes() {
  return 4 * tc_tile16_bytes<D>() + 2 * sizeof(float) * kTile * kLdS + 2 * 2 * kTile * kLdP +
         2 * sizeof(float) * kTile;
}
// The fp32 output staging [64][D + 4] of the backward kernels takes the place of two 16-bit tiles.
static_assert(2 * tc_tile16_bytes<64>() >= sizeof(float) * kTile * (64 + 4));
static_assert(2 * tc_tile16_bytes<128>() >= sizeof(float) * kTile * (128 + 4));

// The forward: as tiled_forward_kernel, S and P V on tensor cores. P V of each key tile goes to
// fp32 shared memory and is added to the register accumulator after its rescale.
template <int D, typename T>
__global__ void __launch_bounds__(kThreads)
    tc_forward_kernel(T* __restrict__ out, float* __restrict__ lse, const T* __restrict__ qkv,
                      Shape s) {
  constexpr int kCols = D / 16;
  constexpr int ld = D + 8;
  extern __shared__ __align__(128) unsigned char tc_smem[];
  T* Qh = reinterpret_cast<T*>(tc_smem);
  T* Kh = Qh + kTile * ld;
  T* Vh = Kh + kTile * ld;
  float* Sf = reinterpret_cast<float*>(Vh + kTile * ld);
  T* Ph = reinterpret_cast<T*>(Sf + kTile * kLdS);
  float* Of = reinterpret_cast<float*>(Ph + kTile * kLdP);
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / s.group;
  const int i0 = qt * kTile, nq = min(kTile, s.T - i0);
  const T* base = qkv + int64_t{b} * s.T * s.W;
  const T* k = base + int64_t{s.NH + kvh} * s.HS;
  const T* v = base + int64_t{s.NH + s.NKV + kvh} * s.HS;
  load_tile16<D>(Qh, ld, base + int64_t{i0} * s.W + int64_t{h} * s.HS, s.W, nq, s.HS);

  float m[kRows], l[kRows], o[kRows][kCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) o[r][c] = 0.0f;
  }
  for (int kt = 0; kt <= qt; ++kt) {
    const int j0 = kt * kTile, nk = min(kTile, s.T - j0);
    __syncthreads();  // the previous tile's reads of Kh, Vh and Of are done
    load_tile16<D>(Kh, ld, k + int64_t{j0} * s.W, s.W, nk, s.HS);
    load_tile16<D>(Vh, ld, v + int64_t{j0} * s.W, s.W, nk, s.HS);
    __syncthreads();
    mma_abt<D>(Sf, Qh, Kh);
    __syncthreads();
    const bool diag = kt == qt;  // the mask as in tiled_forward_kernel
    float alpha[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = ty + 16 * r;
      float x[kRows];
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < kRows; ++c) {
        const int col = tx + 16 * c;
        x[c] = (diag && col > row) ? -INFINITY : Sf[row * kLdS + col] * s.scale_log2;
        mx = fmaxf(mx, x[c]);
      }
      mx = row_max16(mx);
      const float m_new = fmaxf(m[r], mx);
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < kRows; ++c) {
        const float p = exp2f(x[c] - m_new);
        Ph[row * kLdP + tx + 16 * c] = narrow<T>(p);
        sum += p;
      }
      sum = row_sum16(sum);
      alpha[r] = exp2f(m[r] - m_new);
      l[r] = l[r] * alpha[r] + sum;
      m[r] = m_new;
    }
    __syncthreads();
    {
      FragC pv[D / 32];
      zero_ab<D>(pv);
      mma_ab<D>(pv, Ph, Vh);
      store_ab<D>(Of, pv);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        o[r][c] = fmaf(o[r][c], alpha[r], Of[(ty + 16 * r) * (D + 4) + tx + 16 * c]);
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = ty + 16 * r;
    if (row >= nq) continue;
    const float inv = 1.0f / l[r];
    T* orow = out + (int64_t{b} * s.T + i0 + row) * s.C + int64_t{h} * s.HS;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = tx + 16 * c;
      if (d < s.HS) orow[d] = narrow<T>(o[r][c] * inv);
    }
    if (tx == 0) lse[(int64_t{b} * s.NH + h) * s.T + i0 + row] = (m[r] + log2f(l[r])) * kLn2;
  }
}

// Loads a query tile's rows of head h for the tensor-core backward (16-bit q and dout).
template <int D, typename T>
__device__ __forceinline__ void load_query_side16(T* Qh, T* dOh, float* Ls, float* Ds, const T* qkv,
                                                  const T* dout, const float* lse,
                                                  const float* Drow, const Shape& s, int b, int h,
                                                  int i0, int nq) {
  load_tile16<D>(Qh, D + 8, qkv + (int64_t{b} * s.T + i0) * s.W + int64_t{h} * s.HS, s.W, nq, s.HS);
  load_tile16<D>(dOh, D + 8, dout + (int64_t{b} * s.T + i0) * s.C + int64_t{h} * s.HS, s.C, nq,
                 s.HS);
  if (threadIdx.x < kTile) {
    const int r = threadIdx.x;
    const int64_t at = (int64_t{b} * s.NH + h) * s.T + i0 + r;
    Ls[r] = r < nq ? lse[at] * kLog2e : 0.0f;
    Ds[r] = r < nq ? Drow[at] : 0.0f;
  }
}

// dK and dV as tiled_backward_dkdv_kernel, with S^T = K Q^T, dP^T = V dO^T, dV += P^T dO and
// dK += dS^T Q on tensor cores; dK and dV stay in fragments for the whole group.
template <int D, typename T>
__global__ void __launch_bounds__(kThreads)
    tc_backward_dkdv_kernel(T* __restrict__ dqkv, const T* __restrict__ dout,
                            const T* __restrict__ qkv, const float* __restrict__ lse,
                            const float* __restrict__ Drow, Shape s) {
  constexpr int ld = D + 8;
  extern __shared__ __align__(128) unsigned char tc_smem[];
  T* Kh = reinterpret_cast<T*>(tc_smem);
  T* Vh = Kh + kTile * ld;
  T* Qh = Vh + kTile * ld;
  T* dOh = Qh + kTile * ld;
  float* St = reinterpret_cast<float*>(dOh + kTile * ld);
  float* dPt = St + kTile * kLdS;
  T* Ph = reinterpret_cast<T*>(dPt + kTile * kLdS);
  T* dSh = Ph + kTile * kLdP;
  float* Ls = reinterpret_cast<float*>(dSh + kTile * kLdP);
  float* Ds = Ls + kTile;
  float* staging = reinterpret_cast<float*>(Qh);  // [64][D + 4] over Qh and dOh, at the end
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int kt = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int j0 = kt * kTile, nk = min(kTile, s.T - j0);
  const int nqt = (s.T + kTile - 1) / kTile;
  const T* base = qkv + int64_t{b} * s.T * s.W;
  const int64_t koff = int64_t{s.NH + kvh} * s.HS, voff = int64_t{s.NH + s.NKV + kvh} * s.HS;
  load_tile16<D>(Kh, ld, base + int64_t{j0} * s.W + koff, s.W, nk, s.HS);
  load_tile16<D>(Vh, ld, base + int64_t{j0} * s.W + voff, s.W, nk, s.HS);

  FragC dk[D / 32], dv[D / 32];
  zero_ab<D>(dk);
  zero_ab<D>(dv);
  for (int g = 0; g < s.group; ++g) {
    const int h = kvh * s.group + g;
    for (int qt = kt; qt < nqt; ++qt) {
      const int i0 = qt * kTile, nq = min(kTile, s.T - i0);
      __syncthreads();  // the previous tile's reads of Qh, dOh, Ph, dSh, Ls and Ds are done
      load_query_side16<D>(Qh, dOh, Ls, Ds, qkv, dout, lse, Drow, s, b, h, i0, nq);
      __syncthreads();
      mma_abt<D>(St, Kh, Qh);
      mma_abt<D>(dPt, Vh, dOh);
      __syncthreads();
      const bool diag = qt == kt;  // the mask as in tiled_backward_dkdv_kernel
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int key = ty + 16 * r;
#pragma unroll
        for (int c = 0; c < kRows; ++c) {
          const int qi = tx + 16 * c;
          const bool live = qi < nq && !(diag && key > qi);
          const float p = live ? exp2f(St[key * kLdS + qi] * s.scale_log2 - Ls[qi]) : 0.0f;
          Ph[key * kLdP + qi] = narrow<T>(p);
          dSh[key * kLdP + qi] = narrow<T>(p * (dPt[key * kLdS + qi] - Ds[qi]) * s.scale);
        }
      }
      __syncthreads();
      mma_ab<D>(dv, Ph, dOh);
      mma_ab<D>(dk, dSh, Qh);
    }
  }
  __syncthreads();  // the last products' reads of Qh and dOh are done: the staging takes them
  T* rows = dqkv + (int64_t{b} * s.T + j0) * s.W;
  store_ab<D>(staging, dk);
  __syncthreads();
  write_rows<D>(rows + koff, s.W, staging, nk, s.HS);
  __syncthreads();
  store_ab<D>(staging, dv);
  __syncthreads();
  write_rows<D>(rows + voff, s.W, staging, nk, s.HS);
}

// dQ as tiled_backward_dq_kernel, with S = Q K^T, dP = dO V^T and dQ += dS K on tensor cores.
template <int D, typename T>
__global__ void __launch_bounds__(kThreads, 2)
    tc_backward_dq_kernel(T* __restrict__ dqkv, const T* __restrict__ dout,
                          const T* __restrict__ qkv, const float* __restrict__ lse,
                          const float* __restrict__ Drow, Shape s) {
  constexpr int ld = D + 8;
  extern __shared__ __align__(128) unsigned char tc_smem[];
  T* Kh = reinterpret_cast<T*>(tc_smem);
  T* Vh = Kh + kTile * ld;
  T* Qh = Vh + kTile * ld;
  T* dOh = Qh + kTile * ld;
  float* Sf = reinterpret_cast<float*>(dOh + kTile * ld);
  float* dPf = Sf + kTile * kLdS;
  T* dSh = reinterpret_cast<T*>(dPf + kTile * kLdS);
  float* Ls = reinterpret_cast<float*>(dSh + 2 * kTile * kLdP);  // (the dkdv kernel's layout)
  float* Ds = Ls + kTile;
  float* staging = reinterpret_cast<float*>(Kh);  // [64][D + 4] over Kh and Vh, at the end
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / s.group;
  const int i0 = qt * kTile, nq = min(kTile, s.T - i0);
  const T* base = qkv + int64_t{b} * s.T * s.W;
  const int64_t koff = int64_t{s.NH + kvh} * s.HS, voff = int64_t{s.NH + s.NKV + kvh} * s.HS;
  load_query_side16<D>(Qh, dOh, Ls, Ds, qkv, dout, lse, Drow, s, b, h, i0, nq);

  FragC dq[D / 32];
  zero_ab<D>(dq);
  for (int kt = 0; kt <= qt; ++kt) {
    const int j0 = kt * kTile, nk = min(kTile, s.T - j0);
    __syncthreads();  // the previous tile's reads of Kh and dSh are done
    load_tile16<D>(Kh, ld, base + int64_t{j0} * s.W + koff, s.W, nk, s.HS);
    load_tile16<D>(Vh, ld, base + int64_t{j0} * s.W + voff, s.W, nk, s.HS);
    __syncthreads();
    mma_abt<D>(Sf, Qh, Kh);
    mma_abt<D>(dPf, dOh, Vh);
    __syncthreads();
    const bool diag = kt == qt;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int qi = ty + 16 * r;
#pragma unroll
      for (int c = 0; c < kRows; ++c) {
        const int key = tx + 16 * c;
        const bool live = qi < nq && !(diag && key > qi);
        const float p = live ? exp2f(Sf[qi * kLdS + key] * s.scale_log2 - Ls[qi]) : 0.0f;
        dSh[qi * kLdP + key] = narrow<T>(p * (dPf[qi * kLdS + key] - Ds[qi]) * s.scale);
      }
    }
    __syncthreads();
    mma_ab<D>(dq, dSh, Kh);
  }
  __syncthreads();  // the last product's reads of Kh are done: the staging takes Kh and Vh
  store_ab<D>(staging, dq);
  __syncthreads();
  write_rows<D>(dqkv + (int64_t{b} * s.T + i0) * s.W + int64_t{h} * s.HS, s.W, staging, nq, s.HS);
}

// ---- launches ------------------------------------------------------------------------------
// The widest head the kernels take: heads are padded with zeros to 64 or 128 channels.
constexpr int kMaxTiledHeadSize = 128;

// The shapes, checked: what the op table's callers may get wrong is named with its value.
Shape make_shape(const char* op, int B, int T, int C, int NH, int NKV) {
  auto fail = [&](const std::string& why) {
    const std::string msg = std::string(op) + " (CUDA): " + why + " (B=" + std::to_string(B) +
                            " T=" + std::to_string(T) + " C=" + std::to_string(C) +
                            " NH=" + std::to_string(NH) + " NKV=" + std::to_string(NKV) + ")";
    HR_CHECK_MSG(false, msg.c_str());
  };
  if (B < 0 || T < 0 || NH <= 0 || NKV <= 0 || C <= 0) fail("shapes must be positive");
  if (NH % NKV != 0) fail("NH must be a multiple of NKV");
  if (C % NH != 0) fail("C must be a multiple of NH");
  const int HS = C / NH;
  if (HS > kMaxTiledHeadSize) {
    fail("head size " + std::to_string(HS) + " is above the tiled kernels' " +
         std::to_string(kMaxTiledHeadSize) + "; use the plain attention (fp32) for it");
  }
  if (NH > 65535 || B > 65535) fail("NH and B must be at most 65535 (grid dimensions)");
  Shape s;
  s.B = B;
  s.T = T;
  s.NH = NH;
  s.NKV = NKV;
  s.HS = HS;
  s.group = NH / NKV;
  s.W = int64_t{NH + 2 * NKV} * HS;
  s.C = C;
  s.scale = 1.0f / std::sqrt(float(HS));
  s.scale_log2 = s.scale * kLog2e;
  return s;
}

// Opts a kernel into `bytes` of dynamic shared memory, after checking that the device has them.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes, const Context& ctx, const char* op) {
  if (bytes > ctx.props.sharedMemPerBlockOptin) {
    const std::string msg = std::string(op) + " (CUDA): the tiled kernel needs " +
                            std::to_string(bytes) + " bytes of shared memory a block; " +
                            ctx.props.name + " has " +
                            std::to_string(ctx.props.sharedMemPerBlockOptin);
    HR_CHECK_MSG(false, msg.c_str());
  }
  HR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(bytes)));
}

// The kernel asked for: HEADROOM_CUDA_ATTENTION (auto, tensor-cores or fp32; read once, to
// compare the two in whole training steps), then set_tiled_attention_kernel.
TiledAttentionKernel kernel_from_env() {
  const char* v = std::getenv("HEADROOM_CUDA_ATTENTION");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return TiledAttentionKernel::kAuto;
  if (std::strcmp(v, "tensor-cores") == 0) return TiledAttentionKernel::kTensorCores;
  if (std::strcmp(v, "fp32") == 0) return TiledAttentionKernel::kFp32Tiles;
  throw std::invalid_argument(std::string("HEADROOM_CUDA_ATTENTION=") + v +
                              ": expected auto, tensor-cores or fp32");
}
std::atomic<int> g_kernel{-1};  // -1: not yet read from the environment

// Whether 16-bit storage takes the tensor-core kernels now.
bool use_tensor_cores() {
  int k = g_kernel.load(std::memory_order_relaxed);
  if (k < 0) {
    const int from_env = static_cast<int>(kernel_from_env());
    g_kernel.compare_exchange_strong(k, from_env, std::memory_order_relaxed);
    k = g_kernel.load(std::memory_order_relaxed);
  }
  return static_cast<TiledAttentionKernel>(k) != TiledAttentionKernel::kFp32Tiles;
}

// Opts the kernel into its shared memory once (the first launch; checked against the device),
// then launches it on the compute stream.
template <auto kKernel>
void launch(dim3 grid, size_t smem, const Context& ctx, const char* op, auto... args) {
  static const bool ready = (allow_smem(kKernel, smem, ctx, op), true);
  (void)ready;
  kKernel<<<grid, kThreads, smem, ctx.compute>>>(args...);
  HR_CUDA_LAUNCH_CHECK();
}

template <int D, typename T>
void launch_forward(T* out, float* lse, const T* qkv, const Shape& s, const Context& ctx) {
  const dim3 grid((s.T + kTile - 1) / kTile, s.NH, s.B);
  if constexpr (!std::is_same_v<T, float>) {
    if (use_tensor_cores()) {
      launch<tc_forward_kernel<D, T>>(grid, tc_forward_smem_bytes<D>(), ctx,
                                      "attention_tiled_forward", out, lse, qkv, s);
      return;
    }
  }
  launch<tiled_forward_kernel<D, T>>(grid, forward_smem_bytes<D>(), ctx, "attention_tiled_forward",
                                     out, lse, qkv, s);
}

template <int D, typename T>
void launch_backward(T* dqkv, const T* dout, const T* qkv, const float* lse, const float* Drow,
                     const Shape& s, const Context& ctx) {
  const int tiles = (s.T + kTile - 1) / kTile;
  const dim3 kv_grid(tiles, s.NKV, s.B), q_grid(tiles, s.NH, s.B);
  const char* op = "attention_tiled_backward";
  if constexpr (!std::is_same_v<T, float>) {
    if (use_tensor_cores()) {
      constexpr size_t smem = tc_backward_smem_bytes<D>();
      launch<tc_backward_dkdv_kernel<D, T>>(kv_grid, smem, ctx, op, dqkv, dout, qkv, lse, Drow, s);
      launch<tc_backward_dq_kernel<D, T>>(q_grid, smem, ctx, op, dqkv, dout, qkv, lse, Drow, s);
      return;
    }
  }
  constexpr size_t smem = backward_smem_bytes<D>();
  launch<tiled_backward_dkdv_kernel<D, T>>(kv_grid, smem, ctx, op, dqkv, dout, qkv, lse, Drow, s);
  launch<tiled_backward_dq_kernel<D, T>>(q_grid, smem, ctx, op, dqkv, dout, qkv, lse, Drow, s);
}

template <typename T>
void tiled_forward(T* out, float* lse, const T* qkv, int B, int T_, int C, int NH, int NKV,
                   const Context& ctx) {
  const Shape s = make_shape("attention_tiled_forward", B, T_, C, NH, NKV);
  if (B == 0 || T_ == 0) return;
  if (s.HS <= 64) {
    launch_forward<64>(out, lse, qkv, s, ctx);
  } else {
    launch_forward<128>(out, lse, qkv, s, ctx);
  }
}

template <typename T>
void tiled_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const float* lse, int B,
                    int T_, int C, int NH, int NKV, float* scratch, const Context& ctx) {
  const Shape s = make_shape("attention_tiled_backward", B, T_, C, NH, NKV);
  if (B == 0 || T_ == 0) return;
  HR_CHECK_MSG(scratch != nullptr,
               "attention_tiled_backward (CUDA): the scratch (D, B*NH*T floats) is missing");
  // D first, in the scratch (attention_tiled_backward_scratch_floats), read by both kernels.
  constexpr int kRowsPerBlock = 8;  // warps of 256 threads
  const int64_t rows = int64_t{B} * T_ * NH;
  row_dot_kernel<T><<<unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock), 32 * kRowsPerBlock, 0,
                      ctx.compute>>>(scratch, dout, out, s);
  HR_CUDA_LAUNCH_CHECK();
  if (s.HS <= 64) {
    launch_backward<64>(dqkv, dout, qkv, lse, scratch, s, ctx);
  } else {
    launch_backward<128>(dqkv, dout, qkv, lse, scratch, s, ctx);
  }
}

}  // namespace

void set_tiled_attention_kernel(TiledAttentionKernel kernel) {
  g_kernel.store(static_cast<int>(kernel), std::memory_order_relaxed);
}
TiledAttentionKernel tiled_attention_kernel() {
  return use_tensor_cores() ? TiledAttentionKernel::kTensorCores : TiledAttentionKernel::kFp32Tiles;
}

// The forward needs no scratch (its tiles live in shared memory); the backward's holds D, one
// float per (b, query head, position).
size_t CudaOps::attention_tiled_scratch_floats(int, int, int, int, int, DType) const { return 0; }
size_t CudaOps::attention_tiled_backward_scratch_floats(int B, int T, int, int NH, int,
                                                        DType) const {
  return size_t(B) * size_t(NH) * size_t(T);
}

#define HR_CUDA_TILED(T)                                                                          \
  void CudaOps::attention_tiled_forward(T* out, float* lse, const T* qkv, int B, int T_, int C,   \
                                        int NH, int NKV, float*) const {                          \
    tiled_forward(out, lse, qkv, B, T_, C, NH, NKV, ctx_);                                        \
  }                                                                                               \
  void CudaOps::attention_tiled_backward(T* dqkv, const T* dout, const T* qkv, const T* out,      \
                                         const float* lse, int B, int T_, int C, int NH, int NKV, \
                                         float* scratch) const {                                  \
    tiled_backward(dqkv, dout, qkv, out, lse, B, T_, C, NH, NKV, scratch, ctx_);                  \
  }
HR_CUDA_TILED(float)
HR_CUDA_TILED(bf16_t)
HR_CUDA_TILED(f16_t)
#undef HR_CUDA_TILED

}  // namespace headroom::backend::cuda
