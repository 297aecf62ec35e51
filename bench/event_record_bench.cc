// What recording the event stream costs per micro-batch (train --profile, bench --record): the
// op boundaries of one GPT-2 micro-batch driven through the recorder set from the real plan, so
// the figure is the recorder's own work, free of the step-time noise that hides it in a
// whole-step comparison. Results and the command: docs/notes/report.md ("Recording cost").
#include <benchmark/benchmark.h>

#include <chrono>

#include "dist/communicator.h"
#include "memory/host_resource.h"
#include "memory/pool_resource.h"
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

// The step region's pool block per micro-batch (train/elastic.h): one acquire and one release of
// a reserved block (a hit, as in training). Arg 0: 0 no observer (not profiling), 1 the
// profiler's observer recording both as pool events.
void BM_PoolBlock(benchmark::State& state) {
  memory::HostResource host;
  memory::PoolResource pool(&host, memory::PoolOptions{0, 0});
  EventRecorder rec;
  const auto origin = std::chrono::steady_clock::now();
  if (state.range(0)) {
    pool.set_observer(train::pool_observer(&rec, "step", origin, pool.stats(), 0));
  }
  const size_t bytes = size_t(64) << 20;
  {  // reserve the chunk once, as the trainer's warm-up does
    Result<void*> p = pool.allocate(bytes, 4096, memory::Category::kActivations);
    if (!p.is_ok()) {
      state.SkipWithError(p.status().to_string().c_str());
      return;
    }
    pool.deallocate(*p, bytes, 4096, memory::Category::kActivations);
  }
  for (auto _ : state) {
    Result<void*> p = pool.allocate(bytes, 4096, memory::Category::kActivations);
    benchmark::DoNotOptimize(p);
    pool.deallocate(*p, bytes, 4096, memory::Category::kActivations);
    if (rec.log().size() > (1 << 20)) rec.log().clear_events();
  }
  state.counters["events"] = double(rec.log().size());
}
BENCHMARK(BM_PoolBlock)->Arg(0)->Arg(1);

// The events a profiled step adds outside the model's ops (train/trainer.cc): the data wait and
// the loader's fill (record_op), the optimizer step's begin and end, its gradient all-reduce
// through TracedCommunicator (a local communicator: the collective itself costs nothing), and
// zeroing the gradients. Arg 0: 0 not profiling (the traced communicator's pointer test only),
// 1 profiling.
void BM_StepOps(benchmark::State& state) {
  dist::LocalCommunicator local;
  train::TracedCommunicator comm(&local);
  EventRecorder rec;
  const bool on = state.range(0) != 0;
  const auto origin = std::chrono::steady_clock::now();
  const uint32_t opt = rec.log().intern("optimizer step");
  float x = 1;
  int step = 0;
  for (auto _ : state) {
    if (on) {
      train::record_op(&rec, "wait for data", EventPhase::kData, step, 1, 2);
      train::record_op(&rec, "load batch", EventPhase::kData, step, 0, 1, kEventThreadLoader);
      rec.begin_op(3, opt, EventPhase::kOptimizer, step);
      comm.trace(&rec, origin, EventPhase::kOptimizer, step);
    }
    benchmark::DoNotOptimize(comm.all_reduce(&x, 1));
    if (on) {
      comm.trace(nullptr, origin, EventPhase::kNone, -1);
      train::record_op(&rec, "zero gradients", EventPhase::kOptimizer, step, 4, 5);
      rec.end_op(6, opt, EventPhase::kOptimizer, step);
    }
    ++step;
    if (rec.log().size() > (1 << 20)) rec.log().clear_events();
  }
}
BENCHMARK(BM_StepOps)->Arg(0)->Arg(1);

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
