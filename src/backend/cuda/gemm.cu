// The gemm family of the CUDA op table (cuda_ops_impl.h): every matmul on cuBLASLt with a cache
// of its descriptors and heuristic choice per shape, the deterministic bias-gradient column sums,
// the f16 GEMMs through the bound staging area, and the LM head fused with cross-entropy in
// chunks of tokens. See the "gemm" section of docs/notes/cuda.md.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_ops_impl.h"
#include "backend/cuda/gemm_internal.h"
#include "core/check.h"

namespace headroom::backend::cuda {
namespace {

std::atomic<bool> g_allow_tf32{false};

// The f16 GEMMs' staging area bound on this thread (bind_f16_staging): the model binds it for the
// ops it then queues from the same thread.
thread_local float* t_f16_staging = nullptr;
thread_local size_t t_f16_staging_floats = 0;

// Row lengths padded to 16 bytes: cuBLASLt's vectorized kernels (and the tensor-core paths of
// bf16, which want leading dimensions a multiple of 8 elements) need every row to start on 16
// bytes; past that the GPU gains nothing from padding (no 4 KiB aliasing, no cache-line rows).
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t padded_cols(int64_t cols, int64_t elem_bytes) {
  const int64_t per16 = elem_bytes > 0 && 16 % elem_bytes == 0 ? 16 / elem_bytes : 1;
  return round_up(cols, per16);
}
}  // namespace
// The row stride of the fused head's chunk of logits (fp32) and of its bf16 dlogits: 8 elements
// is 16 bytes in bf16 and 32 (one sector) in fp32. (gemm_internal.h: distill.cu uses it.)
int64_t head_ld(int64_t V) { return round_up(V, 8); }
namespace {
// The row stride of a widened (fp32) f16 operand or of an fp32 result before its narrowing.
int64_t staged_ld(int64_t cols) { return round_up(cols, 4); }
// Regions of the staging area start 256 bytes apart (cuBLASLt's preferred pointer alignment).
constexpr size_t kStagingAlignFloats = 64;
size_t staged_floats(int64_t rows, int64_t cols) {
  return size_t(round_up(rows * staged_ld(cols), int64_t(kStagingAlignFloats)));
}

// ---- element access on the device ----------------------------------------------------------
// bf16_t / f16_t are uint16_t bit patterns (core/dtype.h); kernels read and write them as such.
__device__ __forceinline__ float load_f32(const float* p) { return *p; }
__device__ __forceinline__ float load_f32(const bf16_t* p) {
  return __uint_as_float(uint32_t(reinterpret_cast<const uint16_t*>(p)[0]) << 16);
}
__device__ __forceinline__ float load_f32(const f16_t* p) {
  return __half2float(__ushort_as_half(reinterpret_cast<const uint16_t*>(p)[0]));
}
__device__ __forceinline__ void store_f32(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_f32(bf16_t* p, float x) {
  reinterpret_cast<uint16_t*>(p)[0] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
__device__ __forceinline__ void store_f32(f16_t* p, float x) {
  reinterpret_cast<uint16_t*>(p)[0] = __half_as_ushort(__float2half_rn(x));
}

// Grid sizes: gridDim.y is capped (65535), so row loops stride by gridDim.y.
constexpr int kMaxGridY = 65535;
unsigned grid_y(int64_t rows) { return unsigned(std::clamp<int64_t>(rows, 1, kMaxGridY)); }

// dst[r * ldd + c] = src[r * lds + c] converted (f16 -> fp32 exactly; fp32 -> f16 rounded to
// nearest even, overflow to infinity, as the CPU's f16 conversions).
template <typename S, typename D>
__global__ void convert_rows_kernel(D* dst, int64_t ldd, const S* src, int64_t lds, int64_t rows,
                                    int64_t cols) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    store_f32(dst + r * ldd + c, load_f32(src + r * lds + c));
  }
}
template <typename S, typename D>
void convert_rows(cudaStream_t s, D* dst, int64_t ldd, const S* src, int64_t lds, int64_t rows,
                  int64_t cols) {
  if (rows <= 0 || cols <= 0) return;
  const dim3 grid(unsigned((cols + 255) / 256), grid_y(rows));
  convert_rows_kernel<<<grid, 256, 0, s>>>(dst, ldd, src, lds, rows, cols);
  HR_CUDA_LAUNCH_CHECK();
}

// ---- cuBLASLt ------------------------------------------------------------------------------
// One column-major cuBLASLt matmul, D[m, n] = op(A)[m, k] op(B)[k, n] (+ bias[m]) (+ D when
// accumulating): its descriptors and chosen algorithm, cached per shape, types and alignment.
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;                                // the heuristic found an algorithm
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;  // the heuristic's answer where it found none
};

struct LtCall {
  bool ta = false, tb = false;
  int64_t m = 0, n = 0, k = 0;
  cudaDataType_t ab_type = CUDA_R_32F, d_type = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  const void* A = nullptr;
  int64_t lda = 0;
  const void* B = nullptr;
  int64_t ldb = 0;
  void* D = nullptr;
  int64_t ldd = 0;
  const float* bias = nullptr;  // fp32, length m
  bool accumulate = false;
};

// The largest power of two (up to 256) dividing the address: what the heuristic may assume.
int64_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int64_t al = 256;
  while (al > 1 && a % uintptr_t(al) != 0) al /= 2;
  return al;
}

