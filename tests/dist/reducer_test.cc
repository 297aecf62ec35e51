// The communication thread, the bucketed gradient reducer and the ZeRO-3 parameter gatherer.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <vector>

#include "dist/bucket_reducer.h"
#include "dist/comm_queue.h"
#include "dist/param_gatherer.h"
#include "test_env.h"

namespace headroom::dist {
namespace {

using test::world;

TEST(CommQueue, RunsInOrderAndKeepsTheFirstError) {
  CommQueue q;
  std::vector<int> order;  // written only by the queue's thread until wait_all
  std::atomic<int> ran{0};
  for (int i = 0; i < 50; ++i) {
    q.submit([&, i] {
      order.push_back(i);
      ++ran;
      if (i == 10) return Status::internal("op 10 failed");
      if (i == 20) return Status::internal("op 20 failed");
      return Status::ok();
    });
  }
  const Status s = q.wait_all();
  EXPECT_EQ(ran.load(), 50) << "ops after a failure must still run (they are collectives)";
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[size_t(i)], i);
  EXPECT_EQ(s.message(), "op 10 failed");
  EXPECT_TRUE(q.wait_all().is_ok()) << "wait_all clears the error";
  const CommQueue::Ticket t = q.submit([] { return Status::ok(); });
  q.wait(t);
  EXPECT_GE(q.done(), t);
}

float grad_value(int rank, int step, int64_t i) {
  return float((rank + 1) * 3 + step * 7 + int(i % 101)) * 0.25f;
}

// Tensors of a flat buffer (16-float aligned, with padding) and buckets over them in the order a
// backward would finish them (last tensors first).
struct Fixture {
  std::vector<Range> tensors = {{0, 40}, {48, 300}, {304, 310}, {320, 1000}, {1008, 1013}};
  std::vector<Range> buckets = {{304, 1013}, {48, 304}, {0, 48}};
  int64_t n = 1024;
};

TEST(MakeBuckets, MergesAdjacentUnitsUpToTheCapInCompletionOrder) {
  // The ready order alternates between two regions, as GPT-2's decayed and other tensors do.
  const std::vector<Range> order = {{900, 1000}, {400, 500}, {800, 900}, {300, 400},
                                    {700, 800},  {200, 300}, {0, 200}};
  // {900,1000}+{800,900} completes at index 2, {400,500}+{300,400} at 3; {700,800} and
  // {200,300} would pass the cap of 200 if merged, so they stand alone, as does {0,200}.
  const std::vector<Range> want = {{800, 1000}, {300, 500}, {700, 800}, {200, 300}, {0, 200}};
  EXPECT_EQ(make_buckets(order, 200), want);
  // A unit above the cap is a bucket of its own.
  EXPECT_EQ(make_buckets({{0, 1000}}, 10), (std::vector<Range>{{0, 1000}}));
}

// Each rank marks tensors in a different order (readiness order may differ across ranks); the
// reducer still launches buckets in the fixed order, so the collectives match.
TEST(BucketReducer, AllReduceBucketsAsTheyComplete) {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  Fixture f;
  CommQueue q;
  std::vector<float> grads(static_cast<size_t>(f.n));
  BucketReducer red(&q, &comm, BucketReducer::Mode::kAllReduce, grads.data(), f.tensors, f.buckets);
  for (int step = 0; step < 3; ++step) {
    for (int64_t i = 0; i < f.n; ++i) grads[size_t(i)] = grad_value(me, step, i);
    std::vector<size_t> order = {4, 3, 2, 1, 0};
    if (me % 2 == 1) order = {0, 2, 4, 1, 3};
    for (size_t t : order) red.mark_ready(t);
    EXPECT_EQ(red.buckets_launched(), red.num_buckets());
    ASSERT_TRUE(red.wait().is_ok());
    // Inside the buckets: the sum over ranks. Outside (the padding after the last tensor):
    // untouched.
    int64_t bad = 0;
    for (int64_t i = 0; i < f.n; ++i) {
      float want = grad_value(me, step, i);
      if (i < 1013) {
        want = 0;
        for (int r = 0; r < R; ++r) want += grad_value(r, step, i);
      }
      bad += grads[size_t(i)] != want;
    }
    EXPECT_EQ(bad, 0) << "step " << step;
  }
}

// A rank that fails in the middle of backward (here: after two tensors) flushes its remaining
// buckets, so the collectives still match; all ranks then agree on its failure, discard the step,
// and the next step reduces correctly. No rank waits forever.
TEST(BucketReducer, FailingRankFlushesThenAllAgree) {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank(), failing = R - 1;
  Fixture f;
  CommQueue q;
  std::vector<float> grads(static_cast<size_t>(f.n));
  BucketReducer red(&q, &comm, BucketReducer::Mode::kAllReduce, grads.data(), f.tensors, f.buckets);
  for (int64_t i = 0; i < f.n; ++i) grads[size_t(i)] = grad_value(me, 0, i);
  Status local;
  if (me == failing) {
    red.mark_ready(4);
    red.mark_ready(3);
    local = Status::out_of_memory("backward of h.0 needs 12 MiB more");
    red.flush();
  } else {
    for (size_t t = 5; t-- > 0;) red.mark_ready(t);
  }
  const Status reduced = red.wait();
  const Status step = agree(comm, reduced.is_ok() ? local : reduced);
  EXPECT_EQ(step.code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(step.message(),
            "rank " + std::to_string(failing) + ": backward of h.0 needs 12 MiB more");
  // The next step, healthy everywhere.
  for (int64_t i = 0; i < f.n; ++i) grads[size_t(i)] = grad_value(me, 1, i);
  for (size_t t = 0; t < 5; ++t) red.mark_ready(t);
  EXPECT_TRUE(red.wait().is_ok());
  int64_t bad = 0;
  for (int64_t i = 0; i < 1013; ++i) {
    float want = 0;
    for (int r = 0; r < R; ++r) want += grad_value(r, 1, i);
    bad += grads[size_t(i)] != want;
  }
  EXPECT_EQ(bad, 0);
}

// Buckets wait for their predecessors: marking the last bucket's tensors launches nothing.
TEST(BucketReducer, LaunchOrderIsFixed) {
  Fixture f;
  CommQueue q;
  LocalCommunicator local;
  std::vector<float> grads(size_t(f.n), 1.0f);
  BucketReducer red(&q, &local, BucketReducer::Mode::kAllReduce, grads.data(), f.tensors,
                    f.buckets);
  red.mark_ready(0);  // bucket 2
  EXPECT_EQ(red.buckets_launched(), 0u);
  red.mark_ready(1);  // bucket 1
  EXPECT_EQ(red.buckets_launched(), 0u);
  red.mark_ready(2);
  red.mark_ready(3);
  EXPECT_EQ(red.buckets_launched(), 0u);
  red.mark_ready(4);  // bucket 0 complete: 0, 1 and 2 go
  EXPECT_EQ(red.buckets_launched(), 3u);
  EXPECT_TRUE(red.wait().is_ok());
}

// Reduce-scatter mode with a multi-unit layout: each rank's shard holds the sums of its pieces.
TEST(BucketReducer, ReduceScatterIntoTheShard) {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  Fixture f;
  // Units that the buckets cross: a bucket may span units and a unit several buckets.
  const ShardLayout layout({{0, 304}, {304, 320}, {320, 1024}}, me, R);
  CommQueue q;
  std::vector<float> grads(static_cast<size_t>(f.n)), shard(size_t(layout.local_floats()), -1.0f);
  BucketReducer red(&q, &comm, BucketReducer::Mode::kReduceScatter, grads.data(), f.tensors,
                    f.buckets, &layout, shard.data());
  for (int step = 0; step < 2; ++step) {
    for (int64_t i = 0; i < f.n; ++i) grads[size_t(i)] = grad_value(me, step, i);
    for (size_t t = 5; t-- > 0;) red.mark_ready(t);
    ASSERT_TRUE(red.wait().is_ok());
    int64_t bad = 0, checked = 0;
    for (size_t u = 0; u < layout.units().size(); ++u) {
      const Range p = layout.piece(u);
      for (int64_t i = p.begin; i < p.end; ++i) {
        // Floats outside every bucket (the padding after the last tensor) are not reduced.
        if (i >= 1013) continue;
        float want = 0;
        for (int r = 0; r < R; ++r) want += grad_value(r, step, i);
        bad += shard[size_t(layout.local_offset(u) + i - p.begin)] != want;
        ++checked;
      }
    }
    EXPECT_EQ(bad, 0) << "step " << step;
    EXPECT_GT(checked, 0);
  }
}

// ZeRO-3: gather units just before use with the next one prefetched, release after; forward
// order then backward order, as a training step would.
TEST(ParamGatherer, GathersEachUnitWithPrefetch) {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  const std::vector<Range> units = {{0, 64}, {64, 1000}, {1008, 1010}, {1024, 4096}};
  const ShardLayout layout(units, me, R);
  std::vector<float> reference(4096);
  std::mt19937 rng(42);
  std::normal_distribution<float> nd;
  for (float& x : reference) x = nd(rng);
  std::vector<float> local(static_cast<size_t>(layout.local_floats()));
  for (size_t u = 0; u < units.size(); ++u) {
    const Range p = layout.piece(u);
    std::copy(reference.begin() + p.begin, reference.begin() + p.end,
              local.begin() + layout.local_offset(u));
  }
  CommQueue q;
  std::vector<float> full(4096, 0.0f);
  ParamGatherer g(&q, &comm, &layout, local.data(),
                  [&](size_t u) { return full.data() + units[u].begin; });
  const size_t L = units.size();
  int64_t bad = 0;
  int max_live = 0;
  auto use = [&](size_t u) {
    for (int64_t i = units[u].begin; i < units[u].end; ++i) {
      bad += full[size_t(i)] != reference[size_t(i)];
    }
    max_live = std::max(max_live, g.live_units());
    std::fill(full.begin() + units[u].begin, full.begin() + units[u].end, 0.0f);
  };
  for (size_t u = 0; u < L; ++u) {  // forward
    ASSERT_TRUE(g.acquire(u, u + 1 < L ? std::optional<size_t>(u + 1) : std::nullopt).is_ok());
    use(u);
    g.release(u);
  }
  for (size_t u = L; u-- > 0;) {  // backward
    ASSERT_TRUE(g.acquire(u, u > 0 ? std::optional<size_t>(u - 1) : std::nullopt).is_ok());
    use(u);
    g.release(u);
  }
  EXPECT_EQ(bad, 0);
  EXPECT_LE(max_live, 2) << "the current unit and one prefetched";
  EXPECT_EQ(g.live_units(), 0);
  EXPECT_EQ(g.gathered_floats(), 2 * (64 + 936 + 2 + 3072));
  EXPECT_TRUE(q.wait_all().is_ok());
}

}  // namespace
}  // namespace headroom::dist
