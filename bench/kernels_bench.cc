// Memory-bound kernels against this machine's memory bandwidth: each benchmark reports the bytes
// it must move (read + write, counted once) per second, and the ratio to a STREAM-like triad
// measured in the same process. Sizes are far larger than the caches (GPT-2 124M shapes at 2048
// tokens; AdamW over 124M parameters).
#include <benchmark/benchmark.h>

#include <vector>

#include "backend/cpu/kernels.h"

namespace headroom::cpu {
namespace {

// One prefaulted block per benchmark: the first touch of a page must not be timed.
std::vector<float> buffer(size_t n, float v) { return std::vector<float>(n, v); }

void BM_Triad(benchmark::State& state) {
  const size_t n = size_t(64) << 20;  // 3 x 256 MiB
  std::vector<float> a = buffer(n, 0), b = buffer(n, 1), c = buffer(n, 2);
  for (auto _ : state) {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = b[i] + 0.5f * c[i];
    benchmark::DoNotOptimize(a.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(n) * 12);
}

constexpr int N = 2048, C = 768;

void BM_LayerNormForward(benchmark::State& state) {
  std::vector<float> inp = buffer(size_t(N) * C, 0.5f), out = buffer(size_t(N) * C, 0),
                     w = buffer(C, 1), b = buffer(C, 0), mean = buffer(N, 0), rstd = buffer(N, 0);
  for (auto _ : state) {
    layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(N) * C * 8);
}

void BM_LayerNormBackward(benchmark::State& state) {
  std::vector<float> inp = buffer(size_t(N) * C, 0.5f), dout = buffer(size_t(N) * C, 0.1f),
                     dinp = buffer(size_t(N) * C, 0), w = buffer(C, 1), dw = buffer(C, 0),
                     db = buffer(C, 0), mean = buffer(N, 0), rstd = buffer(N, 1);
  for (auto _ : state) {
    layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(),
                       mean.data(), rstd.data(), N, C);
  }
  // reads inp, dout, dinp; writes dinp
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(N) * C * 16);
}

void BM_GeluForward(benchmark::State& state) {
  const int64_t n = int64_t(N) * 4 * C;
  std::vector<float> inp = buffer(size_t(n), 0.3f), out = buffer(size_t(n), 0);
  for (auto _ : state) gelu_forward(out.data(), inp.data(), n);
  state.SetBytesProcessed(int64_t(state.iterations()) * n * 8);
}

void BM_GeluBackward(benchmark::State& state) {
  const int64_t n = int64_t(N) * 4 * C;
  std::vector<float> inp = buffer(size_t(n), 0.3f), d = buffer(size_t(n), 0.1f);
  for (auto _ : state) gelu_backward(d.data(), inp.data(), d.data(), n);
  state.SetBytesProcessed(int64_t(state.iterations()) * n * 12);
}

void BM_Residual(benchmark::State& state) {
  const int64_t n = int64_t(N) * C;
  std::vector<float> a = buffer(size_t(n), 1), b = buffer(size_t(n), 2);
  for (auto _ : state) residual_forward(a.data(), a.data(), b.data(), n);
  state.SetBytesProcessed(int64_t(state.iterations()) * n * 12);
}

void BM_AdamW(benchmark::State& state) {
  const int64_t n = 124'000'000;
  std::vector<float> p = buffer(size_t(n), 0.01f), g = buffer(size_t(n), 0.001f),
                     m = buffer(size_t(n), 0), v = buffer(size_t(n), 0);
  AdamWParams hp{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 1.0f};
  for (auto _ : state) adamw_update(p.data(), g.data(), m.data(), v.data(), n, hp);
  // reads p, g, m, v; writes p, m, v
  state.SetBytesProcessed(int64_t(state.iterations()) * n * 28);
}

void BM_CrossEntropyBackward(benchmark::State& state) {
  const int rows = 256, V = 50257;
  std::vector<float> logits = buffer(size_t(rows) * V, 0.01f);
  std::vector<int32_t> tg(rows, 7);
  for (auto _ : state) {
    cross_entropy_backward(logits.data(), logits.data(), tg.data(), rows, V, 1.0f / rows);
  }
  // two reads (statistics, then the gradient pass) and one write of the logits
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(rows) * V * 12);
}

BENCHMARK(BM_Triad)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_LayerNormForward)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_LayerNormBackward)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_GeluForward)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_GeluBackward)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Residual)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdamW)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CrossEntropyBackward)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace headroom::cpu

BENCHMARK_MAIN();
