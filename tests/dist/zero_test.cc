// ZeRO stages 0-3 on the job's ranks against single-process AdamW on the summed gradient: each
// rank computes the reference itself (it can generate every rank's gradient), so the check runs
// the same with 1 rank or 2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "dist/bucket_reducer.h"
#include "dist/comm_queue.h"
#include "dist/param_gatherer.h"
#include "model/gpt2.h"
#include "test_env.h"
#include "train/optimizer.h"
#include "train/zero.h"

namespace headroom::train {
namespace {

using dist::test::world;

model::Gpt2Config tiny() {
  model::Gpt2Config c;
  c.n_layer = 2;
  c.n_embd = 64;
  c.n_head = 4;
  c.vocab_size = 211;
  c.n_positions = 32;
  return c;
}

// Rank r's gradient at `step`: normal noise of scale `sigma` inside the tensors, zero padding
// (as backward leaves it).
std::vector<float> rank_grads(const model::ParamTable& t, int rank, int step, float sigma) {
  std::vector<float> g(size_t(t.total_floats), 0.0f);
  std::mt19937 rng(uint32_t(1000 * step + rank));
  std::normal_distribution<float> nd(0.0f, sigma);
  for (const model::ParamDesc& p : t.params) {
    for (int64_t i = 0; i < p.shape.numel(); ++i) g[size_t(p.offset + i)] = nd(rng);
  }
  return g;
}

int64_t count_differences(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  for (int64_t i = 0; i < n; ++i) d += std::memcmp(a + i, b + i, sizeof(float)) != 0;
  return d;
}

// The norm: double rounding up to 2 ranks; with more, the gradients' last bits (fp32).
double norm_tolerance(int ranks) { return ranks <= 2 ? 1e-12 : 1e-6; }

// Elements of the ZeRO result that differ from the single-process reference. Up to 2 ranks the
// gradient sum is the reference's sum (fp32 addition is commutative), so equality is bitwise.
// With more ranks MPI adds in its own order: the gradients differ in the last bit, AdamW's
// m/sqrt(v) then by ~1e-6 relative, so a weight moves by lr x 1e-6 per step; 1e-7 absolute +
// 1e-5 relative is far below a real error (a wrong piece or a stale shard moves weights by
// ~lr = 1e-3) except where a summed gradient lands near zero and its rounding flips the update:
// allowed for one element in 10^4.
int64_t allowed(int64_t n, int ranks) { return ranks <= 2 ? 0 : n / 10000; }

int64_t mismatches(const float* got, const float* want, int64_t n, int ranks) {
  if (ranks <= 2) return count_differences(got, want, n);
  int64_t d = 0;
  for (int64_t i = 0; i < n; ++i) {
    d += !(std::fabs(got[i] - want[i]) <= 1e-7 + 1e-5 * std::fabs(want[i]));
  }
  return d;
}

TEST(GptZeroUnits, CoverTheBufferByLayer) {
  const model::ParamTable t = model::gpt2_param_table(tiny());
  const std::vector<dist::Range> units = gpt2_zero_units(t);
  // Embeddings, 2 x (block decayed, block other), ln_f.
  EXPECT_EQ(units.size(), 6u);
  int64_t at = 0;
  for (const dist::Range& u : units) {
    EXPECT_EQ(u.begin, at);
    EXPECT_EQ(u.begin % 16, 0);
    at = u.end;
  }
  EXPECT_EQ(at, t.total_floats);
}

// Backward order and buckets: ln_f first, the embeddings last; adjacent units merge up to the
// bucket size, and the reducer launches early buckets before backward reaches the embeddings.
TEST(GptZeroUnits, BackwardOrderAndBuckets) {
  model::Gpt2Config c = tiny();
  c.n_layer = 4;
  const model::ParamTable t = model::gpt2_param_table(c);
  const std::vector<dist::Range> units = gpt2_zero_units(t);
  const std::vector<dist::Range> order = gpt2_backward_order(t);
  ASSERT_EQ(order.size(), units.size());
  EXPECT_EQ(order.front(), units.back()) << "ln_f first";
  EXPECT_EQ(order.back(), units.front()) << "embeddings last";
  std::vector<dist::Range> sorted = order;
  std::sort(sorted.begin(), sorted.end(),
            [](const dist::Range& a, const dist::Range& b) { return a.begin < b.begin; });
  EXPECT_EQ(sorted, units);

  const int64_t cap = 60000;  // about two blocks' decayed tensors (49k floats each)
  const std::vector<dist::Range> buckets = dist::make_buckets(order, cap);
  EXPECT_LT(buckets.size(), units.size()) << "some units merged";
  for (const dist::Range& b : buckets) {
    int inside = 0;
    for (const dist::Range& u : units) inside += u.begin >= b.begin && u.end <= b.end;
    EXPECT_TRUE(b.size() <= cap || inside == 1) << b.begin << ".." << b.end;
  }
  dist::LocalCommunicator local;
  dist::CommQueue q;
  std::vector<float> grads(static_cast<size_t>(t.total_floats), 0.0f);
  dist::BucketReducer red(&q, &local, dist::BucketReducer::Mode::kAllReduce, grads.data(), order,
                          buckets);  // checks every unit lies in exactly one bucket
  size_t launched_before_embeddings = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    if (i + 1 == order.size()) launched_before_embeddings = red.buckets_launched();
    red.mark_ready(i);
  }
  EXPECT_GT(launched_before_embeddings, 0u) << "communication overlaps backward";
  EXPECT_EQ(red.buckets_launched(), buckets.size());
  EXPECT_TRUE(red.wait().is_ok());
}

// Three AdamW steps, clipping inactive in the first and active in the next two (the norm
// passes grad_clip): params, m and v equal the single-process ones bit for bit, the norm to
// double rounding. See train/zero.h for why bit-identity holds on 2 ranks.
class ZeroStages : public ::testing::TestWithParam<int> {};

TEST_P(ZeroStages, EqualSingleProcessAdamW) {
  const int stage = GetParam();
  dist::Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  const model::Gpt2Config c = tiny();
  const model::ParamTable table = model::gpt2_param_table(c);
  const int64_t N = table.total_floats;
  AdamWConfig cfg;
  cfg.lr = 1e-3f;

  // Reference: one process, full buffers, the gradient summed over ranks in rank order.
  std::vector<float> ref_p(static_cast<size_t>(N)), ref_m(size_t(N), 0.0f), ref_v(size_t(N), 0.0f);
  model::gpt2_init_params(c, table, ref_p.data(), 7);
  std::vector<float> init = ref_p;

  ZeroOptimizer opt(&comm, &table, stage);
  const ZeroOptimizer::Sizes sz = opt.sizes();
  std::vector<float> params(static_cast<size_t>(sz.params)), grads(static_cast<size_t>(sz.grads)),
      grad_shard(static_cast<size_t>(sz.grad_shard)), m(size_t(sz.m), 0.0f), v(size_t(sz.v), 0.0f);
  if (stage < 3) {
    params = init;
  } else {
    opt.scatter_params(init.data(), params.data());
  }

  const float sigmas[3] = {1e-4f, 1e-2f, 3e-2f};
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> sum(size_t(N), 0.0f);
    for (int r = 0; r < R; ++r) {
      const std::vector<float> g = rank_grads(table, r, step, sigmas[step - 1]);
      for (int64_t i = 0; i < N; ++i) sum[size_t(i)] += g[size_t(i)];
      if (r == me) grads = g;
    }
    const double ref_norm =
        adamw_step(table, ref_p.data(), sum.data(), ref_m.data(), ref_v.data(), cfg, cfg.lr, step);

    ZeroBuffers b{params.data(), grads.data(), grad_shard.empty() ? nullptr : grad_shard.data(),
                  m.data(),      v.data(),     false};
    // Stage 0 zeroes the gradients in AdamW's pass on step 2 (the trainer's way): the same
    // update as the other steps' separate pass would give.
    b.zero_grads = stage == 0 && step == 2;
    Result<double> norm = opt.step(b, cfg, cfg.lr, step);
    ASSERT_TRUE(norm.is_ok()) << norm.status().to_string();
    if (b.zero_grads) {
      EXPECT_EQ(grads, std::vector<float>(grads.size(), 0.0f));
    } else if (stage == 0) {
      EXPECT_NE(grads, std::vector<float>(grads.size(), 0.0f));
    }
    EXPECT_NEAR(*norm, ref_norm, norm_tolerance(R) * ref_norm) << "step " << step;
    if (step == 1) {
      EXPECT_LT(ref_norm, cfg.grad_clip);
    } else {
      EXPECT_GT(ref_norm, cfg.grad_clip);
    }

    // The full parameters on this rank (stage 3 gathers its shards, a collective).
    std::vector<float> full(static_cast<size_t>(N));
    if (stage < 3) {
      full = params;
    } else {
      ASSERT_TRUE(opt.gather_params(params.data(), full.data()).is_ok());
    }
    EXPECT_LE(mismatches(full.data(), ref_p.data(), N, R), allowed(N, R))
        << "stage " << stage << " step " << step;
    // Moments: whole (stage 0) or this rank's pieces.
    if (stage == 0) {
      EXPECT_LE(mismatches(m.data(), ref_m.data(), N, R), allowed(N, R));
      EXPECT_LE(mismatches(v.data(), ref_v.data(), N, R), allowed(N, R));
    } else {
      const dist::ShardLayout& l = opt.layout();
      int64_t dm = 0, dv = 0;
      for (size_t u = 0; u < l.units().size(); ++u) {
        const dist::Range p = l.piece(u);
        dm += mismatches(m.data() + l.local_offset(u), ref_m.data() + p.begin, p.size(), R);
        dv += mismatches(v.data() + l.local_offset(u), ref_v.data() + p.begin, p.size(), R);
      }
      EXPECT_LE(dm, allowed(N, R));
      EXPECT_LE(dv, allowed(N, R));
    }
  }
  // The update really moved the weights (the comparison above is not vacuous).
  EXPECT_GT(count_differences(ref_p.data(), init.data(), N), N / 2);
}

