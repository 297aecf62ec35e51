// Plain (fp32, the probabilities kept) and cached (generation) attention on CUDA
// (cuda_ops_impl.h); the tiled kernels are in attention_tiled.cu. These are the reference paths
// for small T and for decoding: simple kernels, one block per output row, every sum taken by one
// thread or one fixed reduction tree, so results do not depend on scheduling. See
// docs/notes/cuda.md, "## attention".
#include <cmath>
#include <cstdint>
#include <string>

#include "backend/cuda/cuda_ops_impl.h"
#include "core/check.h"

namespace headroom::backend::cuda {
namespace {

constexpr int kThreads = 128;  // every kernel of this file
constexpr int kWarps = kThreads / 32;
// The largest head size of the cached attention (as the CPU's kMaxCachedHeadSize): its query row
// and accumulator live in shared memory.
constexpr int kMaxCachedHeadSize = 512;

// Block-wide reductions over kThreads threads in a fixed tree (shuffles within warps, then the
// warps' partials in order): every thread gets the same bits, whatever the scheduling. `red` is
// kWarps floats of shared memory; the call synchronizes the block twice.
__device__ __forceinline__ float block_sum(float x, float* red) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  float total = red[0];
  for (int w = 1; w < kWarps; ++w) total += red[w];
  __syncthreads();  // red may be reused at once
  return total;
}
__device__ __forceinline__ float block_max(float x, float* red) {
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  float total = red[0];
  for (int w = 1; w < kWarps; ++w) total = fmaxf(total, red[w]);
  __syncthreads();
  return total;
}

__device__ __forceinline__ float dot(const float* a, const float* b, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s = fmaf(a[i], b[i], s);
  return s;
}

// The shapes of the plain kernels: W = qkv's row ((NH + 2 NKV) HS), C = out's row (NH HS).
struct Plain {
  int B, T, NH, NKV, HS, group;
  int64_t W, C;
  float scale;
};

// ---- plain forward: block (t, h, b), one query row ------------------------------------------
// Scores into the row of att, then its max, exp and sum, the row normalised (zeros past the
// diagonal, as the CPU's), then out = P v by one thread per channel, positions in order.
// Dynamic shared memory: HS floats (the query row).
__global__ void __launch_bounds__(kThreads)
    plain_forward_kernel(float* __restrict__ out, float* __restrict__ att,
                         const float* __restrict__ qkv, Plain s) {
  extern __shared__ float q[];
  __shared__ float red[kWarps];
  const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / s.group;
  const float* base = qkv + int64_t{b} * s.T * s.W;
  const float* k = base + int64_t{s.NH + kvh} * s.HS;
  const float* v = base + int64_t{s.NH + s.NKV + kvh} * s.HS;
  for (int d = threadIdx.x; d < s.HS; d += kThreads) q[d] = base[int64_t{t} * s.W + h * s.HS + d];
  __syncthreads();
  float* row = att + ((int64_t{b} * s.NH + h) * s.T + t) * s.T;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j <= t; j += kThreads) {
    const float x = dot(q, k + int64_t{j} * s.W, s.HS) * s.scale;
    row[j] = x;
    mx = fmaxf(mx, x);
  }
  mx = block_max(mx, red);
  float sum = 0.0f;
  for (int j = threadIdx.x; j <= t; j += kThreads) {  // each thread rereads its own entries
    const float e = expf(row[j] - mx);
    row[j] = e;
    sum += e;
  }
  const float inv = 1.0f / block_sum(sum, red);
  for (int j = threadIdx.x; j < s.T; j += kThreads) row[j] = j <= t ? row[j] * inv : 0.0f;
  __syncthreads();  // the row's global writes are visible to the block
  float* o = out + (int64_t{b} * s.T + t) * s.C + int64_t{h} * s.HS;
  for (int d = threadIdx.x; d < s.HS; d += kThreads) {
    float acc = 0.0f;
    for (int j = 0; j <= t; ++j) acc = fmaf(row[j], v[int64_t{j} * s.W + d], acc);
    o[d] = acc;
  }
}

