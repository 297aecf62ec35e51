// The elementwise family of the CUDA op table (cuda_ops_impl.h), the part that maps elements one
// to one: GELU, SwiGLU, RoPE and its tables, residual, casts, zero, AdamW, sum of squares,
// scaling and the sparsity mask. The embedding is in embedding.cu, the norms in norm.cu, the losses
// in loss.cu. See the "elementwise" section of docs/notes/cuda.md.
#include <cmath>

#include "backend/cuda/elementwise_common.cuh"

namespace headroom::backend::cuda {
namespace {

using elem::aligned16;
using elem::from_f32;
using elem::kPack;
using elem::load_pack;
using elem::store_pack;
using elem::to_f32;

constexpr int kThreads = 256;

// ---- the map: f.template run<K>(i) handles elements [i, i + K) --------------------------------
// Packs of kPack elements where every pointer the op touches is 16-byte aligned (then each pack
// is too: offsets are multiples of 8 elements), the tail (n % kPack) one element at a time; a
// misaligned pointer sends the whole range through the scalar path. Elements are independent, so
// neither the split nor the grid changes a value, and an output may alias an input (each thread
// reads its elements before it writes them).
template <int K, typename F>
__global__ void map_kernel(F f, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t packs = n / K;
  for (int64_t p = tid; p < packs; p += stride) f.template run<K>(p * K);
  for (int64_t i = packs * K + tid; i < n; i += stride) f.template run<1>(i);
}

template <typename F>
void launch_map(const CudaOps& ops, const F& f, int64_t n, bool vector) {
  if (n <= 0) return;
  if (vector) {
    map_kernel<kPack>
        <<<elem::grid_for(ops, n / kPack + 1, kThreads), kThreads, 0, ops.stream()>>>(f, n);
  } else {
    map_kernel<1><<<elem::grid_for(ops, n, kThreads), kThreads, 0, ops.stream()>>>(f, n);
  }
  HR_CUDA_LAUNCH_CHECK();
}

// ---- GELU (tanh approximation) as the CPU computes it: x sigma(2u), u = sqrt(2/pi)(x + 0.044715
// x^3); below x = -10 the value is -0 (the CPU's form, whose exp would otherwise clamp).
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCube = 0.044715f;

__device__ __forceinline__ float gelu(float x) {
  const float u = kGeluScale * (x + kGeluCube * x * x * x);
  return x < -10.0f ? -0.0f : x / (1.0f + expf(-2.0f * u));
}
// gelu'(x) with x clamped to [-10, 10] as the CPU does; fminf / fmaxf would turn a NaN into a
// bound, so a NaN is passed on first (the CPU's clamp keeps it).
__device__ __forceinline__ float gelu_grad(float x) {
  if (isnan(x)) return x;
  x = fminf(fmaxf(x, -10.0f), 10.0f);
  const float u = kGeluScale * (x + kGeluCube * x * x * x);
  const float e = expf(-2.0f * u), s = 1.0f / (1.0f + e);  // sigma(2u); 1 - sigma = e s
  const float du2 = 2.0f * kGeluScale * (1.0f + 3.0f * kGeluCube * x * x);
  return s * (1.0f + x * (e * s) * du2);
}

template <typename T>
struct GeluForward {
  T* out;
  const T* inp;
  template <int K>
  __device__ void run(int64_t i) const {
    float v[K];
    load_pack<K>(inp + i, v);
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = gelu(v[k]);
    store_pack<K>(out + i, v);
  }
};
template <typename T>
struct GeluBackward {
  T* dinp;  // may alias dout
  const T* inp;
  const T* dout;
  template <int K>
  __device__ void run(int64_t i) const {
    float x[K], d[K];
    load_pack<K>(inp + i, x);
    load_pack<K>(dout + i, d);
#pragma unroll
    for (int k = 0; k < K; ++k) x[k] = gelu_grad(x[k]) * d[k];
    store_pack<K>(dinp + i, x);
  }
};

// ---- SwiGLU over rows: blockIdx.y walks rows (grid-stride past 65535), threads walk the row's
// I columns in packs where I, both row strides and the pointers allow 16-byte packs.
// silu(x) = x sigma(x); sigma and 1 - sigma are each taken from their own exponential, so neither
// is a difference near 1 nor an inf * 0 for large |x|.
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <int K, typename T>
__global__ void swiglu_forward_kernel(T* out, const T* gu, int64_t N, int64_t I, int64_t ld_out,
                                      int64_t ld_gu) {
  const int64_t packs = I / K;
  for (int64_t n = blockIdx.y; n < N; n += gridDim.y) {
    const T* g = gu + n * ld_gu;
    const T* u = g + I;
    T* o = out + n * ld_out;
    for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < packs;
         p += int64_t(gridDim.x) * blockDim.x) {
      float x[K], up[K];
      load_pack<K>(g + p * K, x);
      load_pack<K>(u + p * K, up);
#pragma unroll
      for (int k = 0; k < K; ++k) x[k] = x[k] * sigmoid(x[k]) * up[k];
      store_pack<K>(o + p * K, x);
    }
  }
}

template <int K, typename T>
__global__ void swiglu_backward_kernel(T* dgu, const T* gu, const T* dout, int64_t N, int64_t I,
                                       int64_t ld_gu, int64_t ld_dout) {
  const int64_t packs = I / K;
  for (int64_t n = blockIdx.y; n < N; n += gridDim.y) {
    const T* g = gu + n * ld_gu;
    const T* u = g + I;
    const T* d = dout + n * ld_dout;
    T* dg = dgu + n * ld_gu;  // may alias gu: this thread's gate and up are read first
    T* du = dg + I;
    for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < packs;
         p += int64_t(gridDim.x) * blockDim.x) {
      float x[K], up[K], dy[K], dgo[K], duo[K];
      load_pack<K>(g + p * K, x);
      load_pack<K>(u + p * K, up);
      load_pack<K>(d + p * K, dy);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const float s = sigmoid(x[k]), oms = sigmoid(-x[k]);  // sigma, 1 - sigma
        dgo[k] = (dy[k] * up[k]) * (s * (1.0f + x[k] * oms));
        duo[k] = dy[k] * (x[k] * s);
      }
      store_pack<K>(dg + p * K, dgo);
      store_pack<K>(du + p * K, duo);
    }
  }
}