const char* type_name(cudaDataType_t t) {
  return t == CUDA_R_32F ? "fp32" : t == CUDA_R_16BF ? "bf16" : t == CUDA_R_16F ? "f16" : "?";
}

class LtPlanCache {
 public:
  // Queues the call on the compute stream; false (nothing queued, *status the heuristic's
  // answer) where cuBLASLt has no algorithm for it.
  bool run(const Context& ctx, const LtCall& c, cublasStatus_t* status) {
    const Key key = key_of(c);
    std::lock_guard<std::mutex> lock(mu_);
    // A step's shapes are a few dozen; a bound keeps a long run of odd shapes (tests, varying
    // sequence lengths) from growing the map without end.
    if (plans_.size() >= kMaxPlans && plans_.find(key) == plans_.end()) clear();
    auto [it, inserted] = plans_.try_emplace(key);
    LtPlan& p = it->second;
    if (inserted) make(ctx, c, &p);
    if (!p.ok) {
      *status = p.status;
      return false;
    }
    if (c.bias != nullptr) {
      // The bias pointer lives in the shared descriptor: set and used under the lock (the matmul
      // reads it when it is queued).
      HR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &c.bias, sizeof(c.bias)));
    }
    const float alpha = 1.0f, beta = c.accumulate ? 1.0f : 0.0f;
    HR_CUBLAS_CHECK(cublasLtMatmul(ctx.lt, p.op, &alpha, c.A, p.a, c.B, p.b, &beta, c.D, p.d, c.D,
                                   p.d, &p.algo, ctx.lt_workspace, ctx.lt_workspace_bytes,
                                   ctx.compute));
    return true;
  }

 private:
  using Key = std::array<int64_t, 17>;
  static constexpr size_t kMaxPlans = 1024;

  static Key key_of(const LtCall& c) {
    return {c.ta,
            c.tb,
            c.m,
            c.n,
            c.k,
            c.lda,
            c.ldb,
            c.ldd,
            int64_t(c.ab_type),
            int64_t(c.d_type),
            int64_t(c.compute),
            c.bias != nullptr,
            c.accumulate,
            alignment_of(c.A),
            alignment_of(c.B),
            alignment_of(c.D),
            c.bias ? alignment_of(c.bias) : 0};
  }

  static void make(const Context& ctx, const LtCall& c, LtPlan* p) {
    HR_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->op, c.compute, CUDA_R_32F));
    const cublasOperation_t ta = c.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = c.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    HR_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    HR_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    if (c.bias != nullptr) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      HR_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
      // An fp32 bias whatever D's type: added in fp32 before D's one rounding, as the CPU's.
      const int32_t bias_type = CUDA_R_32F;
      HR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                     &bias_type, sizeof(bias_type)));
      // The heuristic reads the pointer's alignment from the descriptor.
      HR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &c.bias, sizeof(c.bias)));
    }
    // Column-major layouts of what is stored: op(X) = X^T reads a [k, m] matrix.
    HR_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, c.ab_type, uint64_t(c.ta ? c.k : c.m),
                                               uint64_t(c.ta ? c.m : c.k), c.lda));
    HR_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, c.ab_type, uint64_t(c.tb ? c.n : c.k),
                                               uint64_t(c.tb ? c.k : c.n), c.ldb));
    HR_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&p->d, c.d_type, uint64_t(c.m), uint64_t(c.n), c.ldd));

    cublasLtMatmulPreference_t pref = nullptr;
    HR_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = ctx.lt_workspace_bytes;
    HR_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    // The real alignments (row offsets such as a chunk's x + c0 * C are not 256-byte aligned):
    // algorithms that need more are excluded rather than run on misaligned pointers.
    const uint32_t al_a = uint32_t(alignment_of(c.A)), al_b = uint32_t(alignment_of(c.B)),
                   al_d = uint32_t(alignment_of(c.D));
    HR_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
    HR_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
    HR_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof(al_d)));
    HR_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(ctx.lt, p->op, p->a, p->b, p->d, p->d,
                                                             pref, 1, &result, &found);
    HR_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (st == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS &&
        result.workspaceSize <= ctx.lt_workspace_bytes) {
      p->algo = result.algo;
      p->ok = true;
    } else {
      // Kept (not re-queried each call); the caller falls back or says what failed.
      p->status = st != CUBLAS_STATUS_SUCCESS ? st : CUBLAS_STATUS_NOT_SUPPORTED;
    }
  }

  void clear() {
    for (auto& [k, p] : plans_) {
      cublasLtMatrixLayoutDestroy(p.a);
      cublasLtMatrixLayoutDestroy(p.b);
      cublasLtMatrixLayoutDestroy(p.d);
      cublasLtMatmulDescDestroy(p.op);
    }
    plans_.clear();
  }

  std::mutex mu_;
  std::map<Key, LtPlan> plans_;
};

// Never destroyed: the op table lives until the process exits (cuda_ops.cu).
LtPlanCache& plan_cache() {
  static LtPlanCache* cache = new LtPlanCache;
  return *cache;
}