// ---- plain backward ------------------------------------------------------------------------
// dq: block (t, h, b). dp_j = dy . v_j and D = sum_j p_j dp_j (the CPU's sum_pdp) first, D saved
// in the scratch for the dk/dv kernel; then, in chunks of kThreads positions (dp recomputed),
// dS_j = p_j (dp_j - D) scale through shared memory to dq = sum_j dS_j k_j, one thread per channel,
// positions in order. Dynamic shared memory: 2 HS floats (dy, the dq accumulator).
__global__ void __launch_bounds__(kThreads)
    plain_backward_dq_kernel(float* __restrict__ dqkv, float* __restrict__ Dsave,
                             const float* __restrict__ dout, const float* __restrict__ qkv,
                             const float* __restrict__ att, Plain s) {
  extern __shared__ float sh[];
  float* dy = sh;
  float* acc = sh + s.HS;
  __shared__ float chunk[kThreads];
  __shared__ float red[kWarps];
  const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / s.group;
  const float* base = qkv + int64_t{b} * s.T * s.W;
  const float* k = base + int64_t{s.NH + kvh} * s.HS;
  const float* v = base + int64_t{s.NH + s.NKV + kvh} * s.HS;
  const float* p = att + ((int64_t{b} * s.NH + h) * s.T + t) * s.T;
  const float* dyg = dout + (int64_t{b} * s.T + t) * s.C + int64_t{h} * s.HS;
  for (int d = threadIdx.x; d < s.HS; d += kThreads) {
    dy[d] = dyg[d];
    acc[d] = 0.0f;
  }
  __syncthreads();
  float part = 0.0f;
  for (int j = threadIdx.x; j <= t; j += kThreads) {
    part = fmaf(p[j], dot(dy, v + int64_t{j} * s.W, s.HS), part);
  }
  const float D = block_sum(part, red);
  if (threadIdx.x == 0) Dsave[(int64_t{b} * s.NH + h) * s.T + t] = D;
  for (int j0 = 0; j0 <= t; j0 += kThreads) {
    const int j = j0 + threadIdx.x;
    chunk[threadIdx.x] = j <= t ? p[j] * (dot(dy, v + int64_t{j} * s.W, s.HS) - D) * s.scale : 0.0f;
    __syncthreads();
    const int n = min(kThreads, t + 1 - j0);
    for (int d = threadIdx.x; d < s.HS; d += kThreads) {
      float a = acc[d];
      for (int c = 0; c < n; ++c) a = fmaf(chunk[c], k[int64_t{j0 + c} * s.W + d], a);
      acc[d] = a;
    }
    __syncthreads();  // chunk is rewritten next
  }
  float* dq = dqkv + (int64_t{b} * s.T + t) * s.W + int64_t{h} * s.HS;
  for (int d = threadIdx.x; d < s.HS; d += kThreads) dq[d] = acc[d];
}

// dk, dv: block (j, kv head, b), one key position. Over the group's query heads in order and the
// query positions t >= j in chunks: p_tj from att, dS_tj = p_tj (dy_t . v_j - D_t) scale through
// shared memory, dv_j += p_tj dy_t and dk_j += dS_tj q_t, one thread per channel, in order.
// Dynamic shared memory: 3 HS floats (v_j, the dk and dv accumulators).
__global__ void __launch_bounds__(kThreads)
    plain_backward_dkdv_kernel(float* __restrict__ dqkv, const float* __restrict__ Dsave,
                               const float* __restrict__ dout, const float* __restrict__ qkv,
                               const float* __restrict__ att, Plain s) {
  extern __shared__ float sh[];
  float* vj = sh;
  float* acck = sh + s.HS;
  float* accv = acck + s.HS;
  __shared__ float cp[kThreads], cds[kThreads];
  const int j = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const float* base = qkv + int64_t{b} * s.T * s.W;
  const int64_t koff = int64_t{s.NH + kvh} * s.HS, voff = int64_t{s.NH + s.NKV + kvh} * s.HS;
  for (int d = threadIdx.x; d < s.HS; d += kThreads) {
    vj[d] = base[int64_t{j} * s.W + voff + d];
    acck[d] = accv[d] = 0.0f;
  }
  __syncthreads();
  for (int g = 0; g < s.group; ++g) {
    const int h = kvh * s.group + g;
    const float* q = base + int64_t{h} * s.HS;
    const float* dy = dout + int64_t{b} * s.T * s.C + int64_t{h} * s.HS;
    const float* pcol = att + (int64_t{b} * s.NH + h) * s.T * s.T + j;  // p_tj at t * T
    const float* D = Dsave + (int64_t{b} * s.NH + h) * s.T;
    for (int t0 = j; t0 < s.T; t0 += kThreads) {
      const int t = t0 + threadIdx.x;
      float pv = 0.0f, dsv = 0.0f;
      if (t < s.T) {
        pv = pcol[int64_t{t} * s.T];
        dsv = pv * (dot(dy + int64_t{t} * s.C, vj, s.HS) - D[t]) * s.scale;
      }
      cp[threadIdx.x] = pv;
      cds[threadIdx.x] = dsv;
      __syncthreads();
      const int n = min(kThreads, s.T - t0);
      for (int d = threadIdx.x; d < s.HS; d += kThreads) {
        float ak = acck[d], av = accv[d];
        for (int c = 0; c < n; ++c) {
          av = fmaf(cp[c], dy[int64_t{t0 + c} * s.C + d], av);
          ak = fmaf(cds[c], q[int64_t{t0 + c} * s.W + d], ak);
        }
        acck[d] = ak;
        accv[d] = av;
      }
      __syncthreads();
    }
  }
  float* row = dqkv + (int64_t{b} * s.T + j) * s.W;
  for (int d = threadIdx.x; d < s.HS; d += kThreads) {
    row[koff + d] = acck[d];
    row[voff + d] = accv[d];
  }
}