template <typename T>
bool swiglu_packs(const T* a, const T* b, int64_t I, int64_t lda, int64_t ldb) {
  return I % kPack == 0 && lda % kPack == 0 && ldb % kPack == 0 && aligned16(a) && aligned16(b);
}
// Blocks over a row's columns (x, at most 1024: the threads then loop) and rows (y).
dim3 row_grid(int64_t N, int64_t cols) {
  const int64_t x = std::min<int64_t>((cols + kThreads - 1) / kThreads, 1024);
  const int64_t y = std::min<int64_t>(N, elem::kMaxGridY);
  return dim3(unsigned(std::max<int64_t>(x, 1)), unsigned(std::max<int64_t>(y, 1)));
}

template <typename T>
void swiglu_forward_t(const CudaOps& ops, T* out, const T* gu, int64_t N, int64_t I, int64_t ld_out,
                      int64_t ld_gu) {
  HR_ELEM_REQUIRE(
      ld_gu >= 2 * I && ld_out >= I, "swiglu_forward",
      "row strides must satisfy ld_gu >= 2 I and ld_out >= I; got I = " + std::to_string(I) +
          ", ld_gu = " + std::to_string(ld_gu) + ", ld_out = " + std::to_string(ld_out));
  if (N <= 0 || I <= 0) return;
  if (swiglu_packs(out, gu, I, ld_out, ld_gu)) {
    swiglu_forward_kernel<kPack>
        <<<row_grid(N, I / kPack), kThreads, 0, ops.stream()>>>(out, gu, N, I, ld_out, ld_gu);
  } else {
    swiglu_forward_kernel<1>
        <<<row_grid(N, I), kThreads, 0, ops.stream()>>>(out, gu, N, I, ld_out, ld_gu);
  }
  HR_CUDA_LAUNCH_CHECK();
}
template <typename T>
void swiglu_backward_t(const CudaOps& ops, T* dgu, const T* gu, const T* dout, int64_t N, int64_t I,
                       int64_t ld_gu, int64_t ld_dout) {
  HR_ELEM_REQUIRE(
      ld_gu >= 2 * I && ld_dout >= I, "swiglu_backward",
      "row strides must satisfy ld_gu >= 2 I and ld_dout >= I; got I = " + std::to_string(I) +
          ", ld_gu = " + std::to_string(ld_gu) + ", ld_dout = " + std::to_string(ld_dout));
  if (N <= 0 || I <= 0) return;
  if (swiglu_packs(dgu, gu, I, ld_gu, ld_gu) && swiglu_packs(dout, dout, I, ld_dout, ld_dout)) {
    swiglu_backward_kernel<kPack><<<row_grid(N, I / kPack), kThreads, 0, ops.stream()>>>(
        dgu, gu, dout, N, I, ld_gu, ld_dout);
  } else {
    swiglu_backward_kernel<1>
        <<<row_grid(N, I), kThreads, 0, ops.stream()>>>(dgu, gu, dout, N, I, ld_gu, ld_dout);
  }
  HR_CUDA_LAUNCH_CHECK();
}

