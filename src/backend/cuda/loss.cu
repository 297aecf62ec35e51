// Softmax cross-entropy over full logits for the CUDA op table (cuda_ops_impl.h): the forward,
// the in-place backward from the saved lse, and both in one kernel, with the gradient stored as
// cpu::cross_entropy_backward_inplace stores it (fp32, fp32 holding f16 values, or bf16 over the
// first half of each fp32 row). A block per row; the row's max and sum of exponentials online in
// fp32, combined by a fixed tree. See the "elementwise" section of docs/notes/cuda.md.
#include <cfloat>
#include <cstdio>

#include "backend/cuda/elementwise_common.cuh"

namespace headroom::backend::cuda {
namespace {

constexpr int kThreads = 512;
// Values per thread per step of the bf16 gradient (see ce_kernel).
constexpr int kBf16Per = 4;

enum Mode { kForward, kBackward, kForwardBackward };
enum Store { kStoreF32, kStoreF16Values, kStoreBF16 };

// (m, s) pairs: s = sum exp(x - m) over the values seen, m their max (-FLT_MAX before any, so
// that a -inf logit adds exp(-inf) = 0 rather than exp(-inf - -inf) = NaN).
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  s = s * expf(m - M) + s2 * expf(m2 - M);  // commutative: both lanes of a swap get the same bits
  m = M;
}
// The block's (m, s), in every thread, by a fixed tree (warp butterflies, then warps in order).
__device__ __forceinline__ void block_combine(float& m, float& s, float* sm, float* ss) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    combine(m, s, m2, s2);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  m = sm[0];
  s = ss[0];
  for (int w = 1; w < warps; ++w) combine(m, s, sm[w], ss[w]);
}

// One row per block (blockIdx.x). kForward: losses[n] (and lse[n] when lse_out is not null).
// kBackward: the gradient in place from lse_in. kForwardBackward: both, the statistics taken on
// the first read of the row, the gradient written on the second. The gradient of row n is
// d[j] = exp(x[j] - m) c - dloss [j == target], c = exp(m - l) dloss (cpu::ce_scale's form), or
// 0 for an ignored row (target -1).
//
// In place: with fp32 storage each thread reads and writes only its own elements. With bf16, row
// n's bf16 gradient covers the first half of its own fp32 row (bytes [0, 2 V)), so element j's
// store lands in float j / 2, which another thread may not have read yet: the row is walked in
// chunks of S = kBf16Per * blockDim.x floats, each chunk read whole into registers, then a
// __syncthreads, then written. Chunk k's stores fall in floats [k S / 2, (k + 1) S / 2), all
// below (k + 1) S, i.e. in chunks already read, and the barrier of each chunk orders every
// thread's reads of it before any store into it. The target's logit is read by every thread
// before the first barrier.
template <Mode kMode, Store kStore>
__global__ void __launch_bounds__(kThreads)
    ce_kernel(float* losses, float* lse_out, float* logits, const float* lse_in,
              const int32_t* targets, int V, int64_t ld, float dloss) {
  __shared__ float sm[32], ss[32];
  const int64_t n = blockIdx.x;
  float* x = logits + n * ld;
  const int32_t target = targets[n];
  if (target < -1 || target >= V) {
    if (threadIdx.x == 0) {
      printf(
          "headroom: cross-entropy target %d of row %lld is outside [-1, %d): the targets "
          "must be token ids below the vocabulary size, or -1 (ignored)\n",
          int(target), static_cast<long long>(n), V);
    }
    __trap();
  }
  if (target < 0) {  // ignored row: loss 0, lse 0, gradient 0
    if constexpr (kMode != kBackward) {
      if (threadIdx.x == 0) {
        losses[n] = 0.0f;
        if (lse_out != nullptr) lse_out[n] = 0.0f;
      }
    }
    if constexpr (kMode != kForward) {
      if constexpr (kStore == kStoreBF16) {
        bf16_t* d = reinterpret_cast<bf16_t*>(x);
        for (int j = threadIdx.x; j < V; j += blockDim.x) d[j] = bf16_t{0};
      } else {
        for (int j = threadIdx.x; j < V; j += blockDim.x) x[j] = 0.0f;
      }
    }
    return;
  }
  const float xt = x[target];  // before any store into the row (see above)
  float m = -FLT_MAX, l = 0.0f;
  if constexpr (kMode == kBackward) {
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, x[j]);
    m = elem::block_reduce(m, elem::Max{}, sm);
    l = lse_in[n];
  } else {
    float s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
      const float v = x[j];
      if (v > m) {
        s = s * expf(m - v) + 1.0f;
        m = v;
      } else {
        s += expf(v - m);
      }
    }
    block_combine(m, s, sm, ss);
    const double dl = log(static_cast<double>(s)) + m;  // as cpu::softmax_row_lse
    l = static_cast<float>(dl);
    if (threadIdx.x == 0) {
      losses[n] = static_cast<float>(dl - xt);
      if (lse_out != nullptr) lse_out[n] = l;
    }
  }
  if constexpr (kMode == kForward) return;
  const float c = expf(m - l) * dloss;
  const float dt = expf(xt - m) * c - dloss;
  if constexpr (kStore == kStoreBF16) {
    bf16_t* d = reinterpret_cast<bf16_t*>(x);
    const int chunk = kBf16Per * blockDim.x;
    for (int base = 0; base < V; base += chunk) {  // uniform trip count: every thread syncs
      float g[kBf16Per];
#pragma unroll
      for (int k = 0; k < kBf16Per; ++k) {
        const int j = base + k * blockDim.x + threadIdx.x;
        g[k] = j < V ? (j == target ? dt : expf(x[j] - m) * c) : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kBf16Per; ++k) {
        const int j = base + k * blockDim.x + threadIdx.x;
        if (j < V) d[j] = elem::from_f32<bf16_t>(g[k]);
      }
    }
  } else {
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
      const float g = j == target ? dt : expf(x[j] - m) * c;
      x[j] = kStore == kStoreF16Values ? elem::round_f16(g) : g;
    }
  }
}