[[noreturn]] void no_algorithm(const LtCall& c, cublasStatus_t status) {
  char msg[400];
  std::snprintf(msg, sizeof(msg),
                "cuBLASLt has no algorithm (%s) for a %s x %s -> %s matmul m=%lld n=%lld k=%lld "
                "(lda %lld, ldb %lld, ldd %lld, transa %d, transb %d, bias %d); check the "
                "operands' alignment and row strides",
                cublasLtGetStatusString(status), type_name(c.ab_type), type_name(c.ab_type),
                type_name(c.d_type), static_cast<long long>(c.m), static_cast<long long>(c.n),
                static_cast<long long>(c.k), static_cast<long long>(c.lda),
                static_cast<long long>(c.ldb), static_cast<long long>(c.ldd), int(c.ta), int(c.tb),
                int(c.bias != nullptr));
  cuda_fail("cublasLtMatmulAlgoGetHeuristic", msg, __FILE__, __LINE__);
}

template <typename T>
constexpr cudaDataType_t cuda_type() {
  if constexpr (std::is_same_v<T, float>) {
    return CUDA_R_32F;
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    return CUDA_R_16BF;
  } else {
    return CUDA_R_16F;
  }
}

// The row-major GEMM of the CPU kernels (backend/cpu/gemm.h), so the matmuls below read as the
// CPU's: C[M,N] = op(A)[M,K] x op(B)[K,N] (+ bias[N]) (C += with accumulate); A and B row-major
// with leading dimensions lda, ldb; op(A) = A^T with trans_a (A stored [K, M]). cuBLASLt is
// column-major, where a row-major X is X^T: C^T = op(B)^T op(A)^T, i.e. cuBLASLt's A is our B
// (transposed when trans_b), its B our A (when trans_a), m = N, n = M; the bias of length m = N
// broadcasts over our rows.
template <typename TA, typename TC>
void gemm(const Context& ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
          const TA* A, int64_t lda, const TA* B, int64_t ldb, TC* C, int64_t ldc, const float* bias,
          bool accumulate, cublasComputeType_t compute);

// bf16 D with an fp32 bias, where cuBLASLt has no such epilogue: the rows in fp32 through the op
// workspace (bias added there), each rounded once to bf16, as the epilogue would.
template <typename TA>
void gemm_bias_via_fp32(const Context& ctx, int64_t M, int64_t N, int64_t K, const TA* A,
                        int64_t lda, const TA* B, int64_t ldb, bf16_t* C, int64_t ldc,
                        const float* bias, bool trans_b, cublasComputeType_t compute) {
  const int64_t ldt = staged_ld(N);
  const int64_t rows = int64_t(ctx.op_workspace_bytes / sizeof(float)) / ldt;
  HR_CHECK_MSG(rows >= 1,
               "matmul_forward: the op workspace cannot hold one fp32 row of the output");
  float* tmp = static_cast<float*>(ctx.op_workspace);
  for (int64_t r0 = 0; r0 < M; r0 += rows) {
    const int64_t r = std::min(rows, M - r0);
    gemm<TA, float>(ctx, false, trans_b, r, N, K, A + r0 * lda, lda, B, ldb, tmp, ldt, bias, false,
                    compute);
    convert_rows(ctx.compute, C + r0 * ldc, ldc, tmp, ldt, r, N);
  }
}

template <typename TA, typename TC>
void gemm(const Context& ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
          const TA* A, int64_t lda, const TA* B, int64_t ldb, TC* C, int64_t ldc, const float* bias,
          bool accumulate, cublasComputeType_t compute) {
  // Nothing to write, or (no rows in a weight gradient) nothing to add.
  if (M <= 0 || N <= 0 || (K <= 0 && accumulate)) return;
  HR_CHECK_MSG(K >= 1, "matmul: the inner dimension is 0");
  HR_CHECK_MSG(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N) && ldc >= N,
               "matmul: a row stride is smaller than its row (MatmulStrides)");
  LtCall c;
  c.ta = trans_b;
  c.tb = trans_a;
  c.m = N;
  c.n = M;
  c.k = K;
  c.ab_type = cuda_type<TA>();
  c.d_type = cuda_type<TC>();
  c.compute = compute;
  c.A = B;
  c.lda = ldb;
  c.B = A;
  c.ldb = lda;
  c.D = C;
  c.ldd = ldc;
  c.bias = bias;
  c.accumulate = accumulate;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  if (plan_cache().run(ctx, c, &status)) return;
  if constexpr (std::is_same_v<TC, bf16_t>) {
    if (bias != nullptr && !accumulate && !trans_a) {
      static std::once_flag said;
      std::call_once(said, [] {
        std::fprintf(stderr,
                     "headroom: cuBLASLt has no bf16 matmul with an fp32 bias epilogue here; "
                     "bf16 outputs with a bias go through fp32 rows in the op workspace\n");
      });
      gemm_bias_via_fp32(ctx, M, N, K, A, lda, B, ldb, C, ldc, bias, trans_b, compute);
      return;
    }
  }
  no_algorithm(c, status);
}

cublasComputeType_t fp32_compute() {
  return g_allow_tf32.load(std::memory_order_relaxed) ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                      : CUBLAS_COMPUTE_32F;
}