// ---- RoPE: one thread per (row, head, pair) of the q and k heads; blockIdx.y walks rows
// (grid-stride past 65535), x the row's (NH + NKV) * HS/2 pairs. Each pair is read and written by
// its own thread, so in place is safe.
template <bool kInverse, typename T>
__global__ void rope_kernel(T* qkv, const float* cos, const float* sin, int64_t rows, int T_,
                            int heads, int H, int64_t W) {
  const int64_t pairs = int64_t(heads) * H;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int64_t t = r % T_;
    T* row = qkv + r * W;
    for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs;
         p += int64_t(gridDim.x) * blockDim.x) {
      const int64_t h = p / H, i = p % H;
      T* x = row + h * 2 * H + i;
      const float c = cos[t * H + i], s = sin[t * H + i];
      const float x1 = to_f32(x[0]), x2 = to_f32(x[H]);
      if (kInverse) {
        x[0] = from_f32<T>(x1 * c + x2 * s);
        x[H] = from_f32<T>(x2 * c - x1 * s);
      } else {
        x[0] = from_f32<T>(x1 * c - x2 * s);
        x[H] = from_f32<T>(x2 * c + x1 * s);
      }
    }
  }
}
template <bool kInverse, typename T>
void rope_t(const CudaOps& ops, T* qkv, const float* cos, const float* sin, int B, int T_, int NH,
            int NKV, int HS) {
  HR_ELEM_REQUIRE(
      HS > 0 && HS % 2 == 0 && NH > 0 && NKV > 0, kInverse ? "rope_backward" : "rope_forward",
      "the head size must be even and positive, NH and NKV positive; got HS = " +
          std::to_string(HS) + ", NH = " + std::to_string(NH) + ", NKV = " + std::to_string(NKV));
  const int64_t rows = int64_t(B) * T_;
  if (rows <= 0) return;
  const int H = HS / 2, heads = NH + NKV;
  const int64_t W = int64_t(NH + 2 * NKV) * HS;
  rope_kernel<kInverse><<<row_grid(rows, int64_t(heads) * H), kThreads, 0, ops.stream()>>>(
      qkv, cos, sin, rows, T_, heads, H, W);
  HR_CUDA_LAUNCH_CHECK();
}

// inv_freq[i] as cpu::rope_inv_freq computes it: the exponent in fp32, the power and the Llama 3
// scaling in double, rounded once (device double arithmetic: pow within 1 ulp of the host's,
// so the float is almost always the same).
__global__ void rope_inv_freq_kernel(float* inv_freq, int HS, float theta, bool llama3,
                                     double factor, double low, double high, double original) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= HS / 2) return;
  const float expo = float(2 * i) / float(HS);
  double f = 1.0 / pow(double(theta), double(expo));
  if (llama3) {
    const double wavelen = 2.0 * 3.14159265358979323846 / f;
    const double low_freq_wavelen = original / low, high_freq_wavelen = original / high;
    if (wavelen < high_freq_wavelen) {
      // high frequencies: kept
    } else if (wavelen > low_freq_wavelen) {
      f /= factor;
    } else {
      const double smooth = (original / wavelen - low) / (high - low);
      f = (1.0 - smooth) * f / factor + smooth * f;
    }
  }
  inv_freq[i] = float(f);
}

