// Planning speed: the whole search (`headroom plan`) on metadata only, for GPT-2 124M and for
// GPT-shaped 7B and 70B configurations. The planner issue asks for well under 100 ms at 70B.
#include <benchmark/benchmark.h>

#include "core/units.h"
#include "plan/search.h"

namespace headroom::plan {
namespace {

model::Gpt2Config gpt(int L, int C, int NH, int P) {
  model::Gpt2Config c;
  c.n_layer = L;
  c.n_embd = C;
  c.n_head = NH;
  c.vocab_size = 50257;
  c.n_positions = P;
  return c;
}

void run(benchmark::State& state, const model::Gpt2Config& c, const char* device, uint64_t memory,
         int devices, int seq, int global, bool sweep) {
  Result<DeviceSpec> dev = named_device(device);
  if (!dev.is_ok()) {
    state.SkipWithError(dev.status().to_string().c_str());
    return;
  }
  SearchRequest r;
  r.config = c;
  r.device = *dev;
  r.device_memory = memory;
  r.devices = devices;
  r.seq = seq;
  r.global_batch = global;
  r.sweep = sweep;
  int placed = 0;
  for (auto _ : state) {
    Result<SearchResult> res = search_plan(r);
    if (!res.is_ok()) {
      state.SkipWithError(res.status().to_string().c_str());
      return;
    }
    placed = res->plans_placed;
    benchmark::DoNotOptimize(res->max_micro_batch);
  }
  state.counters["plans_placed"] = placed;
}

void BM_PlanGpt2_4GiB(benchmark::State& s) {
  run(s, gpt(12, 768, 12, 1024), "A100-40GB", 4 * kGiB, 1, 256, 64, true);
}
void BM_PlanGpt7B_4xL4(benchmark::State& s) {
  run(s, gpt(32, 4096, 32, 4096), "L4", 24 * kGiB, 4, 2048, 64, false);
}
void BM_PlanGpt70B_H100(benchmark::State& s) {
  run(s, gpt(80, 8192, 64, 4096), "H100-80GB", 80 * kGiB, 1, 4096, 64, true);
}
void BM_PlanGpt70B_8xH200(benchmark::State& s) {
  run(s, gpt(80, 8192, 64, 4096), "H200", 141 * kGiB, 8, 4096, 64, true);
}
BENCHMARK(BM_PlanGpt2_4GiB)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanGpt7B_4xL4)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanGpt70B_H100)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanGpt70B_8xH200)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace headroom::plan

BENCHMARK_MAIN();