Plain plain_shape(const char* op, int B, int T, int C, int NH, int NKV) {
  auto fail = [&](const char* why) {
    const std::string msg = std::string(op) + " (CUDA): " + why + " (B=" + std::to_string(B) +
                            " T=" + std::to_string(T) + " C=" + std::to_string(C) +
                            " NH=" + std::to_string(NH) + " NKV=" + std::to_string(NKV) + ")";
    HR_CHECK_MSG(false, msg.c_str());
  };
  if (B < 0 || T < 0 || NH <= 0 || NKV <= 0 || C <= 0) fail("shapes must be positive");
  if (NH % NKV != 0) fail("NH must be a multiple of NKV");
  if (C % NH != 0) fail("C must be a multiple of NH");
  if (NH > 65535 || B > 65535) fail("NH and B must be at most 65535 (grid dimensions)");
  // Three HS-float rows of shared memory at most, within the default 48 KiB.
  if (C / NH > 2048) fail("the head size must be at most 2048");
  Plain s;
  s.B = B;
  s.T = T;
  s.NH = NH;
  s.NKV = NKV;
  s.HS = C / NH;
  s.group = NH / NKV;
  s.W = int64_t{NH + 2 * NKV} * s.HS;
  s.C = C;
  s.scale = 1.0f / std::sqrt(float(s.HS));
  return s;
}

// ---- cached attention ----------------------------------------------------------------------
// k_cache / v_cache[g, pos0 + r, :] = the k / v heads of qkv row r (one thread per element).
__global__ void cache_append_kernel(float* __restrict__ k_cache, float* __restrict__ v_cache,
                                    const float* __restrict__ qkv, int rows, int pos0, int context,
                                    int NH, int NKV, int HS) {
  const int64_t per_row = int64_t{NKV} * HS;
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= int64_t{rows} * per_row) return;
  const int64_t r = i / per_row, gd = i % per_row;
  const int64_t g = gd / HS, d = gd % HS;
  const float* row = qkv + r * int64_t{NH + 2 * NKV} * HS + int64_t{NH} * HS;
  const int64_t at = (g * context + pos0 + r) * HS + d;
  k_cache[at] = row[gd];
  v_cache[at] = row[per_row + gd];
}

// Block (r, h): row r's query head h over the cached positions 0 .. pos0 + r of kv head
// h / (NH / NKV), in chunks of kThreads positions (one score per thread), with an online softmax
// across chunks (the running max rescales the sum and the accumulator), so no scores buffer
// bounds the context. Dynamic shared memory: 2 HS floats (q, the accumulator).
__global__ void __launch_bounds__(kThreads)
    cached_attend_kernel(float* __restrict__ out, const float* __restrict__ k_cache,
                         const float* __restrict__ v_cache, const float* __restrict__ qkv, int pos0,
                         int context, int NH, int NKV, int HS, float scale) {
  extern __shared__ float sh[];
  float* q = sh;
  float* acc = sh + HS;
  __shared__ float chunk[kThreads];
  __shared__ float red[kWarps];
  const int r = blockIdx.x, h = blockIdx.y, g = h / (NH / NKV);
  const float* qg = qkv + int64_t{r} * (NH + 2 * NKV) * HS + int64_t{h} * HS;
  const float* k = k_cache + int64_t{g} * context * HS;
  const float* v = v_cache + int64_t{g} * context * HS;
  for (int d = threadIdx.x; d < HS; d += kThreads) {
    q[d] = qg[d];
    acc[d] = 0.0f;
  }
  __syncthreads();
  const int last = pos0 + r;
  float m = -INFINITY, sum = 0.0f;
  for (int t0 = 0; t0 <= last; t0 += kThreads) {
    const int t = t0 + threadIdx.x;
    const float x = t <= last ? dot(q, k + int64_t{t} * HS, HS) * scale : -INFINITY;
    const float m_new = fmaxf(m, block_max(x, red));  // finite: position t0 is in the chunk
    const float p = expf(x - m_new);                  // 0 past the last position
    chunk[threadIdx.x] = p;
    const float c = expf(m - m_new);    // 0 on the first chunk
    sum = sum * c + block_sum(p, red);  // (its barrier also publishes chunk)
    m = m_new;
    const int n = min(kThreads, last + 1 - t0);
    for (int d = threadIdx.x; d < HS; d += kThreads) {
      float a = acc[d] * c;
      for (int j = 0; j < n; ++j) a = fmaf(chunk[j], v[int64_t{t0 + j} * HS + d], a);
      acc[d] = a;
    }
    __syncthreads();  // chunk is rewritten next
  }
  float* o = out + int64_t{r} * NH * HS + int64_t{h} * HS;
  const float inv = 1.0f / sum;
  for (int d = threadIdx.x; d < HS; d += kThreads) o[d] = acc[d] * inv;
}

}  // namespace