__global__ void rope_table_kernel(float* cos_out, float* sin_out, const float* inv_freq, int H,
                                  int pos0, int T) {
  const int64_t total = int64_t(T) * H;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = k / H, i = k % H;
    const double a = (double(pos0) + double(t)) * double(inv_freq[i]);
    double s, c;
    sincos(a, &s, &c);
    cos_out[k] = float(c);
    sin_out[k] = float(s);
  }
}

// ---- residual, casts, scaling ----------------------------------------------------------------
struct Residual {
  float* out;  // may alias a or b
  const float* a;
  const float* b;
  template <int K>
  __device__ void run(int64_t i) const {
    float x[K], y[K];
    load_pack<K>(a + i, x);
    load_pack<K>(b + i, y);
#pragma unroll
    for (int k = 0; k < K; ++k) x[k] += y[k];
    store_pack<K>(out + i, x);
  }
};
template <typename TO, bool kF16Values = false>
struct Cast {
  TO* out;  // may alias inp where TO is float
  const float* inp;
  template <int K>
  __device__ void run(int64_t i) const {
    float v[K];
    load_pack<K>(inp + i, v);
    if constexpr (kF16Values) {
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] = elem::round_f16(v[k]);
    }
    store_pack<K>(out + i, v);
  }
};
struct Scale {
  float* x;
  float s;
  template <int K>
  __device__ void run(int64_t i) const {
    float v[K];
    load_pack<K>(x + i, v);
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] *= s;
    store_pack<K>(x + i, v);
  }
};

// A sparsity mask: +0.0f where the mask's byte is 0, the other elements not written (so their
// bits, NaN included, stay), as cpu::apply_mask. Element by element: the mask's bytes have no
// alignment of their own, and the op runs a few times per step on parameter-sized buffers.
struct ApplyMask {
  const uint8_t* mask;
  float* x;
  template <int K>
  __device__ void run(int64_t i) const {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (mask[i + k] == 0) x[i + k] = 0.0f;
    }
  }
};

// ---- AdamW: torch.optim.AdamW's single-tensor order, as cpu::adamw_update: decay, then the
// bias-corrected step. The arithmetic is spelled with the _rn intrinsics so that nvcc contracts
// nothing into FMAs: each operation rounds as the CPU's (IEEE division and square root).
struct AdamW {
  float* params;
  float* grads;
  float* m;
  float* v;
  bf16_t* copy;  // null: no bf16 copy
  bool zero_grads;
  float b1, b2, one_b1, one_b2, eps, gs, step_size, bc2_sqrt, decay;
  template <int K>
  __device__ void run(int64_t i) const {
    float g[K], mi[K], vi[K], p[K];
    load_pack<K>(grads + i, g);
    load_pack<K>(m + i, mi);
    load_pack<K>(v + i, vi);
    load_pack<K>(params + i, p);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float gk = __fmul_rn(g[k], gs);
      mi[k] = __fadd_rn(__fmul_rn(b1, mi[k]), __fmul_rn(one_b1, gk));
      vi[k] = __fadd_rn(__fmul_rn(b2, vi[k]), __fmul_rn(__fmul_rn(one_b2, gk), gk));
      const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi[k]), bc2_sqrt), eps);
      p[k] = __fsub_rn(__fmul_rn(p[k], decay), __fmul_rn(step_size, __fdiv_rn(mi[k], denom)));
    }
    store_pack<K>(m + i, mi);
    store_pack<K>(v + i, vi);
    store_pack<K>(params + i, p);
    if (copy != nullptr) store_pack<K>(copy + i, p);
    if (zero_grads) {
      float z[K];
#pragma unroll
      for (int k = 0; k < K; ++k) z[k] = 0.0f;
      store_pack<K>(grads + i, z);
    }
  }
};