// A and B of type TA (fp32 or bf16), C fp32 or bf16; fp32 accumulation.
template <typename TA, typename TC>
void mm(const Context& ctx, bool ta, bool tb, int64_t M, int64_t N, int64_t K, const TA* A,
        int64_t lda, const TA* B, int64_t ldb, TC* C, int64_t ldc, const float* bias,
        bool accumulate) {
  const cublasComputeType_t compute =
      std::is_same_v<TA, float> ? fp32_compute() : CUBLAS_COMPUTE_32F;
  gemm<TA, TC>(ctx, ta, tb, M, N, K, A, lda, B, ldb, C, ldc, bias, accumulate, compute);
}

// ---- f16 GEMMs: widen into the staging, TF32 GEMM, narrow --------------------------------
// See the gemm section of docs/notes/cuda.md: the weight is fp32 holding f16 values, and
// cuBLASLt multiplies two operands of one type, so the f16 activation operands are widened
// (exactly) into the bound staging area and the GEMM runs on fp32 operands that all hold f16
// values. Such values are exact in TF32 (10 mantissa bits, fp32's exponent), so the TF32 tensor
// cores compute exact products accumulated in fp32: an f16 x f16 -> fp32 GEMM's arithmetic, at
// tensor-core speed, whatever allow_tf32 says.
float* take_staging(size_t* cursor, size_t floats) {
  HR_CHECK_MSG(t_f16_staging != nullptr,
               "an f16 GEMM ran on the CUDA table without its staging area bound on this "
               "thread (bind_f16_staging / F16StagingScope)");
  HR_CHECK_MSG(*cursor + floats <= t_f16_staging_floats,
               "the f16 GEMM staging area is smaller than this GEMM's operands: size it with "
               "f16_matmul_staging_floats of the CUDA table");
  float* p = t_f16_staging + *cursor;
  *cursor += floats;
  return p;
}

// An fp32 operand: itself, or (f16) its widened copy, stored [rows, cols] with leading dimension
// *ld (as it lies in memory, transposed by the GEMM or not).
template <typename T>
const float* as_f32(const Context& ctx, const T* x, int64_t rows, int64_t cols, int64_t* ld,
                    size_t* cursor) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const int64_t ldw = staged_ld(cols);
    float* w = take_staging(cursor, staged_floats(rows, cols));
    convert_rows(ctx.compute, w, ldw, x, *ld, rows, cols);
    *ld = ldw;
    return w;
  }
}

template <typename TA, typename TB, typename TC>
void mm16(const Context& ctx, bool ta, bool tb, int64_t M, int64_t N, int64_t K, const TA* A,
          int64_t lda, const TB* B, int64_t ldb, TC* C, int64_t ldc, const float* bias,
          bool accumulate) {
  if (M <= 0 || N <= 0 || (K <= 0 && accumulate)) return;
  size_t cursor = 0;
  const float* a = as_f32(ctx, A, ta ? K : M, ta ? M : K, &lda, &cursor);
  const float* b = as_f32(ctx, B, tb ? N : K, tb ? K : N, &ldb, &cursor);
  constexpr cublasComputeType_t kTf32 = CUBLAS_COMPUTE_32F_FAST_TF32;
  if constexpr (std::is_same_v<TC, float>) {
    gemm<float, float>(ctx, ta, tb, M, N, K, a, lda, b, ldb, C, ldc, bias, accumulate, kTf32);
  } else {
    HR_CHECK(!accumulate);  // f16 outputs are activations or their gradients: overwritten
    const int64_t ldt = staged_ld(N);
    float* c = take_staging(&cursor, staged_floats(M, N));
    gemm<float, float>(ctx, ta, tb, M, N, K, a, lda, b, ldb, c, ldt, bias, false, kTf32);
    convert_rows(ctx.compute, C, ldc, c, ldt, M, N);
  }
}

// ---- bias gradient: deterministic column sums ----------------------------------------------
// dbias[c] += sum over rows of dout[r, c]: fixed partitions of rows (kernel 1: one block per
// 32 columns x part, 8 row lanes summed in row order and then lane order) into per-part partial
// sums in the op workspace, summed in part order by kernel 2. No atomics: the same bits on every
// run.
constexpr int kSumCols = 32, kSumLanes = 8;

template <typename T>
__global__ void column_partials_kernel(float* partial, const T* dout, int64_t ld, int64_t rows,
                                       int64_t cols, int64_t rows_per_part) {
  __shared__ float lane_sums[kSumLanes][kSumCols + 1];
  const int64_t c = int64_t(blockIdx.x) * kSumCols + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_part;
  const int64_t r1 = r0 + rows_per_part < rows ? r0 + rows_per_part : rows;
  float s = 0.0f;
  if (c < cols) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kSumLanes) s += load_f32(dout + r * ld + c);
  }
  lane_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = 0.0f;
    for (int y = 0; y < kSumLanes; ++y) t += lane_sums[y][threadIdx.x];
    partial[int64_t(blockIdx.y) * cols + c] = t;
  }
}

__global__ void column_sums_add_kernel(float* dbias, const float* partial, int64_t cols,
                                       int parts) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float t = 0.0f;
  for (int p = 0; p < parts; ++p) t += partial[int64_t(p) * cols + c];
  dbias[c] += t;
}

