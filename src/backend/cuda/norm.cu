// LayerNorm and RMSNorm of the CUDA op table (cuda_ops_impl.h), forward and backward for every
// storage type: a block per row with fixed-order block reductions, and parameter gradients summed
// deterministically (per-chunk partial sums over a fixed partition of the rows into the op
// workspace, then one ordered reduction adding them into dweight / dbias). See the
// "elementwise" section of docs/notes/cuda.md.
#include "backend/cuda/elementwise_common.cuh"

namespace headroom::backend::cuda {
namespace {

using elem::from_f32;
using elem::to_f32;

constexpr int kThreads = 256;
constexpr float kLnEps = 1e-5f;  // GPT-2's, as cpu::layernorm_forward
// The row chunks of the parameter gradients: min(N, kParamChunks), chunk p holding rows
// [p N / P, (p + 1) N / P). Fixed by N, so the sums do not depend on the device or the grid.
constexpr int64_t kParamChunks = 256;

// Forward, one block per row (blockIdx.x; N <= INT_MAX rows). LayerNorm: two-pass mean and
// variance (the second pass reads the row again, from L1/L2); RMSNorm: the mean square.
template <bool kRms, typename TOut>
__global__ void norm_forward_kernel(TOut* out, float* mean, float* rstd, const float* inp,
                                    const float* weight, const float* bias, int C, float eps) {
  __shared__ float sh[32];
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  TOut* o = out + n * C;
  float m = 0.0f, r;
  if constexpr (kRms) {
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += x[c] * x[c];
    r = 1.0f / sqrtf(elem::block_reduce(s, elem::Sum{}, sh) / float(C) + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = from_f32<TOut>((x[c] * r) * weight[c]);
  } else {
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += x[c];
    m = elem::block_reduce(s, elem::Sum{}, sh) / float(C);
    float v = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) v += (x[c] - m) * (x[c] - m);
    r = 1.0f / sqrtf(elem::block_reduce(v, elem::Sum{}, sh) / float(C) + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float y = (x[c] - m) * r * weight[c];
      o[c] = from_f32<TOut>(bias != nullptr ? y + bias[c] : y);
    }
  }
  if (threadIdx.x == 0) {
    if constexpr (!kRms) mean[n] = m;
    rstd[n] = r;
  }
}

// The input gradient, one block per row; dinp ACCUMULATES (the residual stream's gradient), and
// with lo the updated value rounded to TL there too.
//   LayerNorm: dx += (dy w - mean(dy w) - norm mean(dy w norm)) r, norm = (x - m) r
//   RMSNorm:   dx += (dy w - x r mean_gn) r, mean_gn = r mean(dy w x)
template <bool kRms, typename TD, typename TL>
__global__ void norm_backward_input_kernel(float* dinp, TL* lo, const TD* dout, const float* inp,
                                           const float* weight, const float* mean,
                                           const float* rstd, int C) {
  __shared__ float sh[32];
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  const TD* dy = dout + n * C;
  float* dx = dinp + n * C;
  const float r = rstd[n];
  const float m = kRms ? 0.0f : mean[n];
  float a = 0.0f, b = 0.0f;  // sums of dy w and dy w norm (RMSNorm: dy w x)
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float dn = to_f32(dy[c]) * weight[c];
    if constexpr (kRms) {
      b += dn * x[c];
    } else {
      a += dn;
      b += dn * ((x[c] - m) * r);
    }
  }
  if constexpr (!kRms) a = elem::block_reduce(a, elem::Sum{}, sh) / float(C);
  b = elem::block_reduce(b, elem::Sum{}, sh);
  b = kRms ? b * r / float(C) : b / float(C);
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float g = to_f32(dy[c]) * weight[c];
    const float v =
        kRms ? dx[c] + (g - x[c] * r * b) * r : dx[c] + (g - a - ((x[c] - m) * r) * b) * r;
    dx[c] = v;
    if (lo != nullptr) lo[n * C + c] = from_f32<TL>(v);
  }
}

// Chunk p's partial parameter gradients, one thread per channel summing the chunk's rows in
// order: part[p][c] = sum dy norm, part[p][C + c] = sum dy (LayerNorm only). blockIdx.y = p.
template <bool kRms, typename TD>
__global__ void norm_param_partial_kernel(float* part, const TD* dout, const float* inp,
                                          const float* mean, const float* rstd, int64_t N, int C,
                                          int64_t chunks) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t p = blockIdx.y;
  const int64_t n0 = p * N / chunks, n1 = (p + 1) * N / chunks;
  float aw = 0.0f, ab = 0.0f;
  for (int64_t n = n0; n < n1; ++n) {
    const float d = to_f32(dout[n * C + c]);
    const float x = inp[n * C + c];
    const float norm = kRms ? x * rstd[n] : (x - mean[n]) * rstd[n];
    aw += d * norm;
    ab += d;
  }
  const int64_t width = kRms ? C : 2 * int64_t(C);
  part[p * width + c] = aw;
  if constexpr (!kRms) part[p * width + C + c] = ab;
}

// dweight[c] (j < C) and dbias[c] (j = C + c) += the chunks' partials, added in chunk order.
__global__ void norm_param_reduce_kernel(float* dweight, float* dbias, const float* part, int C,
                                         int64_t width, int64_t chunks) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= width) return;
  float* dst = j < C ? (dweight != nullptr ? dweight + j : nullptr)
                     : (dbias != nullptr ? dbias + (j - C) : nullptr);
  if (dst == nullptr) return;
  float s = 0.0f;
  for (int64_t p = 0; p < chunks; ++p) s += part[p * width + j];
  *dst += s;
}