// ---- sum of squares in double: kSumBlocks fixed by n, each summing a fixed strided share in
// order and reducing by the block's fixed tree into partial[block]; one block then sums the
// partials by the same tree. The partition depends on n only, so the result is the same on every
// run and every device.
constexpr int kSumThreads = 256;
constexpr int64_t kSumMaxBlocks = 1024;

__global__ void sum_squares_partial_kernel(double* partial, const float* x, int64_t n) {
  __shared__ double sh[32];
  double s = 0.0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double d = x[i];
    s += d * d;
  }
  s = elem::block_reduce(s, elem::Sum{}, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
__global__ void sum_partials_kernel(double* out, const double* partial, int blocks) {
  __shared__ double sh[32];
  double s = 0.0;
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) s += partial[b];
  s = elem::block_reduce(s, elem::Sum{}, sh);
  if (threadIdx.x == 0) *out = s;
}

// ---- the masked loss sum: as the sum of squares, a partition fixed by N, each thread's share
// summed in index order, then fixed trees; the count alongside.
__global__ void masked_loss_partial_kernel(double* partial, long long* counts, const float* losses,
                                           const int32_t* targets, int N) {
  __shared__ double sh[32];
  __shared__ double shc[32];
  double s = 0.0, c = 0.0;
  const int stride = gridDim.x * blockDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < N; i += stride) {
    if (targets[i] >= 0) {
      s += double(losses[i]);
      c += 1.0;
    }
  }
  s = elem::block_reduce(s, elem::Sum{}, sh);
  c = elem::block_reduce(c, elem::Sum{}, shc);
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = s;
    counts[blockIdx.x] = (long long)(c);
  }
}
__global__ void sum_counts_kernel(long long* out, const long long* counts, int blocks) {
  if (threadIdx.x != 0) return;
  long long n = 0;
  for (int b = 0; b < blocks; b++) n += counts[b];
  *out = n;
}

}  // namespace

bool CudaOps::is_device_pointer(const void* p) const {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // a pointer the runtime does not know: host memory
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

void CudaOps::copy_to_device(void* dst, const void* src, size_t bytes) const {
  if (bytes == 0) return;
  HR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream()));
  // The source is the caller's again on return (pageable memory is staged by then, pinned
  // memory is not): wait.
  HR_CUDA_CHECK(cudaStreamSynchronize(stream()));
}
void CudaOps::copy_to_host(void* dst, const void* src, size_t bytes) const {
  if (bytes == 0) return;
  HR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream()));
  HR_CUDA_CHECK(cudaStreamSynchronize(stream()));
}
void CudaOps::fill_bytes(void* dst, int value, size_t bytes) const {
  if (bytes == 0) return;
  HR_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream()));
}
double CudaOps::masked_loss_sum(const float* losses, const int32_t* targets, int N,
                                int64_t* count) const {
  if (N <= 0) {
    if (count) *count = 0;
    return 0.0;
  }
  const int blocks =
      int(std::min<int64_t>(kSumMaxBlocks, (int64_t(N) + kSumThreads - 1) / kSumThreads));
  // [sum | partials] doubles, then [count | counts] 64-bit integers.
  const size_t doubles = size_t(blocks + 1);
  void* ws = elem::op_workspace(*this, doubles * sizeof(double) + doubles * sizeof(long long),
                                "masked_loss_sum");
  double* partial = static_cast<double*>(ws);
  long long* counts = reinterpret_cast<long long*>(partial + doubles);
  masked_loss_partial_kernel<<<blocks, kSumThreads, 0, stream()>>>(partial + 1, counts + 1, losses,
                                                                   targets, N);
  HR_CUDA_LAUNCH_CHECK();
  sum_partials_kernel<<<1, kSumThreads, 0, stream()>>>(partial, partial + 1, blocks);
  HR_CUDA_LAUNCH_CHECK();
  sum_counts_kernel<<<1, 32, 0, stream()>>>(counts, counts + 1, blocks);
  HR_CUDA_LAUNCH_CHECK();
  double host_sum = 0.0;
  long long host_count = 0;
  HR_CUDA_CHECK(
      cudaMemcpyAsync(&host_sum, partial, sizeof(double), cudaMemcpyDeviceToHost, stream()));
  HR_CUDA_CHECK(
      cudaMemcpyAsync(&host_count, counts, sizeof(long long), cudaMemcpyDeviceToHost, stream()));
  HR_CUDA_CHECK(cudaStreamSynchronize(stream()));
  if (count) *count = int64_t(host_count);
  return host_sum;
}