template <typename T>
void add_column_sums(const Context& ctx, float* dbias, const T* dout, int64_t rows, int64_t cols,
                     int64_t ld) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t ws_floats = int64_t(ctx.op_workspace_bytes / sizeof(float));
  HR_CHECK_MSG(cols <= ws_floats,
               "matmul_backward: the op workspace cannot hold one row of bias partial sums");
  // At least 64 rows a part, at most 256 parts, as many as the workspace holds.
  const int64_t parts =
      std::max<int64_t>(1, std::min({(rows + 63) / 64, int64_t(256), ws_floats / cols}));
  const int64_t rows_per_part = (rows + parts - 1) / parts;
  const int64_t used_parts = (rows + rows_per_part - 1) / rows_per_part;
  float* partial = static_cast<float*>(ctx.op_workspace);
  const dim3 grid(unsigned((cols + kSumCols - 1) / kSumCols), unsigned(used_parts));
  column_partials_kernel<<<grid, dim3(kSumCols, kSumLanes), 0, ctx.compute>>>(
      partial, dout, ld, rows, cols, rows_per_part);
  HR_CUDA_LAUNCH_CHECK();
  column_sums_add_kernel<<<unsigned((cols + 255) / 256), 256, 0, ctx.compute>>>(
      dbias, partial, cols, int(used_parts));
  HR_CUDA_LAUNCH_CHECK();
}

// ---- matmuls in the CPU's terms (backend/cpu/kernels.cc) -----------------------------------
template <typename TA, typename TO>
void matmul_forward_t(const Context& ctx, TO* out, const TA* inp, const TA* weight,
                      const float* bias, int N, int IC, int OC, WeightLayout layout,
                      MatmulStrides st) {
  const int64_t ldi = st.inp ? st.inp : IC, ldo = st.out ? st.out : OC;
  if (layout == WeightLayout::kInOut) {
    mm(ctx, false, false, N, OC, IC, inp, ldi, weight, OC, out, ldo, bias, false);
  } else {
    mm(ctx, false, true, N, OC, IC, inp, ldi, weight, IC, out, ldo, bias, false);
  }
}

template <typename T>
void matmul_backward_t(const Context& ctx, T* dinp, float* dweight, float* dbias, const T* dout,
                       const T* inp, const T* weight, int N, int IC, int OC, WeightLayout layout,
                       MatmulStrides st) {
  const bool in_out = layout == WeightLayout::kInOut;
  const int64_t ldi = st.inp ? st.inp : IC, ldo = st.out ? st.out : OC;
  if (dinp != nullptr) {  // dinp[N,IC] = dout[N,OC] x weight^T, overwritten
    if (in_out) {
      mm(ctx, false, true, N, IC, OC, dout, ldo, weight, OC, dinp, ldi, nullptr, false);
    } else {
      mm(ctx, false, false, N, IC, OC, dout, ldo, weight, IC, dinp, ldi, nullptr, false);
    }
  }
  if (dweight != nullptr) {  // accumulated in fp32 (beta = 1)
    if (in_out) {            // dweight[IC,OC] += inp^T x dout
      mm(ctx, true, false, IC, OC, N, inp, ldi, dout, ldo, dweight, OC, nullptr, true);
    } else {  // dweight[OC,IC] += dout^T x inp
      mm(ctx, true, false, OC, IC, N, dout, ldo, inp, ldi, dweight, IC, nullptr, true);
    }
  }
  if (dbias != nullptr) add_column_sums(ctx, dbias, dout, N, OC, ldo);
}

template <typename TO>
void matmul_forward16(const Context& ctx, TO* out, const f16_t* inp, const float* weight,
                      const float* bias, int N, int IC, int OC, WeightLayout layout,
                      MatmulStrides st) {
  const int64_t ldi = st.inp ? st.inp : IC, ldo = st.out ? st.out : OC;
  if (layout == WeightLayout::kInOut) {
    mm16(ctx, false, false, N, OC, IC, inp, ldi, weight, OC, out, ldo, bias, false);
  } else {
    mm16(ctx, false, true, N, OC, IC, inp, ldi, weight, IC, out, ldo, bias, false);
  }
}

// dout is f16, or (the LM head) fp32 holding f16 values.
template <typename TD>
void matmul_backward16(const Context& ctx, f16_t* dinp, float* dweight, float* dbias,
                       const TD* dout, const f16_t* inp, const float* weight, int N, int IC, int OC,
                       WeightLayout layout, MatmulStrides st) {
  const bool in_out = layout == WeightLayout::kInOut;
  const int64_t ldi = st.inp ? st.inp : IC, ldo = st.out ? st.out : OC;
  if (dinp != nullptr) {
    if (in_out) {
      mm16(ctx, false, true, N, IC, OC, dout, ldo, weight, OC, dinp, ldi, nullptr, false);
    } else {
      mm16(ctx, false, false, N, IC, OC, dout, ldo, weight, IC, dinp, ldi, nullptr, false);
    }
  }
  if (dweight != nullptr) {
    if (in_out) {
      mm16(ctx, true, false, IC, OC, N, inp, ldi, dout, ldo, dweight, OC, nullptr, true);
    } else {
      mm16(ctx, true, false, OC, IC, N, dout, ldo, inp, ldi, dweight, IC, nullptr, true);
    }
  }
  if (dbias != nullptr) add_column_sums(ctx, dbias, dout, N, OC, ldo);
}