template <bool kRms, typename TOut>
void norm_forward(const CudaOps& ops, TOut* out, float* mean, float* rstd, const float* inp,
                  const float* weight, const float* bias, int N, int C, float eps) {
  HR_ELEM_REQUIRE(C > 0, kRms ? "rmsnorm_forward" : "layernorm_forward",
                  "C must be positive, got " + std::to_string(C));
  if (N <= 0) return;
  norm_forward_kernel<kRms>
      <<<unsigned(N), kThreads, 0, ops.stream()>>>(out, mean, rstd, inp, weight, bias, C, eps);
  HR_CUDA_LAUNCH_CHECK();
}

template <bool kRms, typename TD, typename TL = float>
void norm_backward(const CudaOps& ops, float* dinp, TL* dinp_low, float* dweight, float* dbias,
                   const TD* dout, const float* inp, const float* weight, const float* mean,
                   const float* rstd, int N, int C) {
  const char* op = kRms ? "rmsnorm_backward" : "layernorm_backward";
  HR_ELEM_REQUIRE(C > 0, op, "C must be positive, got " + std::to_string(C));
  if (N <= 0) return;
  if (dinp != nullptr) {
    norm_backward_input_kernel<kRms><<<unsigned(N), kThreads, 0, ops.stream()>>>(
        dinp, dinp_low, dout, inp, weight, mean, rstd, C);
    HR_CUDA_LAUNCH_CHECK();
  }
  if (dweight == nullptr && dbias == nullptr) return;
  const int64_t chunks = std::min<int64_t>(N, kParamChunks);
  const int64_t width = kRms ? C : 2 * int64_t(C);
  auto* part =
      static_cast<float*>(elem::op_workspace(ops, size_t(chunks * width) * sizeof(float), op));
  const dim3 grid(unsigned((C + kThreads - 1) / kThreads), unsigned(chunks));
  norm_param_partial_kernel<kRms>
      <<<grid, kThreads, 0, ops.stream()>>>(part, dout, inp, mean, rstd, N, C, chunks);
  HR_CUDA_LAUNCH_CHECK();
  norm_param_reduce_kernel<<<unsigned((width + kThreads - 1) / kThreads), kThreads, 0,
                             ops.stream()>>>(dweight, kRms ? nullptr : dbias, part, C, width,
                                             chunks);
  HR_CUDA_LAUNCH_CHECK();
}

}  // namespace

#define HR_NORM_T(T)                                                                               \
  void CudaOps::layernorm_forward(T* out, float* mean, float* rstd, const float* inp,              \
                                  const float* weight, const float* bias, int N, int C) const {    \
    norm_forward<false>(*this, out, mean, rstd, inp, weight, bias, N, C, kLnEps);                  \
  }                                                                                                \
  void CudaOps::layernorm_backward(float* dinp, float* dweight, float* dbias, const T* dout,       \
                                   const float* inp, const float* weight, const float* mean,       \
                                   const float* rstd, int N, int C) const {                        \
    norm_backward<false>(*this, dinp, static_cast<float*>(nullptr), dweight, dbias, dout, inp,     \
                         weight, mean, rstd, N, C);                                                \
  }                                                                                                \
  void CudaOps::rmsnorm_forward(T* out, float* rstd, const float* inp, const float* weight, int N, \
                                int C, float eps) const {                                          \
    norm_forward<true>(*this, out, static_cast<float*>(nullptr), rstd, inp, weight,                \
                       static_cast<const float*>(nullptr), N, C, eps);                             \
  }                                                                                                \
  void CudaOps::rmsnorm_backward(float* dinp, float* dweight, const T* dout, const float* inp,     \
                                 const float* weight, const float* rstd, int N, int C) const {     \
    norm_backward<true>(*this, dinp, static_cast<float*>(nullptr), dweight,                        \
                        static_cast<float*>(nullptr), dout, inp, weight,                           \
                        static_cast<const float*>(nullptr), rstd, N, C);                           \
  }
HR_NORM_T(float)
HR_NORM_T(bf16_t)
HR_NORM_T(f16_t)
#undef HR_NORM_T

#define HR_NORM_LOW(T)                                                                            \
  void CudaOps::layernorm_backward(float* dinp, T* dinp_low, float* dweight, float* dbias,        \
                                   const T* dout, const float* inp, const float* weight,          \
                                   const float* mean, const float* rstd, int N, int C) const {    \
    HR_ELEM_REQUIRE(dinp != nullptr && dinp_low != nullptr, "layernorm_backward",                 \
                    "the 16-bit form needs dinp and dinp_low");                                   \
    norm_backward<false>(*this, dinp, dinp_low, dweight, dbias, dout, inp, weight, mean, rstd, N, \
                         C);                                                                      \
  }                                                                                               \
  void CudaOps::rmsnorm_backward(float* dinp, T* dinp_low, float* dweight, const T* dout,         \
                                 const float* inp, const float* weight, const float* rstd, int N, \
                                 int C) const {                                                   \
    HR_ELEM_REQUIRE(dinp != nullptr && dinp_low != nullptr, "rmsnorm_backward",                   \
                    "the 16-bit form needs dinp and dinp_low");                                   \
    norm_backward<true>(*this, dinp, dinp_low, dweight, static_cast<float*>(nullptr), dout, inp,  \
                        weight, static_cast<const float*>(nullptr), rstd, N, C);                  \
  }
HR_NORM_LOW(bf16_t)
HR_NORM_LOW(f16_t)
#undef HR_NORM_LOW

}  // namespace headroom::backend::cuda
