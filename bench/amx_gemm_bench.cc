// Our AMX GEMM against oneDNN's on the bf16 GEMMs of GPT-2 124M's step at 2048 tokens, both
// through cpu::gemm_ex exactly as the model calls it, alternated call by call in one process
// (HEADROOM_BF16_GEMM=onednn for oneDNN's), each call timed by the process's CPU time. On this
// shared machine the AMX unit's rate moves 4x within seconds (docs/gemm.md), so what this
// prints is the median of the per-round ratios, which moves far less than either time.
//
//   amx_gemm_bench [--rounds R] [--warm] [--filter SUBSTRING]
//
// By default a 640 MB write before every call evicts the operands from the caches, as in a step
// (every layer's weights and activations were last touched long before); --warm leaves them in.
// Prints a Markdown table; its last row times oneDNN against itself, the noise floor of the
// ratios in that run. Results and the command: docs/gemm.md, "Our own AMX GEMM".
#include <omp.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/amx_gemm.h"
#include "backend/cpu/bf16.h"
#include "backend/cpu/gemm.h"

namespace {

using headroom::bf16_t;
using headroom::DType;

double cpu_ms() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

struct Case {
  const char* name;
  bool trans_a, trans_b;
  int M, N, K;
  DType c_type;
  bool bias, accumulate;
  bool control = false;  // both sides oneDNN: the noise floor of a median ratio in this run
};

// The model's calls (gpt2.cc, kernels.cc): forward y = x W (+ b), backward-data dx = dy W^T,
// weight gradients from the transposed copies (the MLP's and the head's) or strided (attention's).
const Case kCases[] = {
    {"c_attn forward", false, false, 2048, 2304, 768, DType::kBF16, true, false},
    {"attn c_proj forward", false, false, 2048, 768, 768, DType::kF32, true, false},
    {"c_fc forward", false, false, 2048, 3072, 768, DType::kBF16, true, false},
    {"mlp c_proj forward", false, false, 2048, 768, 3072, DType::kF32, true, false},
    {"c_attn backward-data", false, true, 2048, 768, 2304, DType::kBF16, false, false},
    {"attn c_proj backward-data", false, true, 2048, 768, 768, DType::kBF16, false, false},
    {"c_fc backward-data", false, true, 2048, 768, 3072, DType::kBF16, false, false},
    {"mlp c_proj backward-data", false, true, 2048, 3072, 768, DType::kBF16, false, false},
    {"c_fc weight (transposed copies)", false, true, 768, 3072, 2048, DType::kF32, false, true},
    {"mlp c_proj weight (transposed copies)", false, true, 3072, 768, 2048, DType::kF32, false,
     true},
    {"head forward (50304 columns)", false, true, 2048, 50304, 768, DType::kF32, false, false},
    {"head weight (V = 50257 rows)", false, true, 50257, 768, 2048, DType::kF32, false, true},
    {"control: oneDNN against itself, c_attn forward", false, false, 2048, 2304, 768, DType::kBF16,
     true, false, true},
};

struct Free {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<char[], Free>;
Buffer buffer(size_t bytes) {
  const size_t huge = size_t{2} << 20;
  bytes = (bytes + huge - 1) / huge * huge;
  auto* p = static_cast<char*>(std::aligned_alloc(huge, bytes));
  if (p == nullptr) {
    std::fprintf(stderr, "amx_gemm_bench: out of memory (%zu bytes)\n", bytes);
    std::exit(1);
  }
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 0, bytes);
  return Buffer(p);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 9;
  bool warm = false;
  std::string filter;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--rounds" && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
    } else if (a == "--warm") {
      warm = true;
    } else if (a == "--filter" && i + 1 < argc) {
      filter = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--rounds R >= 1] [--warm] [--filter SUBSTRING]\n", argv[0]);
      return 2;
    }
  }
  if (rounds < 1) {
    std::fprintf(stderr, "amx_gemm_bench: --rounds must be >= 1\n");
    return 2;
  }
  if (!headroom::cpu::amx_usable()) {
    std::fprintf(stderr, "amx_gemm_bench: no AMX-BF16 on this CPU: nothing to compare\n");
    return 0;
  }
  const size_t flush_bytes = size_t{640} << 20;
  Buffer flush = warm ? Buffer() : buffer(flush_bytes);
  std::printf("%d threads, %s operands, median of %d rounds (one call of each a round)\n\n",
              omp_get_max_threads(), warm ? "warm" : "cold", rounds);
  std::printf(
      "| GEMM (M x N x K) | oneDNN CPU ms | oneDNN GFLOP/s | ours / oneDNN | p25 - p75 |\n");
  std::printf("|---|---:|---:|---:|---|\n");
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (const Case& c : kCases) {
    if (!filter.empty() && std::string(c.name).find(filter) == std::string::npos) continue;
    const int lda = c.trans_a ? c.M : c.K, ldb = c.trans_b ? c.K : c.N;
    const size_t na = size_t(c.M) * c.K, nb = size_t(c.K) * c.N, nc = size_t(c.M) * c.N;
    Buffer a = buffer(na * 2), b = buffer(nb * 2), bias = buffer(size_t(c.N) * 4);
    Buffer out[2] = {buffer(nc * 4), buffer(nc * 4)};
    auto* a16 = reinterpret_cast<bf16_t*>(a.get());
    auto* b16 = reinterpret_cast<bf16_t*>(b.get());
    for (size_t i = 0; i < na; ++i) a16[i] = headroom::cpu::from_f32<bf16_t>(dist(rng));
    for (size_t i = 0; i < nb; ++i) b16[i] = headroom::cpu::from_f32<bf16_t>(dist(rng));
    for (int i = 0; i < c.N; ++i) reinterpret_cast<float*>(bias.get())[i] = dist(rng);
    std::vector<double> ratio, onednn_ms;
    for (int r = 0; r <= rounds; ++r) {  // round 0 warms up (and creates oneDNN's primitive)
      double ms[2];
      // The two sides take turns at going first: the call after the other one runs measurably
      // faster here (the control read 0.92 with oneDNN always first).
      for (int turn = 0; turn < 2; ++turn) {
        const int v = (turn + r) % 2;
        ::setenv("HEADROOM_BF16_GEMM", v == 0 || c.control ? "onednn" : "auto", 1);
        if (!warm) std::memset(flush.get(), r + v, flush_bytes);
        const double t0 = cpu_ms();
        headroom::cpu::gemm_ex(c.trans_a, c.trans_b, c.M, c.N, c.K, DType::kBF16, a.get(), lda,
                               b.get(), ldb, c.c_type, out[v].get(), c.N,
                               c.bias ? reinterpret_cast<const float*>(bias.get()) : nullptr,
                               c.accumulate);
        ms[v] = cpu_ms() - t0;
      }
      if (r > 0) {
        ratio.push_back(ms[1] / ms[0]);
        onednn_ms.push_back(ms[0]);
      }
    }
    ::unsetenv("HEADROOM_BF16_GEMM");
    std::vector<double> sorted = ratio;
    std::sort(sorted.begin(), sorted.end());
    const double ms = median(onednn_ms);
    // CPU time of all threads: GFLOP/s per thread-second x threads = the wall-clock rate if the
    // threads had the cores to themselves.
    const double gflops = 2.0 * c.M * c.N * c.K / (ms / omp_get_max_threads()) / 1e6;
    std::printf("| %s (%d x %d x %d) | %.1f | %.0f | %.2f | %.2f - %.2f |\n", c.name, c.M, c.N, c.K,
                ms, gflops, median(ratio), sorted[sorted.size() / 4],
                sorted[sorted.size() * 3 / 4]);
    std::fflush(stdout);
  }
  return 0;
}