// ---- GELU, SwiGLU, RoPE per storage type -----------------------------------------------------
#define HR_ELEM_T(T)                                                                              \
  void CudaOps::gelu_forward(T* out, const T* inp, int64_t n) const {                             \
    launch_map(*this, GeluForward<T>{out, inp}, n, aligned16(out) && aligned16(inp));             \
  }                                                                                               \
  void CudaOps::gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) const {            \
    launch_map(*this, GeluBackward<T>{dinp, inp, dout}, n,                                        \
               aligned16(dinp) && aligned16(inp) && aligned16(dout));                             \
  }                                                                                               \
  void CudaOps::swiglu_forward(T* out, const T* gu, int64_t N, int64_t I, int64_t ld_out,         \
                               int64_t ld_gu) const {                                             \
    swiglu_forward_t(*this, out, gu, N, I, ld_out, ld_gu);                                        \
  }                                                                                               \
  void CudaOps::swiglu_backward(T* dgu, const T* gu, const T* dout, int64_t N, int64_t I,         \
                                int64_t ld_gu, int64_t ld_dout) const {                           \
    swiglu_backward_t(*this, dgu, gu, dout, N, I, ld_gu, ld_dout);                                \
  }                                                                                               \
  void CudaOps::rope_forward(T* qkv, const float* cos, const float* sin, int B, int T_, int NH,   \
                             int NKV, int HS) const {                                             \
    rope_t<false>(*this, qkv, cos, sin, B, T_, NH, NKV, HS);                                      \
  }                                                                                               \
  void CudaOps::rope_backward(T* dqkv, const float* cos, const float* sin, int B, int T_, int NH, \
                              int NKV, int HS) const {                                            \
    rope_t<true>(*this, dqkv, cos, sin, B, T_, NH, NKV, HS);                                      \
  }
HR_ELEM_T(float)
HR_ELEM_T(bf16_t)
HR_ELEM_T(f16_t)
#undef HR_ELEM_T

void CudaOps::rope_inv_freq(float* inv_freq, int HS, float theta,
                            const RopeScaling& scaling) const {
  HR_ELEM_REQUIRE(HS > 0 && HS % 2 == 0 && theta > 0.0f, "rope_inv_freq",
                  "the head size must be even and positive and theta positive; got HS = " +
                      std::to_string(HS) + ", theta = " + std::to_string(theta));
  const bool llama3 = scaling.kind == RopeScaling::Kind::kLlama3;
  HR_ELEM_REQUIRE(
      !llama3 || (scaling.factor > 0.0f && scaling.high_freq_factor > scaling.low_freq_factor),
      "rope_inv_freq",
      "Llama 3 scaling needs factor > 0 and high_freq_factor > low_freq_factor; got factor = " +
          std::to_string(scaling.factor) +
          ", low_freq_factor = " + std::to_string(scaling.low_freq_factor) +
          ", high_freq_factor = " + std::to_string(scaling.high_freq_factor));
  const int H = HS / 2;
  rope_inv_freq_kernel<<<(H + kThreads - 1) / kThreads, kThreads, 0, stream()>>>(
      inv_freq, HS, theta, llama3, scaling.factor, scaling.low_freq_factor,
      scaling.high_freq_factor, double(scaling.original_max_position_embeddings));
  HR_CUDA_LAUNCH_CHECK();
}