// ---- the LM head's cross-entropy over a chunk of logits ------------------------------------
// One block per row of logits; each thread keeps an online (max, sum of exp) over its strided
// columns, merged in a fixed tree (shuffles, then the warps in order): the same bits every run.
constexpr int kCeThreads = 512;

struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// The row's max and sum of exp(z - max), on every thread of the block.
__device__ MaxSum row_max_sum(const float* z, int V) {
  MaxSum t{-INFINITY, 0.0f};
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float x = z[i];
    if (x > t.m) {
      t.s = t.s * expf(t.m - x) + 1.0f;
      t.m = x;
    } else if (x != -INFINITY) {
      t.s += expf(x - t.m);
    }
  }
  for (int off = 16; off > 0; off /= 2) {
    const MaxSum o{__shfl_xor_sync(0xffffffffu, t.m, off), __shfl_xor_sync(0xffffffffu, t.s, off)};
    t = merge(t, o);
  }
  __shared__ MaxSum warp_ms[kCeThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_ms[warp] = t;
  __syncthreads();
  MaxSum r = warp_ms[0];
  for (int w = 1; w < int(blockDim.x / 32); ++w) r = merge(r, warp_ms[w]);
  return r;
}

// losses[r] = lse - z[target] (0 for target -1; NaN for a target outside [-1, V), which the CPU
// rejects with an abort); lse[r] = log(sum exp z) for every row, in double as the CPU's.
__global__ void head_ce_forward_kernel(float* losses, float* lse, const float* logits, int64_t ld,
                                       const int32_t* targets, int V) {
  const int64_t row = blockIdx.x;
  const float* z = logits + row * ld;
  const MaxSum ms = row_max_sum(z, V);
  if (threadIdx.x == 0) {
    const double l = log(double(ms.s)) + double(ms.m);
    lse[row] = float(l);
    const int32_t t = targets[row];
    losses[row] = t == -1 ? 0.0f : (t < -1 || t >= V) ? NAN : float(l - double(z[t]));
  }
}

// d[i] = (softmax_i - [i == target]) * dloss from z and lse, into dlogits (type D: fp32 in place
// over the logits, bf16 in its own area, or fp32 rounded to f16 values in place). Each thread
// reads z[i] before it writes d[i], and only its own i: in place is safe.
template <typename D, bool kF16Values>
__global__ void head_ce_backward_kernel(D* dlogits, int64_t ldd, const float* logits, int64_t ld,
                                        const float* lse, const int32_t* targets, int V,
                                        float dloss) {
  const int64_t row = blockIdx.x;
  const float* z = logits + row * ld;
  D* d = dlogits + row * ldd;
  const int32_t t = targets[row];
  const float l = lse[row];
  const bool bad = t < -1 || t >= V;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    float g = 0.0f;
    if (bad) {
      g = NAN;
    } else if (t >= 0) {
      g = expf(z[i] - l) * dloss;
      if (i == t) g -= dloss;
    }
    if constexpr (kF16Values) g = __half2float(__float2half_rn(g));
    store_f32(d + i, g);
  }
}

}  // namespace

// ---- the chunk's GEMMs (gemm_internal.h: distill.cu's KD head uses them too) -------------
// The chunk's logits [n, V] (row stride ld) = x[n, C] x w[V, C]^T, fp32.
void chunk_logits(const Context& ctx, float* logits, const float* x, const float* w, int n, int C,
                  int V, int64_t ld) {
  mm(ctx, false, true, n, V, C, x, C, w, C, logits, ld, nullptr, false);
}
void chunk_logits(const Context& ctx, float* logits, const bf16_t* x, const bf16_t* w, int n, int C,
                  int V, int64_t ld) {
  mm(ctx, false, true, n, V, C, x, C, w, C, logits, ld, nullptr, false);
}
void chunk_logits(const Context& ctx, float* logits, const f16_t* x, const float* w, int n, int C,
                  int V, int64_t ld) {
  mm16(ctx, false, true, n, V, C, x, C, w, C, logits, ld, nullptr, false);
}

// dx[n, C] = dlogits x w (overwritten; skipped if null); dw[V, C] += dlogits^T x x (skipped if
// null): the kOutIn matmul_backward.
void chunk_backward(const Context& ctx, float* dx, float* dw, const float* dlogits, const float* x,
                    const float* w, int n, int C, int V, int64_t ld) {
  if (dx != nullptr) mm(ctx, false, false, n, C, V, dlogits, ld, w, C, dx, C, nullptr, false);
  if (dw != nullptr) mm(ctx, true, false, V, C, n, dlogits, ld, x, C, dw, C, nullptr, true);
}
void chunk_backward(const Context& ctx, bf16_t* dx, float* dw, const bf16_t* dlogits,
                    const bf16_t* x, const bf16_t* w, int n, int C, int V, int64_t ld) {
  if (dx != nullptr) mm(ctx, false, false, n, C, V, dlogits, ld, w, C, dx, C, nullptr, false);
  if (dw != nullptr) mm(ctx, true, false, V, C, n, dlogits, ld, x, C, dw, C, nullptr, true);
}
void chunk_backward(const Context& ctx, f16_t* dx, float* dw, const float* dlogits, const f16_t* x,
                    const float* w, int n, int C, int V, int64_t ld) {
  if (dx != nullptr) mm16(ctx, false, false, n, C, V, dlogits, ld, w, C, dx, C, nullptr, false);
  if (dw != nullptr) mm16(ctx, true, false, V, C, n, dlogits, ld, x, C, dw, C, nullptr, true);
}

