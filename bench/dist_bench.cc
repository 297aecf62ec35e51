// Collective bandwidth of this machine's communicator: all-reduce, reduce-scatter and all-gather
// of fp32 buffers, and the bucketed gradient reducer, under `mpirun -np R` (alone it measures the
// size-1 communicator, i.e. nothing). Every rank runs the same fixed iteration counts (adaptive
// counts could differ across ranks and mismatch the collectives); only rank 0 reports.
// Figures and the command: docs/notes/zero.md ("Measured").
#include <benchmark/benchmark.h>

#include <cstdio>
#include <memory>
#include <vector>

#include "dist/bucket_reducer.h"
#include "dist/comm_queue.h"
#include "dist/communicator.h"
#include "dist/shard.h"

namespace {

using namespace headroom;

dist::Communicator* g_comm = nullptr;

// Bus bandwidth (NCCL's convention): the bytes each rank must send per second, i.e. the data
// size times 2(R-1)/R for all-reduce and (R-1)/R for reduce-scatter and all-gather, so the
// figure is comparable across collectives and rank counts.
void report(benchmark::State& state, int64_t bytes, double factor) {
  state.SetBytesProcessed(int64_t(state.iterations()) * bytes);
  state.counters["busbw_GBps"] = benchmark::Counter(
      double(bytes) * factor * double(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
}

double ring(int R, double k) { return R > 1 ? k * (R - 1) / R : 0.0; }

void BM_AllReduce(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<float> x(size_t(n), 1.0f);
  for (auto _ : state) {
    if (Status s = g_comm->all_reduce(x.data(), n); !s.is_ok()) {
      state.SkipWithError(s.to_string().c_str());
      return;
    }
  }
  report(state, n * 4, ring(g_comm->size(), 2));
}

void BM_ReduceScatter(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int R = g_comm->size();
  std::vector<float> x(size_t(n), 1.0f), y(size_t(dist::shard_floats(n, R)));
  const std::vector<int64_t> counts = dist::shard_counts(n, R);
  for (auto _ : state) {
    if (Status s = g_comm->reduce_scatter(x.data(), y.data(), counts); !s.is_ok()) {
      state.SkipWithError(s.to_string().c_str());
      return;
    }
  }
  report(state, n * 4, ring(R, 1));
}

void BM_AllGather(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int R = g_comm->size();
  std::vector<float> x(size_t(n), 1.0f);
  const std::vector<int64_t> counts = dist::shard_counts(n, R);
  const dist::Range mine = dist::shard_range(n, g_comm->rank(), R);
  for (auto _ : state) {
    if (Status s = g_comm->all_gather(x.data() + mine.begin, x.data(), counts); !s.is_ok()) {
      state.SkipWithError(s.to_string().c_str());
      return;
    }
  }
  report(state, n * 4, ring(R, 1));
}

// The reducer's all-reduce of a gradient buffer in buckets of range(1) floats, submitted as
// fast as possible: the cost of bucketing (more, smaller collectives) against one all-reduce.
void BM_BucketReducer(benchmark::State& state) {
  const int64_t n = state.range(0), bucket = state.range(1);
  std::vector<float> g(size_t(n), 1.0f);
  std::vector<dist::Range> buckets;
  for (int64_t b = 0; b < n; b += bucket) buckets.push_back({b, std::min(n, b + bucket)});
  dist::CommQueue q;
  dist::BucketReducer red(&q, g_comm, dist::BucketReducer::Mode::kAllReduce, g.data(), buckets,
                          buckets);
  for (auto _ : state) {
    for (size_t t = 0; t < buckets.size(); ++t) red.mark_ready(t);
    if (Status s = red.wait(); !s.is_ok()) {
      state.SkipWithError(s.to_string().c_str());
      return;
    }
  }
  report(state, n * 4, ring(g_comm->size(), 2));
}

// 1 MiB, 16 MiB and 64 MiB of fp32 (GPT-2 124M's gradients are 498 MB).
#define SIZES ->Arg(1 << 18)->Arg(1 << 22)->Arg(1 << 24)
BENCHMARK(BM_AllReduce)
SIZES->Iterations(5)->Repetitions(5)->ReportAggregatesOnly(true)->UseRealTime()->Unit(
    benchmark::kMillisecond);
BENCHMARK(BM_ReduceScatter)
SIZES->Iterations(5)->Repetitions(5)->ReportAggregatesOnly(true)->UseRealTime()->Unit(
    benchmark::kMillisecond);
BENCHMARK(BM_AllGather)
SIZES->Iterations(5)->Repetitions(5)->ReportAggregatesOnly(true)->UseRealTime()->Unit(
    benchmark::kMillisecond);
BENCHMARK(BM_BucketReducer)
    ->Args({1 << 24, 1 << 22})
    ->Args({1 << 24, 1 << 20})
    ->Iterations(5)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Ranks other than 0 run the same benchmarks silently.
class Silent : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  Result<std::unique_ptr<dist::Communicator>> comm = dist::make_world_communicator();
  if (!comm.is_ok()) {
    std::fprintf(stderr, "dist_bench: %s\n", comm.status().to_string().c_str());
    return 1;
  }
  g_comm = comm->get();
  benchmark::Initialize(&argc, argv);
  if (g_comm->rank() == 0) {
    std::printf("dist_bench: %d rank(s), communicator %s\n", g_comm->size(),
                std::string(g_comm->name()).c_str());
    benchmark::RunSpecifiedBenchmarks();
  } else {
    Silent silent;
    benchmark::RunSpecifiedBenchmarks(&silent);
  }
  benchmark::Shutdown();
  comm->reset();
  return 0;
}