void CudaOps::rope_table(float* cos, float* sin, const float* inv_freq, int HS, int pos0,
                         int T) const {
  HR_ELEM_REQUIRE(HS > 0 && HS % 2 == 0, "rope_table",
                  "the head size must be even and positive; got HS = " + std::to_string(HS));
  const int64_t total = int64_t(T) * (HS / 2);
  if (total <= 0) return;
  rope_table_kernel<<<elem::grid_for(*this, total, kThreads), kThreads, 0, stream()>>>(
      cos, sin, inv_freq, HS / 2, pos0, T);
  HR_CUDA_LAUNCH_CHECK();
}

void CudaOps::residual_forward(float* out, const float* a, const float* b, int64_t n) const {
  launch_map(*this, Residual{out, a, b}, n, aligned16(out) && aligned16(a) && aligned16(b));
}

void CudaOps::cast_to_bf16(bf16_t* out, const float* inp, int64_t n) const {
  launch_map(*this, Cast<bf16_t>{out, inp}, n, aligned16(out) && aligned16(inp));
}
void CudaOps::cast_to_f16(f16_t* out, const float* inp, int64_t n) const {
  launch_map(*this, Cast<f16_t>{out, inp}, n, aligned16(out) && aligned16(inp));
}
void CudaOps::round_to_f16_values(float* out, const float* inp, int64_t n) const {
  launch_map(*this, Cast<float, true>{out, inp}, n, aligned16(out) && aligned16(inp));
}
void CudaOps::zero(float* x, int64_t n) const {
  if (n <= 0) return;
  HR_CUDA_CHECK(cudaMemsetAsync(x, 0, size_t(n) * sizeof(float), stream()));
}

void CudaOps::adamw_update(float* params, float* grads, float* m, float* v, int64_t n,
                           const AdamWParams& p, bf16_t* params_bf16, bool zero_grads) const {
  HR_ELEM_REQUIRE(p.step >= 1, "adamw_update",
                  "the step is 1-based: step must be >= 1, got " + std::to_string(p.step));
  // The scalars in double, as Python (and cpu::adamw_update) form them.
  const double bc1 = 1.0 - std::pow(static_cast<double>(p.beta1), p.step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(p.beta2), p.step);
  AdamW f{params, grads, m, v, params_bf16, zero_grads};
  f.b1 = p.beta1;
  f.b2 = p.beta2;
  f.one_b1 = 1.0f - p.beta1;
  f.one_b2 = 1.0f - p.beta2;
  f.eps = p.eps;
  f.gs = p.grad_scale;
  f.step_size = static_cast<float>(p.lr / bc1);
  f.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  f.decay = static_cast<float>(1.0 - static_cast<double>(p.lr) * p.weight_decay);
  const bool vec = aligned16(params) && aligned16(grads) && aligned16(m) && aligned16(v) &&
                   (params_bf16 == nullptr || aligned16(params_bf16));
  launch_map(*this, f, n, vec);
}

double CudaOps::sum_squares(const float* x, int64_t n) const {
  if (n <= 0) return 0.0;
  const int blocks = int(std::min<int64_t>(kSumMaxBlocks, (n + kSumThreads - 1) / kSumThreads));
  double* partial = static_cast<double*>(
      elem::op_workspace(*this, size_t(blocks + 1) * sizeof(double), "sum_squares"));
  sum_squares_partial_kernel<<<blocks, kSumThreads, 0, stream()>>>(partial + 1, x, n);
  HR_CUDA_LAUNCH_CHECK();
  sum_partials_kernel<<<1, kSumThreads, 0, stream()>>>(partial, partial + 1, blocks);
  HR_CUDA_LAUNCH_CHECK();
  double host = 0.0;
  // The one op that waits: the caller needs the value (the global gradient norm).
  HR_CUDA_CHECK(cudaMemcpyAsync(&host, partial, sizeof(double), cudaMemcpyDeviceToHost, stream()));
  HR_CUDA_CHECK(cudaStreamSynchronize(stream()));
  return host;
}

void CudaOps::scale_inplace(float* x, int64_t n, float s) const {
  launch_map(*this, Scale{x, s}, n, aligned16(x));
}

void CudaOps::apply_mask(const uint8_t* mask, float* x, int64_t n) const {
  launch_map(*this, ApplyMask{mask, x}, n, false);
}

}  // namespace headroom::backend::cuda
