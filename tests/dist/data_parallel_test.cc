// Data parallelism end to end on a tiny GPT-2: R ranks, each with its own share of the global
// batch, equal one process that runs the same global batch as R accumulated micro-batches, for
// ZeRO stages 0-3 over three optimizer steps. Every rank computes the single-process reference
// itself, so the test runs the same with 1 rank or 2.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include "memory/host_resource.h"
#include "model/gpt2.h"
#include "plan/memory_plan.h"
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

constexpr int kGlobalBatch = 4;  // sequences per optimizer step, all ranks together
constexpr int kSeq = 16;

// The global batch of `step`: inputs and targets of kGlobalBatch sequences of unequal length
// (ignored targets pad the short ones, so ranks see different token counts).
void global_batch(int step, int vocab, std::vector<int32_t>* in, std::vector<int32_t>* tg) {
  std::mt19937 rng(uint32_t(77 + step));
  in->assign(kGlobalBatch * kSeq, 0);
  tg->assign(kGlobalBatch * kSeq, -1);
  for (int s = 0; s < kGlobalBatch; ++s) {
    const int len = 3 + (s * 7 + step * 5) % (kSeq - 2);
    for (int t = 0; t < kSeq; ++t) {
      (*in)[size_t(s * kSeq + t)] = int32_t(rng() % uint32_t(vocab));
      if (t < len) (*tg)[size_t(s * kSeq + t)] = int32_t(rng() % uint32_t(vocab));
    }
  }
}

// A tiny GPT-2 with activations for micro-batches of b sequences.
struct Net {
  Net(const model::Gpt2Config& c, int b) {
    Result<plan::MemoryPlan> p =
        plan::plan_training_memory(c, plan::Policy{b, 1, kSeq, "fp32", {}});
    HR_CHECK(p.is_ok());
    mp = std::move(*p);
    auto a = memory::Arena::create(&host, mp.step.buffers, mp.step.layout,
                                   memory::Category::kActivations);
    HR_CHECK(a.is_ok());
    arena.emplace(std::move(*a));
    net.emplace(c, &mp.params);
    B = b;
  }
  // Adds the gradient of the micro-batch's summed loss times dloss to grads.
  void accumulate(float* params, float* grads, const int32_t* in, const int32_t* tg, float dloss) {
    net->bind_params(params, grads);
    net->bind_activations(&*arena, &mp.activations, B, kSeq);
    int64_t valid = 0;
    net->forward(in, tg, &valid);
    net->backward(in, tg, dloss);
  }
  memory::HostResource host;
  plan::MemoryPlan mp;
  std::optional<memory::Arena> arena;
  std::optional<model::Gpt2> net;
  int B = 1;
};