namespace {

void check_head_args(int N, int C, int V, int chunk, int w_rows) {
  HR_CHECK_MSG(chunk >= 1 && V >= 1 && C >= 1 && N >= 0,
               "lm_head_ce: chunk, V and C must be positive");
  HR_CHECK_MSG(w_rows == 0 || w_rows >= V, "lm_head_ce: the weight has fewer rows than V");
}

template <typename T, typename TW>
void lm_head_ce_forward_t(const Context& ctx, float* losses, float* lse, const T* x, const TW* w,
                          const int32_t* targets, int N, int C, int V, int chunk, float* scratch,
                          int w_rows) {
  check_head_args(N, C, V, chunk, w_rows);
  const int64_t ld = head_ld(V);
  for (int c0 = 0; c0 < N; c0 += chunk) {
    const int n = std::min(chunk, N - c0);
    chunk_logits(ctx, scratch, x + int64_t{c0} * C, w, n, C, V, ld);
    head_ce_forward_kernel<<<unsigned(n), kCeThreads, 0, ctx.compute>>>(
        losses + c0, lse + c0, scratch, ld, targets + c0, V);
    HR_CUDA_LAUNCH_CHECK();
  }
}

template <typename T, typename TW>
void lm_head_ce_backward_t(const Context& ctx, T* dx, float* dw, const T* x, const TW* w,
                           const int32_t* targets, const float* lse, int N, int C, int V, int chunk,
                           float dloss, float* scratch, int w_rows) {
  check_head_args(N, C, V, chunk, w_rows);
  const int64_t ld = head_ld(V);
  for (int c0 = 0; c0 < N; c0 += chunk) {
    const int n = std::min(chunk, N - c0);
    const T* xc = x + int64_t{c0} * C;
    T* dxc = dx == nullptr ? nullptr : dx + int64_t{c0} * C;
    chunk_logits(ctx, scratch, xc, w, n, C, V, ld);
    if constexpr (std::is_same_v<T, bf16_t>) {
      // bf16 dlogits (as autocast feeds the bf16 GEMMs) in the area after the fp32 logits.
      bf16_t* dl = reinterpret_cast<bf16_t*>(scratch + int64_t{chunk} * ld);
      head_ce_backward_kernel<bf16_t, false><<<unsigned(n), kCeThreads, 0, ctx.compute>>>(
          dl, ld, scratch, ld, lse + c0, targets + c0, V, dloss);
      HR_CUDA_LAUNCH_CHECK();
      chunk_backward(ctx, dxc, dw, dl, xc, w, n, C, V, ld);
    } else {
      constexpr bool kF16 = std::is_same_v<T, f16_t>;
      head_ce_backward_kernel<float, kF16><<<unsigned(n), kCeThreads, 0, ctx.compute>>>(
          scratch, ld, scratch, ld, lse + c0, targets + c0, V, dloss);
      HR_CUDA_LAUNCH_CHECK();
      chunk_backward(ctx, dxc, dw, scratch, xc, w, n, C, V, ld);
    }
  }
}

}  // namespace

void set_allow_tf32(bool allow) { g_allow_tf32.store(allow, std::memory_order_relaxed); }
bool allow_tf32() { return g_allow_tf32.load(std::memory_order_relaxed); }

// ---- sizes -----------------------------------------------------------------------------------
int64_t CudaOps::activation_row_stride(int64_t cols, int64_t elem_bytes) const {
  return padded_cols(cols, elem_bytes);
}
int64_t CudaOps::logits_row_stride(int64_t V) const { return head_ld(V); }
size_t CudaOps::lm_head_ce_scratch_floats(int chunk, int V, DType storage) const {
  const size_t logits = size_t(chunk) * size_t(head_ld(V));
  // bf16: the chunk's dlogits in bf16 after its fp32 logits.
  return storage == DType::kBF16 ? logits + (logits + 1) / 2 : logits;
}
size_t CudaOps::f16_matmul_staging_floats(int64_t N, int64_t IC, int64_t OC) const {
  // The largest of a matmul's GEMMs stages two [N, *] operands: forward inp and an f16 out;
  // dinp dout and the fp32 dinp; dweight inp and dout. The weight is fp32 and never staged.
  return staged_floats(N, IC) + staged_floats(N, OC);
}
bool CudaOps::bf16_wgrad_transposes(int N, int IC, int OC) const {
  // cuBLASLt reads transposed operands itself: no copies.
  (void)N, (void)IC, (void)OC;
  return false;
}