INSTANTIATE_TEST_SUITE_P(Stage, ZeroStages, ::testing::Values(0, 1, 2, 3));

// Sharded optimizer state really is 1/R of the full state.
TEST(ZeroOptimizer, ShardSizes) {
  dist::Communicator& comm = world();
  const model::ParamTable table = model::gpt2_param_table(tiny());
  const int64_t N = table.total_floats;
  for (int stage = 0; stage <= 3; ++stage) {
    ZeroOptimizer opt(&comm, &table, stage);
    const ZeroOptimizer::Sizes s = opt.sizes();
    if (stage == 0) {
      EXPECT_EQ(s.m, N);
      EXPECT_EQ(s.grad_shard, 0);
    } else {
      EXPECT_LE(s.m, N / comm.size() + 16 * int64_t(opt.layout().units().size()) * 2);
      EXPECT_EQ(s.grad_shard, s.m);
    }
    EXPECT_EQ(s.params, stage == 3 ? s.m : N);
  }
}

// Stage 3 with the reduction done during "backward" by a reduce-scatter BucketReducer (GPT-2's
// buckets in backward order, crossing the units of the layout) and the forward's gathers from
// ParamGatherer: the path the trainer will take. Equal to single-process AdamW as above.
TEST(ZeroOptimizer, Stage3WithBucketReducerAndGatherer) {
  dist::Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  const model::Gpt2Config c = tiny();
  const model::ParamTable table = model::gpt2_param_table(c);
  const int64_t N = table.total_floats;
  AdamWConfig cfg;
  ZeroOptimizer opt(&comm, &table, 3);
  const dist::ShardLayout& layout = opt.layout();
  const std::vector<dist::Range>& units = layout.units();

  std::vector<float> ref_p(static_cast<size_t>(N)), ref_m(size_t(N), 0.0f), ref_v(size_t(N), 0.0f);
  model::gpt2_init_params(c, table, ref_p.data(), 9);
  std::vector<float> shard(static_cast<size_t>(layout.local_floats())), m(shard.size(), 0.0f),
      v(shard.size(), 0.0f), grad_shard(shard.size()), full(size_t(N), 0.0f);
  opt.scatter_params(ref_p.data(), shard.data());

  dist::CommQueue q;
  std::vector<float> grads(static_cast<size_t>(N));
  const std::vector<dist::Range> order = gpt2_backward_order(table);
  dist::BucketReducer red(&q, &comm, dist::BucketReducer::Mode::kReduceScatter, grads.data(), order,
                          dist::make_buckets(order, 20000), &layout, grad_shard.data());
  dist::ParamGatherer gather(&q, &comm, &layout, shard.data(),
                             [&](size_t u) { return full.data() + units[u].begin; });
  int64_t bad_params = 0;
  for (int step = 1; step <= 2; ++step) {
    // Forward: every unit gathered (next prefetched) equals the reference parameters.
    for (size_t u = 0; u < units.size(); ++u) {
      ASSERT_TRUE(
          gather.acquire(u, u + 1 < units.size() ? std::optional<size_t>(u + 1) : std::nullopt)
              .is_ok());
      bad_params += mismatches(full.data() + units[u].begin, ref_p.data() + units[u].begin,
                               units[u].size(), R);
      gather.release(u);
    }
    // Backward: units finish last first; each is handed to the reducer at once.
    std::vector<float> sum(size_t(N), 0.0f);
    for (int r = 0; r < R; ++r) {
      const std::vector<float> g = rank_grads(table, r, step, 1e-2f);
      for (int64_t i = 0; i < N; ++i) sum[size_t(i)] += g[size_t(i)];
      if (r == me) grads = g;
    }
    for (size_t u = 0; u < order.size(); ++u) red.mark_ready(u);
    ASSERT_TRUE(red.wait().is_ok());
    const double ref_norm =
        adamw_step(table, ref_p.data(), sum.data(), ref_m.data(), ref_v.data(), cfg, cfg.lr, step);
    ZeroBuffers b{shard.data(), nullptr, grad_shard.data(), m.data(), v.data(), true};
    Result<double> norm = opt.step(b, cfg, cfg.lr, step);
    ASSERT_TRUE(norm.is_ok());
    EXPECT_NEAR(*norm, ref_norm, norm_tolerance(R) * ref_norm);
  }
  EXPECT_LE(bad_params, allowed(N, R));
  std::vector<float> after(static_cast<size_t>(N));
  ASSERT_TRUE(opt.gather_params(shard.data(), after.data()).is_ok());
  EXPECT_LE(mismatches(after.data(), ref_p.data(), N, R), allowed(N, R));
}

}  // namespace
}  // namespace headroom::train