size_t CudaOps::attention_backward_scratch_floats(int B, int T, int NH, int) const {
  // D, one float per (b, query head, position), as the CPU's size.
  return size_t(B) * size_t(NH) * size_t(T);
}

void CudaOps::attention_forward(float* out, float* att, const float* qkv, int B, int T, int C,
                                int NH, int NKV) const {
  const Plain s = plain_shape("attention_forward", B, T, C, NH, NKV);
  if (B == 0 || T == 0) return;
  plain_forward_kernel<<<dim3(T, NH, B), kThreads, sizeof(float) * s.HS, stream()>>>(out, att, qkv,
                                                                                     s);
  HR_CUDA_LAUNCH_CHECK();
}

void CudaOps::attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                                 const float* att, int B, int T, int C, int NH, int NKV) const {
  const Plain s = plain_shape("attention_backward", B, T, C, NH, NKV);
  if (B == 0 || T == 0) return;
  HR_CHECK_MSG(scratch != nullptr,
               "attention_backward (CUDA): the scratch (B*NH*T floats) is missing");
  plain_backward_dq_kernel<<<dim3(T, NH, B), kThreads, 2 * sizeof(float) * s.HS, stream()>>>(
      dqkv, scratch, dout, qkv, att, s);
  HR_CUDA_LAUNCH_CHECK();
  plain_backward_dkdv_kernel<<<dim3(T, NKV, B), kThreads, 3 * sizeof(float) * s.HS, stream()>>>(
      dqkv, scratch, dout, qkv, att, s);
  HR_CUDA_LAUNCH_CHECK();
}

int CudaOps::max_cached_head_size() const { return kMaxCachedHeadSize; }

void CudaOps::attention_cached_forward(float* out, float* k_cache, float* v_cache, const float* qkv,
                                       int rows, int pos0, int context, int NH, int NKV,
                                       int HS) const {
  if (!(rows >= 0 && pos0 >= 0 && int64_t{pos0} + rows <= context && NKV > 0 && NH % NKV == 0 &&
        HS > 0 && HS <= kMaxCachedHeadSize && NH <= 65535)) {
    const std::string msg =
        "attention_cached_forward (CUDA): needs 0 <= pos0, pos0 + rows <= context, NH a multiple "
        "of NKV (NH <= 65535) and 0 < HS <= " +
        std::to_string(kMaxCachedHeadSize) + " (rows=" + std::to_string(rows) +
        " pos0=" + std::to_string(pos0) + " context=" + std::to_string(context) +
        " NH=" + std::to_string(NH) + " NKV=" + std::to_string(NKV) + " HS=" + std::to_string(HS) +
        ")";
    HR_CHECK_MSG(false, msg.c_str());
  }
  if (rows == 0) return;
  const int64_t n = int64_t{rows} * NKV * HS;
  constexpr int kAppendThreads = 256;
  cache_append_kernel<<<unsigned((n + kAppendThreads - 1) / kAppendThreads), kAppendThreads, 0,
                        stream()>>>(k_cache, v_cache, qkv, rows, pos0, context, NH, NKV, HS);
  HR_CUDA_LAUNCH_CHECK();
  cached_attend_kernel<<<dim3(rows, NH), kThreads, 2 * sizeof(float) * HS, stream()>>>(
      out, k_cache, v_cache, qkv, pos0, context, NH, NKV, HS, 1.0f / std::sqrt(float(HS)));
  HR_CUDA_LAUNCH_CHECK();
}

}  // namespace headroom::backend::cuda