// ---- matmuls ---------------------------------------------------------------------------------
void CudaOps::matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                             int N, int IC, int OC, WeightLayout layout,
                             MatmulStrides strides) const {
  matmul_forward_t(ctx_, out, inp, weight, bias, N, IC, OC, layout, strides);
}
void CudaOps::matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                              const float* inp, const float* weight, int N, int IC, int OC,
                              WeightLayout layout, MatmulStrides strides) const {
  matmul_backward_t(ctx_, dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout, strides);
}
void CudaOps::matmul_forward(float* out, const bf16_t* inp, const bf16_t* weight, const float* bias,
                             int N, int IC, int OC, WeightLayout layout,
                             MatmulStrides strides) const {
  matmul_forward_t(ctx_, out, inp, weight, bias, N, IC, OC, layout, strides);
}
void CudaOps::matmul_forward(bf16_t* out, const bf16_t* inp, const bf16_t* weight,
                             const float* bias, int N, int IC, int OC, WeightLayout layout,
                             MatmulStrides strides) const {
  matmul_forward_t(ctx_, out, inp, weight, bias, N, IC, OC, layout, strides);
}
void CudaOps::matmul_backward(bf16_t* dinp, float* dweight, float* dbias, const bf16_t* dout,
                              const bf16_t* inp, const bf16_t* weight, int N, int IC, int OC,
                              WeightLayout layout, MatmulStrides strides,
                              const WgradStaging& staging) const {
  // bf16_wgrad_transposes is false here, so callers pass an empty staging; a non-empty one is
  // the CPU's speed-up and changes no result, so it is not used.
  (void)staging;
  matmul_backward_t(ctx_, dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout, strides);
}
void CudaOps::matmul_forward(float* out, const f16_t* inp, const float* weight, const float* bias,
                             int N, int IC, int OC, WeightLayout layout,
                             MatmulStrides strides) const {
  matmul_forward16(ctx_, out, inp, weight, bias, N, IC, OC, layout, strides);
}
void CudaOps::matmul_forward(f16_t* out, const f16_t* inp, const float* weight, const float* bias,
                             int N, int IC, int OC, WeightLayout layout,
                             MatmulStrides strides) const {
  matmul_forward16(ctx_, out, inp, weight, bias, N, IC, OC, layout, strides);
}
void CudaOps::matmul_backward(f16_t* dinp, float* dweight, float* dbias, const f16_t* dout,
                              const f16_t* inp, const float* weight, int N, int IC, int OC,
                              WeightLayout layout, MatmulStrides strides) const {
  matmul_backward16(ctx_, dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout, strides);
}
void CudaOps::matmul_backward(f16_t* dinp, float* dweight, float* dbias, const float* dout,
                              const f16_t* inp, const float* weight, int N, int IC, int OC,
                              WeightLayout layout, MatmulStrides strides) const {
  matmul_backward16(ctx_, dinp, dweight, dbias, dout, inp, weight, N, IC, OC, layout, strides);
}
void CudaOps::bind_f16_staging(float* area, size_t floats, float** prev,
                               size_t* prev_floats) const {
  *prev = t_f16_staging;
  *prev_floats = t_f16_staging_floats;
  t_f16_staging = floats > 0 ? area : nullptr;
  t_f16_staging_floats = area != nullptr ? floats : 0;
}

// ---- the LM head fused with cross-entropy ----------------------------------------------------
void CudaOps::lm_head_ce_forward(float* losses, float* lse, const float* x,
                                 const GemmWeight<float>* w, const int32_t* targets, int N, int C,
                                 int V, int chunk, float* scratch, int w_rows) const {
  lm_head_ce_forward_t(ctx_, losses, lse, x, w, targets, N, C, V, chunk, scratch, w_rows);
}
void CudaOps::lm_head_ce_backward(float* dx, float* dw, const float* x, const GemmWeight<float>* w,
                                  const int32_t* targets, const float* lse, int N, int C, int V,
                                  int chunk, float dloss, float* scratch, int w_rows) const {
  lm_head_ce_backward_t(ctx_, dx, dw, x, w, targets, lse, N, C, V, chunk, dloss, scratch, w_rows);
}
void CudaOps::lm_head_ce_forward(float* losses, float* lse, const bf16_t* x,
                                 const GemmWeight<bf16_t>* w, const int32_t* targets, int N, int C,
                                 int V, int chunk, float* scratch, int w_rows) const {
  lm_head_ce_forward_t(ctx_, losses, lse, x, w, targets, N, C, V, chunk, scratch, w_rows);
}
void CudaOps::lm_head_ce_backward(bf16_t* dx, float* dw, const bf16_t* x,
                                  const GemmWeight<bf16_t>* w, const int32_t* targets,
                                  const float* lse, int N, int C, int V, int chunk, float dloss,
                                  float* scratch, int w_rows) const {
  lm_head_ce_backward_t(ctx_, dx, dw, x, w, targets, lse, N, C, V, chunk, dloss, scratch, w_rows);
}
void CudaOps::lm_head_ce_forward(float* losses, float* lse, const f16_t* x,
                                 const GemmWeight<f16_t>* w, const int32_t* targets, int N, int C,
                                 int V, int chunk, float* scratch, int w_rows) const {
  lm_head_ce_forward_t(ctx_, losses, lse, x, w, targets, N, C, V, chunk, scratch, w_rows);
}
void CudaOps::lm_head_ce_backward(f16_t* dx, float* dw, const f16_t* x, const GemmWeight<f16_t>* w,
                                  const int32_t* targets, const float* lse, int N, int C, int V,
                                  int chunk, float dloss, float* scratch, int w_rows) const {
  lm_head_ce_backward_t(ctx_, dx, dw, x, w, targets, lse, N, C, V, chunk, dloss, scratch, w_rows);
}

}  // namespace headroom::backend::cuda
