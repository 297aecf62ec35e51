// oneDNN matmul (through headroom::cpu::gemm, the path the kernels use) against OpenBLAS
// cblas_sgemm on GPT-2 124M's GEMMs at B*T = 2048 tokens: forward, backward-data and
// backward-weight (accumulating), plus a plain 2048^3; and the same GEMMs in bf16 (oneDNN). Results
// and the command: docs/gemm.md.
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "backend/cpu/bf16.h"
#include "backend/cpu/gemm.h"
#include "backend/cpu/kernels.h"
#include "memory/host_resource.h"

namespace {

using headroom::cpu::WeightLayout;

constexpr int kTokens = 2048;  // B * T

struct Layer {
  const char* name;
  int N, IC, OC;
  WeightLayout layout;
  bool forward_only;
  headroom::DType bf16_forward_out;  // the forward's output type in the bf16 model (gpt2.cc)
  int out_ld = 0;  // the output activation's (and its gradient's) row stride; 0: dense (OC)
};

const Layer kLayers[] = {
    {"attn_qkv_768x2304", kTokens, 768, 2304, WeightLayout::kInOut, false, headroom::DType::kBF16},
    {"attn_proj_768x768", kTokens, 768, 768, WeightLayout::kInOut, false, headroom::DType::kF32},
    {"mlp_fc_768x3072", kTokens, 768, 3072, WeightLayout::kInOut, false, headroom::DType::kBF16},
    {"mlp_proj_3072x768", kTokens, 3072, 768, WeightLayout::kInOut, false, headroom::DType::kF32},
    {"lm_head_768x50257_outin", kTokens, 768, 50257, WeightLayout::kOutIn, false,
     headroom::DType::kF32},
    // The logits as the model stores them: rows padded to 64 elements (logits_row_stride).
    {"lm_head_768x50257_outin_ld50304", kTokens, 768, 50257, WeightLayout::kOutIn, false,
     headroom::DType::kF32, 50304},
    // The bf16 dlogits as the loss leaves them since session 13: each row's bf16 values over its
    // own fp32 row (row stride 2 x 50304 bf16 elements). Only its bf16 backward rows are the
    // model's.
    {"lm_head_768x50257_outin_ld100608", kTokens, 768, 50257, WeightLayout::kOutIn, false,
     headroom::DType::kF32, 100608},
    // The bf16 model's forward since session 6: all 50304 columns (dense output rows; the weight's
    // rows past V are the flat copy's next tensors). Its backward rows time K = 50304 and are not
    // what the model runs (it takes K = V).
    {"lm_head_768x50304_outin", kTokens, 768, 50304, WeightLayout::kOutIn, false,
     headroom::DType::kF32},
    {"square_2048", 2048, 2048, 2048, WeightLayout::kInOut, true, headroom::DType::kF32},
};

enum class Pass { kForward, kBackwardData, kBackwardWeight };
enum class Lib { kOneDnn, kOpenBlas };

// One GEMM as C[M,N] (+)= op(A) x op(B), in the same terms as headroom::cpu::gemm.
struct Gemm {
  bool ta, tb;
  int M, N, K, lda, ldb, ldc;
  bool accumulate;
  int64_t a_size, b_size, c_size;
};

// The GEMM that kernels.cc issues for a layer and pass (see matmul_forward/matmul_backward).
Gemm gemm_for(const Layer& l, Pass pass) {
  const bool io = l.layout == WeightLayout::kInOut;
  const int64_t n = l.N, ic = l.IC, oc = l.OC, lo = l.out_ld ? l.out_ld : l.OC;
  const int ldo = int(lo);
  switch (pass) {
    case Pass::kForward:  // out[N,OC] = inp[N,IC] x W
      return io ? Gemm{false, false, l.N,   l.OC,   l.IC,    l.IC,
                       l.OC,  ldo,   false, n * ic, ic * oc, n * lo}
                : Gemm{false, true, l.N,   l.OC,   l.IC,    l.IC,
                       l.IC,  ldo,  false, n * ic, ic * oc, n * lo};
    case Pass::kBackwardData:  // dinp[N,IC] = dout[N,OC] x W^T
      return io ? Gemm{false, true, l.N,   l.IC,   l.OC,    ldo,
                       l.OC,  l.IC, false, n * lo, ic * oc, n * ic}
                : Gemm{false, false, l.N,   l.IC,   l.OC,    ldo,
                       l.IC,  l.IC,  false, n * lo, ic * oc, n * ic};
    case Pass::kBackwardWeight:  // dW += inp^T x dout (kInOut) or dout^T x inp (kOutIn)
      return io ? Gemm{true, false, l.IC, l.OC, l.N, l.IC, ldo, l.OC, true, n * ic, n * lo, ic * oc}
                : Gemm{true, false, l.OC, l.IC,   l.N,    ldo,
                       l.IC, l.IC,  true, n * lo, n * ic, ic * oc};
  }
  return {};
}

void run_gemm(Lib lib, const Gemm& g, const float* A, const float* B, float* C) {
  if (lib == Lib::kOneDnn) {
    headroom::cpu::gemm(g.ta, g.tb, g.M, g.N, g.K, A, g.lda, B, g.ldb, C, g.ldc, nullptr,
                        g.accumulate);
  } else {
    cblas_sgemm(CblasRowMajor, g.ta ? CblasTrans : CblasNoTrans, g.tb ? CblasTrans : CblasNoTrans,
                g.M, g.N, g.K, 1.0f, A, g.lda, B, g.ldb, g.accumulate ? 1.0f : 0.0f, C, g.ldc);
  }
}

// Operand memory as the model's arenas hold it: mmap'ed, transparent huge pages asked for
// (memory::HostAllocator). With plain vectors (4 KiB pages) the LM head's 412 MB output ran 1.5-2x
// slower (TLB misses), which a training step never sees.
template <typename T>
using HostVec = std::vector<T, headroom::memory::HostAllocator<T>>;

HostVec<float> random_vec(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  HostVec<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Spot-checks a few entries of the GEMM's result (got(at), at = i * ldc + j) against a double dot
// product of the operands as stored, so a wrong GEMM (layout mix-up, library failure) fails the
// benchmark instead of timing garbage. Returns false (and skips the benchmark) on a mismatch.
template <typename T, typename Got>
bool spot_check(benchmark::State& state, const Gemm& g, const T* A, const T* B, Got got,
                double tol) {
  using headroom::cpu::to_f32;
  for (int k = 0; k < 4; ++k) {
    const int i = (k * 977) % g.M, j = (k * 1231) % g.N;
    double ref = 0.0;
    for (int p = 0; p < g.K; ++p) {
      const double a = to_f32(g.ta ? A[int64_t{p} * g.lda + i] : A[int64_t{i} * g.lda + p]);
      const double b = to_f32(g.tb ? B[int64_t{j} * g.ldb + p] : B[int64_t{p} * g.ldb + j]);
      ref += a * b;
    }
    const double v = got(int64_t{i} * g.ldc + j);
    if (std::abs(v - ref) > tol * (1.0 + std::abs(ref))) {
      state.SkipWithError(("wrong result at (" + std::to_string(i) + "," + std::to_string(j) +
                           "): " + std::to_string(v) + " vs " + std::to_string(ref))
                              .c_str());
      return false;
    }
  }
  return true;
}

// Times run() and reports GFLOP/s and GFLOP.
template <typename Run>
void time_gemm(benchmark::State& state, const Gemm& g, float* C, Run run) {
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(C);
    benchmark::ClobberMemory();
  }
  const double flops = 2.0 * g.M * g.N * g.K;
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP"] = flops * 1e-9;
}

void BM_Gemm(benchmark::State& state, Layer layer, Pass pass, Lib lib) {
  const Gemm g = gemm_for(layer, pass);
  HostVec<float> A = random_vec(g.a_size, 1), B = random_vec(g.b_size, 2);
  HostVec<float> C(g.c_size, 0.0f);

  run_gemm(lib, g, A.data(), B.data(), C.data());
  auto got = [&](int64_t at) -> double { return C[at]; };
  if (!spot_check(state, g, A.data(), B.data(), got, 1e-3)) return;
  time_gemm(state, g, C.data(), [&] { run_gemm(lib, g, A.data(), B.data(), C.data()); });
  if (lib == Lib::kOneDnn) {
    state.SetLabel(headroom::cpu::gemm_impl_name(g.ta, g.tb, g.M, g.N, g.K, g.lda, g.ldb, g.ldc,
                                                 false, g.accumulate));
  }
}

// The same GEMMs with bf16 operands, as the bf16 model issues them (gpt2.cc, fused_head.cc): the
// forward into the layer's output type, backward-data into bf16, backward-weight accumulating
// into fp32. oneDNN only (OpenBLAS 0.3.21 has no bf16 x bf16 -> bf16 GEMM).
void BM_GemmBf16(benchmark::State& state, Layer layer, Pass pass) {
  using headroom::bf16_t;
  using headroom::DType;
  const Gemm g = gemm_for(layer, pass);
  const DType c_type = pass == Pass::kForward        ? layer.bf16_forward_out
                       : pass == Pass::kBackwardData ? DType::kBF16
                                                     : DType::kF32;
  HostVec<float> Af = random_vec(g.a_size, 1), Bf = random_vec(g.b_size, 2);
  HostVec<bf16_t> A(g.a_size), B(g.b_size);
  for (int64_t i = 0; i < g.a_size; ++i) A[i] = headroom::cpu::from_f32<bf16_t>(Af[i]);
  for (int64_t i = 0; i < g.b_size; ++i) B[i] = headroom::cpu::from_f32<bf16_t>(Bf[i]);
  HostVec<float> C(g.c_size, 0.0f);  // bf16 output uses the first half
  auto run = [&] {
    headroom::cpu::gemm_ex(g.ta, g.tb, g.M, g.N, g.K, DType::kBF16, A.data(), g.lda, B.data(),
                           g.ldb, c_type, C.data(), g.ldc, nullptr, g.accumulate);
  };
  run();
  auto got = [&](int64_t at) -> double {
    return c_type == DType::kF32
               ? C[at]
               : headroom::cpu::to_f32(reinterpret_cast<const bf16_t*>(C.data())[at]);
  };
  if (!spot_check(state, g, A.data(), B.data(), got, 1e-2)) return;
  time_gemm(state, g, C.data(), run);
  state.SetLabel(headroom::cpu::gemm_impl_name(g.ta, g.tb, g.M, g.N, g.K, g.lda, g.ldb, g.ldc,
                                               false, g.accumulate, DType::kBF16, c_type));
}

// The bf16 LM head's weight gradient as the model runs it (matmul_backward's transposed path,
// kOutIn): dlogits [2048, 50257] at row stride 2 x 50304 (each row over its own fp32 row), its
// transpose going through a staging of `rows` rows of dlogits^T at a time (0: all 50257 at once, as
// before session 13), then a GEMM per chunk. Copies included in the time.
void BM_HeadWgradStaged(benchmark::State& state, int rows) {
  using headroom::bf16_t;
  const int N = kTokens, C = 768, V = 50257;
  const int64_t ld = 2 * 50304;
  const int chunk = rows > 0 ? rows : V;
  HostVec<bf16_t> dout(size_t(N) * ld), inp(size_t(N) * C);
  HostVec<bf16_t> staging(size_t(N) * (C + chunk));
  HostVec<float> dw(size_t(V) * C, 0.0f);
  const HostVec<float> r = random_vec(int64_t(N) * C, 3);
  for (size_t i = 0; i < dout.size(); ++i)
    dout[i] = headroom::cpu::from_f32<bf16_t>(r[i % r.size()]);
  for (size_t i = 0; i < inp.size(); ++i) inp[i] = headroom::cpu::from_f32<bf16_t>(r[i]);
  const headroom::cpu::Bf16WgradStaging ws{staging.data(), size_t(N) * C,
                                           staging.data() + size_t(N) * C, size_t(N) * chunk};
  const Gemm g{true, false, V, C, N, int(ld), C, C, true, 0, 0, 0};
  time_gemm(state, g, dw.data(), [&] {
    headroom::cpu::matmul_backward(nullptr, dw.data(), nullptr, dout.data(), inp.data(), nullptr, N,
                                   C, V, WeightLayout::kOutIn, {.inp = 0, .out = ld}, ws);
  });
}

void register_all() {
  const std::pair<Pass, const char*> passes[] = {{Pass::kForward, "fwd"},
                                                 {Pass::kBackwardData, "bwd_data"},
                                                 {Pass::kBackwardWeight, "bwd_weight"}};
  const std::pair<Lib, const char*> libs[] = {{Lib::kOneDnn, "onednn"},
                                              {Lib::kOpenBlas, "openblas"}};
  for (const Layer& layer : kLayers) {
    for (auto [pass, pass_name] : passes) {
      if (layer.forward_only && pass != Pass::kForward) continue;
      for (auto [lib, lib_name] : libs) {
        const std::string name =
            std::string("gemm/") + layer.name + "/" + pass_name + "/" + lib_name;
        benchmark::RegisterBenchmark(name.c_str(), BM_Gemm, layer, pass, lib)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
      const std::string name = std::string("gemm_bf16/") + layer.name + "/" + pass_name;
      benchmark::RegisterBenchmark(name.c_str(), BM_GemmBf16, layer, pass)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  for (int rows : {0, 1024, 3072}) {
    const std::string name = "gemm_bf16/lm_head_wgrad_staged/" +
                             (rows > 0 ? std::to_string(rows) + "_rows" : std::string("whole"));
    benchmark::RegisterBenchmark(name.c_str(), BM_HeadWgradStaged, rows)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  benchmark::AddCustomContext("omp_max_threads", std::to_string(omp_get_max_threads()));
  benchmark::AddCustomContext("openblas_threads", std::to_string(openblas_get_num_threads()));
  benchmark::AddCustomContext("openblas_config", openblas_get_config());
  benchmark::AddCustomContext("openblas_core", openblas_get_corename());
  benchmark::AddCustomContext("OPENBLAS_CORETYPE", coretype ? coretype : "(unset)");
  const dnnl_version_t* v = dnnl_version();
  benchmark::AddCustomContext("onednn", std::to_string(v->major) + "." + std::to_string(v->minor) +
                                            "." + std::to_string(v->patch));
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  std::fprintf(stderr, "oneDNN user scratchpad: %zu bytes shared by %zu cached primitives\n",
               headroom::cpu::gemm_scratchpad_bytes(), headroom::cpu::gemm_cached_primitives());
  benchmark::Shutdown();
  return 0;
}