// Three optimizer steps of `stage` on this job's ranks; returns the final full parameters and
// the gradient norms. *ref / *ref_norms: the single-process reference (R micro-batches of b
// accumulated, the loss normalised by the step's tokens), computed by every rank.
std::vector<float> train_steps(int stage, std::vector<float>* ref, std::vector<double>* norms,
                               std::vector<double>* ref_norms) {
  dist::Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  const int b = kGlobalBatch / R;  // each rank's micro-batch = the reference's micro-batch
  const model::Gpt2Config c = tiny();
  Net net(c, b);
  const model::ParamTable& table = net.mp.params;
  const int64_t N = table.total_floats;
  AdamWConfig cfg;
  cfg.lr = 1e-3f;

  std::vector<float> init(static_cast<size_t>(N));
  model::gpt2_init_params(c, table, init.data(), 5);
  std::vector<float> ref_p = init, ref_g(init.size()), ref_m(init.size(), 0.0f),
                     ref_v(init.size(), 0.0f);
  ZeroOptimizer opt(&comm, &table, stage);
  const ZeroOptimizer::Sizes sz = opt.sizes();
  std::vector<float> params(static_cast<size_t>(sz.params)),
      full = init, grads(static_cast<size_t>(sz.grads)),
      grad_shard(static_cast<size_t>(sz.grad_shard) + 1), m(static_cast<size_t>(sz.m), 0.0f),
      v(static_cast<size_t>(sz.v), 0.0f);
  if (stage < 3) {
    params = init;
  } else {
    opt.scatter_params(init.data(), params.data());
  }
  for (int step = 1; step <= 3; ++step) {
    std::vector<int32_t> in, tg;
    global_batch(step, c.vocab_size, &in, &tg);
    int64_t step_valid = 0;
    for (int32_t t : tg) step_valid += t >= 0;
    const float dloss = 1.0f / float(step_valid);

    std::fill(ref_g.begin(), ref_g.end(), 0.0f);
    for (int k = 0; k < R; ++k) {
      net.accumulate(ref_p.data(), ref_g.data(), in.data() + k * b * kSeq, tg.data() + k * b * kSeq,
                     dloss);
    }
    ref_norms->push_back(adamw_step(table, ref_p.data(), ref_g.data(), ref_m.data(), ref_v.data(),
                                    cfg, cfg.lr, step));

    // This rank: its own sequences. The step's token count is known to every rank here (the
    // trainer all-reduces the per-rank counts).
    if (stage == 3) {
      const Status gathered = opt.gather_params(params.data(), full.data());
      EXPECT_TRUE(gathered.is_ok()) << gathered.to_string();
    }
    float* p = stage < 3 ? params.data() : full.data();
    std::fill(grads.begin(), grads.end(), 0.0f);
    net.accumulate(p, grads.data(), in.data() + me * b * kSeq, tg.data() + me * b * kSeq, dloss);
    ZeroBuffers buf{params.data(), grads.data(), grad_shard.data(), m.data(), v.data(), false};
    Result<double> norm = opt.step(buf, cfg, cfg.lr, step);
    EXPECT_TRUE(norm.is_ok()) << norm.status().to_string();
    norms->push_back(norm.is_ok() ? *norm : -1.0);
  }
  if (stage == 3) {
    const Status gathered = opt.gather_params(params.data(), full.data());
    EXPECT_TRUE(gathered.is_ok()) << gathered.to_string();
  }
  *ref = ref_p;
  EXPECT_GT(std::inner_product(ref_p.begin(), ref_p.end(), init.begin(), int64_t(0), std::plus<>(),
                               std::not_equal_to<>()),
            N / 2)
      << "the weights moved: the comparisons are not vacuous";
  return stage < 3 ? params : full;
}

// The data-parallel result against the single-process one: equal up to the rounding of
// gradient accumulation. oneDNN adds a GEMM's product into a non-zero gradient block by block
// (beta = 1), so accumulating micro-batch 2 onto micro-batch 1 rounds differently from adding
// two separately computed gradients; after three AdamW steps at lr 1e-3 that is ~1e-6 (measured
// 1.2e-6). 2e-5 is far below what a wrong normalisation, a missed rank or a stale shard gives
// (lr = 1e-3 per weight). And every stage gives the same weights as stage 0, bit for bit, on up
// to 2 ranks: the ZeRO machinery itself adds no rounding (train/zero.h).
TEST(DataParallel, RanksEqualOneProcessWithTheSameEffectiveBatchForEveryStage) {
  const int R = world().size();
  if (kGlobalBatch % R != 0) GTEST_SKIP() << "the global batch does not split over " << R;
  std::vector<float> stage0;
  std::vector<double> norms0;
  for (int stage = 0; stage <= 3; ++stage) {
    std::vector<float> ref;
    std::vector<double> norms, ref_norms;
    const std::vector<float> got = train_steps(stage, &ref, &norms, &ref_norms);
    double max_diff = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      max_diff = std::max(max_diff, double(std::fabs(got[i] - ref[i])));
    }
    EXPECT_LE(max_diff, 2e-5) << "stage " << stage;
    for (size_t s = 0; s < norms.size(); ++s) {
      EXPECT_NEAR(norms[s], ref_norms[s], 1e-5 * ref_norms[s]) << "stage " << stage;
    }
    if (stage == 0) {
      stage0 = got;
      norms0 = norms;
    } else {
      int64_t diff = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        diff += std::memcmp(&got[i], &stage0[i], sizeof(float)) != 0;
      }
      if (R <= 2) {
        EXPECT_EQ(diff, 0) << "stage " << stage << " vs stage 0";
      }
      for (size_t s = 0; s < norms.size(); ++s) {
        // All-reduce and reduce-scatter may add in different orders beyond 2 ranks.
        EXPECT_NEAR(norms[s], norms0[s], (R <= 2 ? 1e-12 : 1e-6) * norms0[s]) << "stage " << stage;
      }
    }
  }
}

}  // namespace
}  // namespace headroom::train
