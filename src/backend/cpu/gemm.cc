// oneDNN matmul behind headroom::cpu::gemm, with the primitive cache. See gemm.h; the choice of
// oneDNN over OpenBLAS is measured in docs/gemm.md.
#include "backend/cpu/gemm.h"

#include <omp.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>

#include <oneapi/dnnl/dnnl.hpp>

#include "backend/cpu/amx_gemm.h"
#include "core/check.h"

namespace headroom::cpu {
namespace {

struct GemmKey {
  int M, N, K, lda, ldb, ldc, threads;
  bool trans_a, trans_b, has_bias, accumulate;
  DType ab_type, c_type;
  bool operator==(const GemmKey&) const = default;
};

struct GemmKeyHash {
  size_t operator()(const GemmKey& k) const {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    for (int v : {k.M, k.N, k.K, k.lda, k.ldb, k.ldc, k.threads}) mix(static_cast<uint32_t>(v));
    mix((k.trans_a ? 1 : 0) | (k.trans_b ? 2 : 0) | (k.has_bias ? 4 : 0) | (k.accumulate ? 8 : 0) |
        (uint32_t(k.ab_type) << 4) | (uint32_t(k.c_type) << 8));
    return static_cast<size_t>(h);
  }
};

// One cached primitive with its memory objects. The memory objects are created once with no
// data; each call only swaps their data handles. Execution goes through the C API with a fixed
// argument array because the C++ execute() builds a std::vector on every call.
struct GemmEntry {
  dnnl::matmul prim;
  dnnl::memory src, wei, dst, bias, scratch;
  std::array<dnnl_exec_arg_t, 5> args{};
  int nargs = 0;
  size_t scratch_bytes = 0;
  std::string impl;
};

struct AlignedFree {
  void operator()(char* p) const { ::operator delete[](p, std::align_val_t(64)); }
};

class GemmCache {
 public:
  static GemmCache& get() {
    static GemmCache cache;
    return cache;
  }

  void run(const GemmKey& key, const void* A, const void* B, void* C, const float* bias) {
    std::lock_guard<std::mutex> lock(mu_);
    GemmEntry& e = entry(key);
    e.src.set_data_handle(const_cast<void*>(A));
    e.wei.set_data_handle(const_cast<void*>(B));
    e.dst.set_data_handle(C);
    if (key.has_bias) e.bias.set_data_handle(const_cast<float*>(bias));
    if (e.scratch_bytes > 0) e.scratch.set_data_handle(scratch_.get());
    dnnl_status_t st = dnnl_primitive_execute(e.prim.get(), stream_.get(), e.nargs, e.args.data());
    HR_CHECK_MSG(st == dnnl_success, "oneDNN matmul execution failed");
    stream_.wait();
  }

  const char* impl_name(const GemmKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    return entry(key).impl.c_str();
  }

  size_t scratch_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return scratch_capacity_;
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return cache_.size();
  }

 private:
  GemmCache() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}

  GemmEntry& entry(const GemmKey& key) {
    auto it = cache_.find(key);
    if (it != cache_.end()) return *it->second;
    auto e = std::make_unique<GemmEntry>();
    try {
      create(key, *e);
    } catch (const dnnl::error& err) {
      std::string msg = std::string("oneDNN matmul creation failed: ") + err.what();
      ::headroom::detail::check_failed(__FILE__, __LINE__, "create(key)", msg.c_str());
    }
    return *cache_.emplace(key, std::move(e)).first->second;
  }