template <Mode kMode>
void ce_launch(const CudaOps& ops, float* losses, float* lse_out, float* logits,
               const float* lse_in, const int32_t* targets, int N, int V, int64_t ld, float dloss,
               DType storage, const char* op) {
  if (ld == 0) ld = V;
  HR_ELEM_REQUIRE(V > 0 && ld >= V, op,
                  "the vocabulary must be positive and ld >= V (or 0); got V = " +
                      std::to_string(V) + ", ld = " + std::to_string(ld));
  if (N <= 0) return;
  const dim3 grid{unsigned(N)}, block{unsigned(kThreads)};
  cudaStream_t s = ops.stream();
  if constexpr (kMode == kForward) {
    ce_kernel<kForward, kStoreF32>
        <<<grid, block, 0, s>>>(losses, lse_out, logits, lse_in, targets, V, ld, dloss);
  } else {
    switch (storage) {
      case DType::kF32:
        ce_kernel<kMode, kStoreF32>
            <<<grid, block, 0, s>>>(losses, lse_out, logits, lse_in, targets, V, ld, dloss);
        break;
      case DType::kF16:
        ce_kernel<kMode, kStoreF16Values>
            <<<grid, block, 0, s>>>(losses, lse_out, logits, lse_in, targets, V, ld, dloss);
        break;
      case DType::kBF16:
        ce_kernel<kMode, kStoreBF16>
            <<<grid, block, 0, s>>>(losses, lse_out, logits, lse_in, targets, V, ld, dloss);
        break;
      default:
        cuda_fail(op, "the logits gradient's storage must be f32, f16 or bf16", __FILE__, __LINE__);
    }
  }
  HR_CUDA_LAUNCH_CHECK();
}

}  // namespace

void CudaOps::cross_entropy_forward(float* losses, float* lse, const float* logits,
                                    const int32_t* targets, int N, int V, int64_t ld) const {
  HR_ELEM_REQUIRE(losses != nullptr, "cross_entropy_forward", "losses must not be null");
  // The forward kernel only reads the logits (kForward stores nothing into the row).
  ce_launch<kForward>(*this, losses, lse, const_cast<float*>(logits), nullptr, targets, N, V, ld,
                      0.0f, DType::kF32, "cross_entropy_forward");
}
void CudaOps::cross_entropy_backward_inplace(float* logits, const float* lse,
                                             const int32_t* targets, int N, int V, float dloss,
                                             DType storage, int64_t ld) const {
  HR_ELEM_REQUIRE(lse != nullptr, "cross_entropy_backward_inplace",
                  "needs the forward's lse (not null)");
  ce_launch<kBackward>(*this, nullptr, nullptr, logits, lse, targets, N, V, ld, dloss, storage,
                       "cross_entropy_backward_inplace");
}
void CudaOps::cross_entropy_forward_backward_inplace(float* losses, float* lse, float* logits,
                                                     const int32_t* targets, int N, int V,
                                                     float dloss, DType storage, int64_t ld) const {
  HR_ELEM_REQUIRE(losses != nullptr, "cross_entropy_forward_backward_inplace",
                  "losses must not be null");
  ce_launch<kForwardBackward>(*this, losses, lse, logits, nullptr, targets, N, V, ld, dloss,
                              storage, "cross_entropy_forward_backward_inplace");
}

}  // namespace headroom::backend::cuda
