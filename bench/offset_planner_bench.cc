// Offset planner speed and quality: plan_offsets on transformer training schedules of about 100,
// 1,000 and 10,000 buffers, and on random lifetimes (the planner's slow case: free memory full of
// holes). Counters: buffers/s, size/lower_bound. Results and command: docs/notes/offset-planner.md.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "memory/offset_planner.h"

namespace {

using headroom::memory::LiveRange;
using headroom::memory::OffsetPlan;

// One optimizer step of `layers` GPT blocks over `micro_batches` micro-batches, every other layer
// recomputed (bf16, tokens = b*t, width C, heads NH, sequence T, vocab V): saved activations,
// recompute copies, forward and backward scratch, the gradient ping-pong, logits, and per-layer
// weight gradients that live from their first backward to the optimizer. The same shape as
// transformer_step() in tests/memory/offset_planner_test.cc.
std::vector<LiveRange> transformer_step(int layers, int micro_batches, uint64_t tokens = 4096,
                                        uint64_t C = 8192, uint64_t NH = 64, uint64_t T = 4096,
                                        uint64_t V = 128256) {
  const uint64_t a = 64;
  const uint64_t act = tokens * C * 2;
  const uint64_t probs = (tokens / T) * NH * T * T * 2;
  const uint64_t layer_grads = (12 * C * C + 13 * C) * 4;
  std::vector<LiveRange> b;
  int op = 0;
  std::vector<int> first_backward(layers, -1);
  for (int m = 0; m < micro_batches; m++) {
    std::vector<int> fwd(layers);
    for (int l = 0; l < layers; l++) fwd[l] = op++;
    const int loss = op++;
    std::vector<int> rec(layers), bwd(layers);
    for (int l = layers - 1; l >= 0; l--) {
      rec[l] = l % 2 ? op++ : -1;
      bwd[l] = op++;
      if (first_backward[l] < 0) first_backward[l] = l % 2 ? rec[l] : bwd[l];
    }
    const uint64_t internals[] = {act, 3 * act, probs, act, act, 4 * act, 4 * act};
    for (int l = 0; l < layers; l++) {
      b.push_back({act, a, fwd[l], bwd[l]});
      for (uint64_t bytes : internals) {
        if (rec[l] >= 0) {
          b.push_back({bytes, a, fwd[l], fwd[l]});
          b.push_back({bytes, a, rec[l], bwd[l]});
        } else {
          b.push_back({bytes, a, fwd[l], bwd[l]});
        }
      }
      b.push_back({2 * act, a, fwd[l], fwd[l]});
      b.push_back({act, a, bwd[l], bwd[l] + 1});
      b.push_back({4 * act, a, bwd[l], bwd[l]});
      b.push_back({probs, a, bwd[l], bwd[l]});
      b.push_back({3 * C * 4 + 100, 64, bwd[l], bwd[l]});
    }
    b.push_back({tokens * V * 4, a, fwd[layers - 1], loss});
    b.push_back({tokens * V * 2, a, loss, bwd[layers - 1]});
    b.push_back({act, a, loss, bwd[0]});
    b.push_back({tokens * 8, a, fwd[0], loss});
  }
  for (int l = 0; l < layers; l++) b.push_back({layer_grads, a, first_backward[l], op});
  return b;
}

std::vector<LiveRange> random_lifetimes(int n, int ops, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<LiveRange> b(n);
  for (LiveRange& r : b) {
    r.bytes = 64 * (1 + rng() % 1024);
    r.first = int32_t(rng() % ops);
    r.last = r.first + int32_t(rng() % std::min<uint64_t>(ops - r.first, ops / 8 + 1));
  }
  return b;
}

void report(benchmark::State& state, const std::vector<LiveRange>& b, const OffsetPlan& plan) {
  headroom::Status s = headroom::memory::verify_offsets(b, plan);
  if (!s.is_ok()) state.SkipWithError(s.to_string().c_str());
  state.SetItemsProcessed(int64_t(state.iterations()) * int64_t(b.size()));
  state.counters["buffers"] = double(b.size());
  state.counters["size/lower_bound"] = double(plan.size) / double(plan.lower_bound);
  state.SetLabel(plan.strategy);
}

// Args: layers, micro-batches. About 100, 1,000 and 10,000 buffers (the last a 70B-class model:
// 80 layers, 7 micro-batches).
void BM_PlanTransformer(benchmark::State& state) {
  std::vector<LiveRange> b = transformer_step(int(state.range(0)), int(state.range(1)));
  OffsetPlan plan;
  for (auto _ : state) {
    plan = headroom::memory::plan_offsets(b);
    benchmark::DoNotOptimize(plan.size);
  }
  report(state, b, plan);
}
BENCHMARK(BM_PlanTransformer)
    ->Args({5, 1})
    ->Args({56, 1})
    ->Args({80, 7})
    ->Unit(benchmark::kMillisecond);

// One greedy pass (largest first) on the same schedules: the cost of each extra order that
// plan_offsets tries when the first one misses the lower bound (five at most).
void BM_PlanTransformerOneOrder(benchmark::State& state) {
  std::vector<LiveRange> b = transformer_step(int(state.range(0)), int(state.range(1)));
  std::vector<uint32_t> order(b.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t x, uint32_t y) { return b[x].bytes > b[y].bytes; });
  OffsetPlan plan;
  for (auto _ : state) {
    plan = headroom::memory::plan_offsets_in_order(b, order, "largest_first");
    benchmark::DoNotOptimize(plan.size);
  }
  report(state, b, plan);
}
BENCHMARK(BM_PlanTransformerOneOrder)
    ->Args({5, 1})
    ->Args({56, 1})
    ->Args({80, 7})
    ->Unit(benchmark::kMillisecond);

// Args: buffers, ops. Lifetimes up to ops/8 long at random places.
void BM_PlanRandom(benchmark::State& state) {
  std::vector<LiveRange> b = random_lifetimes(int(state.range(0)), int(state.range(1)), 42);
  OffsetPlan plan;
  for (auto _ : state) {
    plan = headroom::memory::plan_offsets(b);
    benchmark::DoNotOptimize(plan.size);
  }
  report(state, b, plan);
}
BENCHMARK(BM_PlanRandom)
    ->Args({1000, 1000})
    ->Args({10000, 1000})
    ->Args({10000, 20000})
    ->Unit(benchmark::kMillisecond);

// verify_offsets on the 10,000-buffer schedule (the debug check's cost).
void BM_VerifyTransformer(benchmark::State& state) {
  std::vector<LiveRange> b = transformer_step(80, 7);
  OffsetPlan plan = headroom::memory::plan_offsets(b);
  for (auto _ : state) {
    headroom::Status s = headroom::memory::verify_offsets(b, plan);
    if (!s.is_ok()) state.SkipWithError(s.to_string().c_str());
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * int64_t(b.size()));
}
BENCHMARK(BM_VerifyTransformer)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