  void create(const GemmKey& k, GemmEntry& e) {
    using dims = dnnl::memory::dims;
    using dt = dnnl::memory::data_type;
    // A row-major [R, C] matrix stored with leading dimension ld, or its transpose view.
    auto to_dt = [](DType t) { return t == DType::kBF16 ? dt::bf16 : dt::f32; };
    auto md = [](int64_t rows, int64_t cols, int64_t ld, bool trans, dt type) {
      dims strides = trans ? dims{1, ld} : dims{ld, 1};
      return dnnl::memory::desc(dims{rows, cols}, type, strides);
    };
    dnnl::memory::desc src_md = md(k.M, k.K, k.lda, k.trans_a, to_dt(k.ab_type));
    dnnl::memory::desc wei_md = md(k.K, k.N, k.ldb, k.trans_b, to_dt(k.ab_type));
    dnnl::memory::desc dst_md = md(k.M, k.N, k.ldc, false, to_dt(k.c_type));
    dnnl::memory::desc bias_md(dims{1, k.N}, dt::f32, dims{k.N, 1});

    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (k.accumulate) {
      dnnl::post_ops po;
      po.append_sum(1.0f);  // dst = old dst + matmul: accumulation without a temporary
      attr.set_post_ops(po);
    }
    auto desc = k.has_bias ? dnnl::matmul::desc(src_md, wei_md, bias_md, dst_md)
                           : dnnl::matmul::desc(src_md, wei_md, dst_md);
    dnnl::matmul::primitive_desc pd(desc, attr, engine_);
    // fp32 GEMMs take oneDNN's gemm:jit where it offers one: oneDNN 2.6 ranks brg:avx512_core
    // first for dense rows, which was 3-9% slower on GPT-2's 768-wide shapes (docs/gemm.md,
    // session 6). bf16 keeps oneDNN's order (its AMX brgemm).
    // Measurement knob (docs/gemm.md): HEADROOM_GEMM_PREFER=<prefix> takes the first of oneDNN's
    // implementations for this shape whose name starts with the prefix (e.g. "gemm:jit"), if any;
    // set but empty, oneDNN's own order for every type. Read at every creation (rare), so a test
    // can set it for the shapes it creates.
    const char* env = std::getenv("HEADROOM_GEMM_PREFER");
    const char* prefer = env != nullptr ? env : (k.ab_type == DType::kF32 ? "gemm:jit" : nullptr);
    if (prefer != nullptr && *prefer != '\0') {
      dnnl::matmul::primitive_desc it = pd;
      do {
        if (std::string(it.impl_info_str()).rfind(prefer, 0) == 0) {
          pd = it;
          break;
        }
      } while (it.next_impl());
    }
    e.prim = dnnl::matmul(pd);
    e.impl = pd.impl_info_str();
    e.src = dnnl::memory(src_md, engine_, DNNL_MEMORY_NONE);
    e.wei = dnnl::memory(wei_md, engine_, DNNL_MEMORY_NONE);
    e.dst = dnnl::memory(dst_md, engine_, DNNL_MEMORY_NONE);
    e.args[e.nargs++] = {DNNL_ARG_SRC, e.src.get()};
    e.args[e.nargs++] = {DNNL_ARG_WEIGHTS, e.wei.get()};
    e.args[e.nargs++] = {DNNL_ARG_DST, e.dst.get()};
    if (k.has_bias) {
      e.bias = dnnl::memory(bias_md, engine_, DNNL_MEMORY_NONE);
      e.args[e.nargs++] = {DNNL_ARG_BIAS, e.bias.get()};
    }
    dnnl::memory::desc scratch_md = pd.scratchpad_desc();
    e.scratch_bytes = scratch_md.get_size();
    if (e.scratch_bytes > 0) {
      e.scratch = dnnl::memory(scratch_md, engine_, DNNL_MEMORY_NONE);
      e.args[e.nargs++] = {DNNL_ARG_SCRATCHPAD, e.scratch.get()};
      if (e.scratch_bytes > scratch_capacity_) {
        // One-time growth at primitive creation; every primitive shares this one buffer
        // because calls are serialised.
        scratch_.reset(static_cast<char*>(::operator new[](e.scratch_bytes, std::align_val_t(64))));
        scratch_capacity_ = e.scratch_bytes;
      }
    }
  }

  std::mutex mu_;
  dnnl::engine engine_;
  dnnl::stream stream_;
  std::unordered_map<GemmKey, std::unique_ptr<GemmEntry>, GemmKeyHash> cache_;
  std::unique_ptr<char[], AlignedFree> scratch_;
  size_t scratch_capacity_ = 0;
};

GemmKey make_key(bool trans_a, bool trans_b, int M, int N, int K, int lda, int ldb, int ldc,
                 bool has_bias, bool accumulate, DType ab_type, DType c_type) {
  HR_CHECK(M > 0 && N > 0 && K > 0);
  HR_CHECK((ab_type == DType::kF32 || ab_type == DType::kBF16) &&
           (c_type == DType::kF32 || c_type == DType::kBF16));
  HR_CHECK(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N) && ldc >= N);
  // Inside a parallel region oneDNN (OpenMP runtime) runs on the calling thread only.
  int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  return GemmKey{M,       N,       K,        lda,        ldb,     ldc,   threads,
                 trans_a, trans_b, has_bias, accumulate, ab_type, c_type};
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda, const float* B,
          int ldb, float* C, int ldc, const float* bias, bool accumulate) {
  GemmKey key = make_key(trans_a, trans_b, M, N, K, lda, ldb, ldc, bias != nullptr, accumulate,
                         DType::kF32, DType::kF32);
  GemmCache::get().run(key, A, B, C, bias);
}

void gemm_ex(bool trans_a, bool trans_b, int M, int N, int K, DType ab_type, const void* A, int lda,
             const void* B, int ldb, DType c_type, void* C, int ldc, const float* bias,
             bool accumulate) {
  GemmKey key = make_key(trans_a, trans_b, M, N, K, lda, ldb, ldc, bias != nullptr, accumulate,
                         ab_type, c_type);
  // bf16 products go to our AMX kernel where it takes them (amx_gemm.h), except with A
  // transposed: staging A^T a 32-row panel at a time ran 1.17-1.23x oneDNN's time on the
  // attention's weight gradients, whose strided kernel reads it in place (docs/gemm.md).
  if (ab_type == DType::kBF16 && !trans_a && amx_gemm_takes(K, c_type)) {
    amx_gemm(trans_a, trans_b, M, N, K, static_cast<const bf16_t*>(A), lda,
             static_cast<const bf16_t*>(B), ldb, c_type, C, ldc, bias, accumulate);
    return;
  }
  GemmCache::get().run(key, A, B, C, bias);
}

const char* gemm_impl_name(bool trans_a, bool trans_b, int M, int N, int K, int lda, int ldb,
                           int ldc, bool has_bias, bool accumulate, DType ab_type, DType c_type) {
  if (ab_type == DType::kBF16 && !trans_a && amx_gemm_takes(K, c_type)) return "headroom:amx";
  return GemmCache::get().impl_name(
      make_key(trans_a, trans_b, M, N, K, lda, ldb, ldc, has_bias, accumulate, ab_type, c_type));
}

size_t gemm_scratchpad_bytes() { return GemmCache::get().scratch_bytes(); }
size_t gemm_cached_primitives() { return GemmCache::get().size(); }

}  // namespace headroom::cpu
