// What recording the event stream costs per micro-batch (train --profile, bench --record): the
// op boundaries of one GPT-2 micro-batch driven through the recorder set from the real plan, so
// the figure is the recorder's own work, free of the step-time noise that hides it in a
// whole-step comparison. Results and the command: docs/notes/report.md ("Recording cost").
#include <benchmark/benchmark.h>

#include <chrono>

#include "model/config.h"
#include "model/gpt2.h"
#include "plan/memory_plan.h"
#include "train/step_events.h"

namespace {

using namespace headroom;

// Arg 0: layers (12: GPT-2 124M, 48: GPT-2 XL); arg 1: recompute (0 none, 2 full).
void BM_RecordMicroBatch(benchmark::State& state) {
  Result<model::Gpt2Config> gpt2 = model::resolve_model("gpt2");  // 124M shapes
  if (!gpt2.is_ok()) {
    state.SkipWithError(gpt2.status().to_string().c_str());
    return;
  }
  model::Gpt2Config c = *gpt2;
  c.n_layer = int(state.range(0));
  plan::Policy p;
  p.micro_batch = 4;
  p.seq = 256;
  if (state.range(1) == 2) p.exec.recompute.assign(size_t(c.n_layer), model::Recompute::kFull);
  Result<plan::MemoryPlan> mp = plan::plan_training_memory(c, p);
  if (!mp.is_ok()) {
    state.SkipWithError(mp.status().to_string().c_str());
    return;
  }
  const int nops = int(mp->ops.size()), L = c.n_layer;
  EventRecorder rec;
  train::record_plan(*mp, &rec);
  double t = 0;
  int step = 0;
  size_t events = 0;
  for (auto _ : state) {
    // The boundaries Gpt2::forward and backward cross, in their order.
    rec.begin_micro_batch(step++, 0);
    int cur = -1;
    for (int op = 0; op < nops; op++) {
      rec.op_boundary(cur, op, t += 1);
      cur = op;
      if (op == L + 1) {
        rec.op_boundary(cur, -1, t += 1);
        cur = -1;
      }
    }
    rec.op_boundary(cur, -1, t += 1);
    events += rec.log().size();
    // Keep the log at one micro-batch (a long run reallocates rarely; not what is measured here).
    rec.log().clear_events();
  }
  state.counters["events_per_micro_batch"] = double(events) / double(state.iterations());
  state.counters["ns_per_event"] =
      benchmark::Counter(double(events), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_RecordMicroBatch)
    ->Args({12, 0})
    ->Args({12, 2})
    ->Args({48, 0})
    ->Unit(benchmark::kMicrosecond);

// What --record adds to each kernel call besides the events (Gpt2::timed): two clock reads and
// one KernelSpan appended.
void BM_KernelSpan(benchmark::State& state) {
  model::OpTimes times;
  times.record = true;
  times.origin = std::chrono::steady_clock::now();
  times.kernels.reserve(1 << 20);
  using us = std::chrono::duration<double, std::micro>;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::ClobberMemory();
    const auto t1 = std::chrono::steady_clock::now();
    times.kernels.push_back(
        {model::OpKind::kGemm, 3, us(t0 - times.origin).count(), us(t1 - t0).count()});
    if (times.kernels.size() == (1 << 20)) times.kernels.clear();
  }
}
BENCHMARK(BM_KernelSpan);

}  // namespace

BENCHMARK_MAIN();
