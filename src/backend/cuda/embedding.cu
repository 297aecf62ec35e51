// The embedding of the CUDA op table (cuda_ops_impl.h): the forward gather, and a deterministic
// backward (the tokens' rows sorted by token with CUB's stable radix sort, then each token's
// rows summed in row order by one thread per channel), with no atomics. See the "elementwise"
// section of docs/notes/cuda.md.
#include <cub/device/device_radix_sort.cuh>

#include "backend/cuda/elementwise_common.cuh"

namespace headroom::backend::cuda {
namespace {

using elem::load_pack;
using elem::store_pack;

constexpr int kThreads = 256;

// out[bt, :] = wte[tokens[bt], :] (+ wpe[t, :]); blockIdx.y walks rows (grid-stride past
// 65535), threads the row's C / K packs of K floats (K = 4: 16-byte loads, when C and the
// pointers allow).
template <int K>
__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const float* wte,
                                         const float* wpe, int64_t BT, int T, int C) {
  const int packs = C / K;
  for (int64_t bt = blockIdx.y; bt < BT; bt += gridDim.y) {
    const float* w = wte + int64_t(tokens[bt]) * C;
    const float* p = wpe != nullptr ? wpe + (bt % T) * C : nullptr;
    float* o = out + bt * C;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < packs; j += gridDim.x * blockDim.x) {
      float v[K];
      load_pack<K>(w + j * K, v);
      if (p != nullptr) {
        float q[K];
        load_pack<K>(p + j * K, q);
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] += q[k];
      }
      store_pack<K>(o + j * K, v);
    }
  }
}

__global__ void iota_kernel(int32_t* x, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = int32_t(i);
  }
}

// keys[BT] the sorted tokens, rows[BT] their rows (stable: ascending within a token). The block
// at sorted position p that starts a token's run sums the run's rows of dout in order, one
// thread per channel, and adds the sum into dwte once. Positions inside a run exit at once.
__global__ void embedding_dwte_kernel(float* dwte, const float* dout, const int32_t* keys,
                                      const int32_t* rows, int64_t BT, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  for (int64_t p = blockIdx.y; p < BT; p += gridDim.y) {
    const int32_t token = keys[p];
    if (p > 0 && keys[p - 1] == token) continue;  // not the start of its run
    if (c >= C) continue;
    float s = 0.0f;
    for (int64_t q = p; q < BT && keys[q] == token; ++q) s += dout[int64_t(rows[q]) * C + c];
    dwte[int64_t(token) * C + c] += s;
  }
}

// dwpe[t, c] += sum_b dout[b, t, c], b in order.
__global__ void embedding_dwpe_kernel(float* dwpe, const float* dout, int B, int T, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
    float s = 0.0f;
    for (int b = 0; b < B; ++b) s += dout[(int64_t(b) * T + t) * C + c];
    dwpe[t * C + c] += s;
  }
}

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

}  // namespace

void CudaOps::embedding_forward(float* out, const int32_t* tokens, const float* wte,
                                const float* wpe, int B, int T, int C) const {
  const int64_t BT = int64_t(B) * T;
  if (BT <= 0 || C <= 0) return;
  const bool vec = C % 4 == 0 && elem::aligned16(out) && elem::aligned16(wte) &&
                   (wpe == nullptr || elem::aligned16(wpe));
  const int K = vec ? 4 : 1, packs = C / K;
  const dim3 grid(unsigned(std::min<int64_t>((packs + kThreads - 1) / kThreads, 1024)),
                  unsigned(std::min<int64_t>(BT, elem::kMaxGridY)));
  if (vec) {
    embedding_forward_kernel<4><<<grid, kThreads, 0, stream()>>>(out, tokens, wte, wpe, BT, T, C);
  } else {
    embedding_forward_kernel<1><<<grid, kThreads, 0, stream()>>>(out, tokens, wte, wpe, BT, T, C);
  }
  HR_CUDA_LAUNCH_CHECK();
}

void CudaOps::embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                                 int B, int T, int C) const {
  const int64_t BT = int64_t(B) * T;
  if (BT <= 0 || C <= 0) return;
  HR_ELEM_REQUIRE(BT <= INT32_MAX, "embedding_backward", "B * T must fit in int32 (row ids)");
  if (dwte != nullptr) {
    // Workspace: sorted keys, row ids before and after the sort, CUB's temporary storage.
    size_t temp_bytes = 0;
    HR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, temp_bytes, tokens, static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
        static_cast<int32_t*>(nullptr), int(BT), 0, 32, stream()));
    const size_t ids = align256(size_t(BT) * sizeof(int32_t));
    char* ws = static_cast<char*>(
        elem::op_workspace(*this, 3 * ids + align256(temp_bytes), "embedding_backward"));
    auto* keys = reinterpret_cast<int32_t*>(ws);
    auto* rows_in = reinterpret_cast<int32_t*>(ws + ids);
    auto* rows = reinterpret_cast<int32_t*>(ws + 2 * ids);
    void* temp = ws + 3 * ids;
    iota_kernel<<<elem::grid_for(*this, BT, kThreads), kThreads, 0, stream()>>>(rows_in, BT);
    HR_CUDA_LAUNCH_CHECK();
    HR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, tokens, keys, rows_in, rows,
                                                  int(BT), 0, 32, stream()));
    const dim3 grid(unsigned((C + kThreads - 1) / kThreads),
                    unsigned(std::min<int64_t>(BT, elem::kMaxGridY)));
    embedding_dwte_kernel<<<grid, kThreads, 0, stream()>>>(dwte, dout, keys, rows, BT, C);
    HR_CUDA_LAUNCH_CHECK();
  }
  if (dwpe != nullptr) {
    const dim3 grid(unsigned((C + kThreads - 1) / kThreads),
                    unsigned(std::min<int64_t>(T, elem::kMaxGridY)));
    embedding_dwpe_kernel<<<grid, kThreads, 0, stream()>>>(dwpe, dout, B, T, C);
    HR_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace headroom::backend::cuda
