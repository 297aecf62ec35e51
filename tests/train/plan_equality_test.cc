// Principle 1 (DESIGN.md): the plan is the allocation. For many configurations, a training step
// measures exactly the planned peak of device bytes, with no allocation outside the plan; and
// running from the planned (reused) offsets gives bit-identical results to one buffer each.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "backend/cpu/kernels.h"
#include "data/token_file.h"
#include "memory/host_resource.h"
#include "model/gpt2.h"
#include "plan/memory_plan.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

using train::test::gpt2_config;
using train::test::one_micro_batch;

std::string random_token_file(int vocab, int n) {
  std::string path = (fs::path(testing::TempDir()) / ("plan_eq_" + std::to_string(getpid()) + "_" +
                                                      std::to_string(vocab) + ".tok"))
                         .string();
  std::mt19937 rng(7);
  std::vector<int32_t> toks(static_cast<size_t>(n));
  for (auto& t : toks) t = int32_t(rng() % uint32_t(vocab - 1));
  for (size_t i = 50; i < toks.size(); i += 97) toks[i] = vocab - 1;  // document ends
  EXPECT_TRUE(data::write_token_file(path, toks, vocab, vocab - 1, toks.size() / 97).is_ok());
  return path;
}

struct Case {
  int L, C, NH, V, P, B, T, K;
  bool tiled = true;
  int head_chunk = 0;
  model::Recompute recompute = model::Recompute::kNone;
  model::Precision precision = model::Precision::kFp32;
  bool bf16_weight_copy = true;
  int nkv = 0;  // > 0: a Llama with this many key/value heads (grouped-query attention)
  bool tied = true;
};

TEST(PlanEquality, MeasuredPeakEqualsPlannedPeak) {
  const Case cases[] = {
      {1, 32, 2, 101, 16, 1, 8, 1},
      {2, 64, 4, 257, 64, 2, 16, 2},
      {2, 64, 4, 257, 64, 4, 33, 1},
      {3, 48, 3, 500, 32, 3, 32, 1},
      {4, 128, 4, 1000, 128, 2, 64, 1},
      {2, 96, 6, 333, 80, 5, 80, 3},
      {2, 64, 4, 257, 64, 2, 16, 2, false},
      {3, 64, 4, 500, 64, 2, 32, 1, true, 24},
      {3, 64, 4, 500, 64, 2, 32, 2, true, 0, model::Recompute::kSelective},
      {3, 64, 4, 500, 64, 3, 32, 1, false, 16, model::Recompute::kFull},
      {2, 64, 4, 257, 64, 2, 16, 2, true, 0, model::Recompute::kNone, model::Precision::kBf16},
      {3, 64, 4, 500, 64, 2, 32, 1, true, 24, model::Recompute::kSelective,
       model::Precision::kBf16},
      {3, 64, 4, 500, 64, 3, 32, 2, true, 16, model::Recompute::kFull, model::Precision::kBf16},
      {2, 64, 4, 257, 64, 2, 16, 2, true, 0, model::Recompute::kSelective, model::Precision::kBf16,
       false},
      // fp16: f16 activations, weights cast per layer, the f16 GEMM staging area.
      {2, 64, 4, 257, 64, 2, 16, 2, true, 0, model::Recompute::kNone, model::Precision::kFp16},
      {3, 64, 4, 500, 64, 2, 32, 1, true, 24, model::Recompute::kSelective,
       model::Precision::kFp16},
      {3, 64, 4, 500, 64, 3, 32, 2, true, 16, model::Recompute::kFull, model::Precision::kFp16},
      // Llama: GQA, RoPE, SwiGLU, RMSNorm; tied and untied heads, every precision.
      {2, 64, 4, 257, 64, 2, 16, 2, true, 0, model::Recompute::kNone, model::Precision::kFp32, true,
       2, false},
      {2, 64, 4, 257, 64, 2, 16, 1, false, 0, model::Recompute::kNone, model::Precision::kFp32,
       true, 1, true},
      {3, 64, 4, 500, 64, 2, 32, 2, true, 24, model::Recompute::kSelective, model::Precision::kBf16,
       true, 2, false},
      {3, 64, 4, 500, 64, 3, 32, 1, true, 16, model::Recompute::kFull, model::Precision::kBf16,
       false, 2, true},
      {2, 64, 4, 257, 64, 2, 16, 2, true, 0, model::Recompute::kSelective, model::Precision::kFp16,
       true, 2, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "L=" << c.L << " C=" << c.C << " B=" << c.B << " T=" << c.T << " K=" << c.K
                 << " tiled=" << c.tiled << " chunk=" << c.head_chunk
                 << " recompute=" << model::recompute_name(c.recompute) << " precision="
                 << model::precision_name(c.precision) << " nkv=" << c.nkv << " tied=" << c.tied);
    train::TrainOptions o;
    o.config = c.nkv > 0 ? train::test::llama_config(c.L, c.C, c.NH, c.nkv, c.V, c.P, c.tied)
                         : gpt2_config(c.L, c.C, c.NH, c.V, c.P);
    o.model_name = "test";
    o.data = random_token_file(c.V, 20000);
    o.seq = c.T;
    o.micro_batch = c.B;
    o.accumulation = c.K;
    o.exec.tiled_attention = c.tiled;
    o.exec.head_chunk = c.head_chunk;
    if (c.recompute != model::Recompute::kNone) o.exec.recompute.assign(size_t(c.L), c.recompute);
    o.exec.precision = c.precision;
    o.exec.bf16_weight_copy = c.bf16_weight_copy;
    o.steps = 2;
    o.warmup_steps = 1;
    o.device_memory = uint64_t(1) << 32;
    o.eval_batches = 1;
    uint64_t planned = 0;
    train::TrainCallbacks cb;
    cb.on_step = [&](const train::StepStats& s) {
      planned = s.planned_peak_bytes;
      EXPECT_EQ(s.device_bytes_peak, s.planned_peak_bytes);
    };
    Result<train::TrainResult> r = train::run_training(o, cb);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    plan::Policy p{c.B, c.K, c.T, std::string(model::precision_name(c.precision)), o.exec};
    Result<plan::MemoryPlan> mp = plan::plan_training_memory(o.config, p);
    ASSERT_TRUE(mp.is_ok());
    EXPECT_EQ(planned, mp->peak_bytes);
    EXPECT_EQ(r->device_bytes_peak, mp->peak_bytes);
    // One allocation per planned region, nothing else.
    EXPECT_EQ(r->memory.allocations, mp->persistent.size() + 1);
    EXPECT_GE(mp->peak_bytes, mp->lower_bound_bytes);
    fs::remove(o.data);
  }
}

// Optimizer offload: the device holds what the plan says (m and v gone), and the offload tier,
// a memory stack of its own, holds exactly the plan's offload regions.
TEST(PlanEquality, OptimizerOffloadMeasuredEqualsPlannedOnBothTiers) {
  const Case cases[] = {
      {2, 64, 4, 257, 64, 2, 16, 2},
      {3, 48, 3, 500, 32, 3, 32, 1, true, 24, model::Recompute::kSelective},
      {2, 64, 4, 257, 64, 2, 16, 2, true, 0, model::Recompute::kNone, model::Precision::kBf16},
      {3, 64, 4, 500, 64, 3, 32, 2, true, 16, model::Recompute::kFull, model::Precision::kBf16,
       false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "L=" << c.L << " C=" << c.C << " B=" << c.B << " K=" << c.K
                                      << " precision=" << model::precision_name(c.precision)
                                      << " nkv=" << c.nkv << " tied=" << c.tied);
    train::TrainOptions o;
    o.config = c.nkv > 0 ? train::test::llama_config(c.L, c.C, c.NH, c.nkv, c.V, c.P, c.tied)
                         : gpt2_config(c.L, c.C, c.NH, c.V, c.P);
    o.model_name = "test";
    o.data = random_token_file(c.V, 20000);
    o.seq = c.T;
    o.micro_batch = c.B;
    o.accumulation = c.K;
    o.exec.tiled_attention = c.tiled;
    o.exec.head_chunk = c.head_chunk;
    if (c.recompute != model::Recompute::kNone) o.exec.recompute.assign(size_t(c.L), c.recompute);
    o.exec.precision = c.precision;
    o.exec.bf16_weight_copy = c.bf16_weight_copy;
    o.steps = 2;
    o.warmup_steps = 1;
    o.device_memory = uint64_t(1) << 32;
    o.eval_batches = 1;
    o.offload_optimizer = true;
    o.offload_memory = uint64_t(1) << 32;
    int steps = 0;
    train::TrainCallbacks cb;
    cb.on_step = [&](const train::StepStats& s) {
      steps++;
      EXPECT_EQ(s.device_bytes_peak, s.planned_peak_bytes);
      EXPECT_EQ(s.offload_bytes_peak, s.planned_offload_bytes);
    };
    Result<train::TrainResult> r = train::run_training(o, cb);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(steps, 2);
    plan::Policy p{c.B, c.K, c.T, std::string(model::precision_name(c.precision)), o.exec};
    Result<plan::MemoryPlan> without = plan::plan_training_memory(o.config, p);
    p.offload_optimizer = true;
    Result<plan::MemoryPlan> mp = plan::plan_training_memory(o.config, p);
    ASSERT_TRUE(mp.is_ok() && without.is_ok());
    EXPECT_EQ(r->device_bytes_peak, mp->peak_bytes);
    EXPECT_EQ(r->planned_peak_bytes, mp->peak_bytes);
    EXPECT_EQ(r->offload_bytes_peak, mp->offload_bytes);
    EXPECT_EQ(r->planned_offload_bytes, mp->offload_bytes);
    // By arithmetic: m and v (8 bytes a parameter, 64-byte aligned) left the device; the offload
    // tier holds master, m, v and the gradient copy (16 bytes a parameter).
    const uint64_t p4 = (uint64_t(mp->params.total_floats) * 4 + 63) / 64 * 64;
    EXPECT_EQ(without->peak_bytes - mp->peak_bytes, 2 * p4);
    EXPECT_EQ(mp->offload_bytes, 4 * p4);
    // One allocation per non-empty device region and the step region; three on the offload tier.
    size_t regions = 0;
    for (const plan::Region& reg : mp->persistent) regions += reg.layout.size > 0;
    EXPECT_EQ(r->memory.allocations, regions + 1);
    EXPECT_EQ(r->offload_memory.allocations, mp->offload.size());
  }
}

// Activation offload: the device peak is still the plan's, and the offload tier (a resource of
// its own) measures exactly the plan's offload regions.
TEST(PlanEquality, MeasuredPeaksEqualPlannedWithActivationOffload) {
  using R = model::Recompute;
  struct OffloadCase {
    int L, B, T, K;
    std::vector<R> recompute;
    std::vector<bool> offload;
    int head_chunk = 0;
    model::Precision precision = model::Precision::kFp32;
    bool offload_optimizer = false;  // both kinds in one offload tier
  };
  const std::vector<OffloadCase> cases = {
      {2, 2, 16, 1, {}, {true, true}},
      {3, 3, 32, 2, {}, {false, true, false}},
      {4, 2, 32, 2, {R::kFull, R::kNone, R::kSelective, R::kNone}, {false, true, true, true}, 24},
      {4, 2, 33, 3, {R::kSelective, R::kSelective, R::kFull, R::kNone}, {true, false, false, true}},
      {3,
       2,
       32,
       2,
       {R::kNone, R::kFull, R::kSelective},
       {true, false, true},
       16,
       model::Precision::kBf16},
      {2, 2, 16, 2, {}, {true, true}, 0, model::Precision::kFp32, true},
      {3,
       2,
       32,
       2,
       {R::kSelective, R::kFull, R::kNone},
       {true, false, true},
       16,
       model::Precision::kBf16,
       true},
  };
  for (const OffloadCase& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "L=" << c.L << " B=" << c.B << " T=" << c.T << " K=" << c.K
                 << " chunk=" << c.head_chunk << " optimizer offload=" << c.offload_optimizer);
    train::TrainOptions o;
    o.config = gpt2_config(c.L, 64, 4, 300, 64);
    o.model_name = "test";
    o.data = random_token_file(300, 20000);
    o.seq = c.T;
    o.micro_batch = c.B;
    o.accumulation = c.K;
    o.exec.recompute = c.recompute;
    o.exec.offload = c.offload;
    o.exec.head_chunk = c.head_chunk;
    o.exec.precision = c.precision;
    o.steps = 2;
    o.warmup_steps = 1;
    o.device_memory = uint64_t(1) << 32;
    o.offload_memory = uint64_t(1) << 30;
    o.offload_optimizer = c.offload_optimizer;
    o.eval_batches = 1;
    train::TrainCallbacks cb;
    cb.on_step = [&](const train::StepStats& s) {
      EXPECT_EQ(s.device_bytes_peak, s.planned_peak_bytes);
      EXPECT_GT(s.offload_bytes, 0u);
      EXPECT_EQ(s.offload_bytes_peak, s.planned_offload_bytes);
    };
    Result<train::TrainResult> r = train::run_training(o, cb);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    plan::Policy p{c.B, c.K, c.T, std::string(model::precision_name(c.precision)), o.exec};
    p.offload_optimizer = c.offload_optimizer;
    Result<plan::MemoryPlan> mp = plan::plan_training_memory(o.config, p);
    ASSERT_TRUE(mp.is_ok());
    EXPECT_EQ(r->device_bytes_peak, mp->peak_bytes);
    // Device allocations: the planned non-empty regions only (the optimizer's is empty with
    // optimizer offload); the offload tier is counted on its own, one allocation per region.
    size_t regions = 0;
    for (const plan::Region& reg : mp->persistent) regions += reg.layout.size > 0;
    EXPECT_EQ(r->memory.allocations, regions + 1);
    EXPECT_GT(plan::offloaded_activation_bytes(*mp), 0u);
    EXPECT_EQ(plan::offloaded_optimizer_bytes(*mp) > 0, c.offload_optimizer);
    EXPECT_EQ(r->offload_bytes_peak, mp->offload_bytes);
    EXPECT_EQ(r->planned_offload_bytes, mp->offload_bytes);
    EXPECT_EQ(r->offload_memory.allocations, mp->offload.size());
    fs::remove(o.data);
  }
}

TEST(PlanEquality, TheStepRegionReusesMemory) {
  // Backward workspaces reuse the logits' memory once the LM head's backward is done.
  model::Gpt2Config c = gpt2_config(4, 128, 4, 5000, 128);
  Result<plan::MemoryPlan> mp = plan::plan_training_memory(c, plan::Policy{4, 1, 128, "fp32", {}});
  ASSERT_TRUE(mp.is_ok());
  uint64_t sum = 0;
  for (const auto& b : mp->step.buffers) sum += (b.bytes() + 63) / 64 * 64;
  EXPECT_LT(mp->step_bytes, sum);
  // Within 5% of the lower bound (most bytes live at one op).
  EXPECT_LE(double(mp->step_bytes), 1.05 * double(mp->step_lower_bound));
}

TEST(PlanEquality, PlannedOffsetsGiveBitIdenticalGradients) {
  model::Gpt2Config c = gpt2_config(3, 64, 4, 300, 64);
  Result<plan::MemoryPlan> mp = plan::plan_training_memory(c, plan::Policy{2, 1, 32, "fp32", {}});
  ASSERT_TRUE(mp.is_ok());
  auto planned = one_micro_batch(c, *mp, mp->step.layout);
  auto plain = one_micro_batch(c, *mp, memory::sequential_layout(mp->step.buffers));
  EXPECT_EQ(planned.second, plain.second);
  ASSERT_EQ(planned.first.size(), plain.first.size());
  EXPECT_EQ(0, std::memcmp(planned.first.data(), plain.first.data(), planned.first.size() * 4));
}

// An attention n_head x head_dim wide, narrower (pruned heads) or wider than n_embd (Note
// [Attention width]): the plan sizes atty and the attention output's gradient by it, and its
// offsets give the sequential layout's bits, with every recompute policy and in a Llama with
// grouped-query attention.
TEST(PlanEquality, AnAttentionWidthOtherThanNEmbdPlansAndRunsAsTheSequentialLayout) {
  model::TransformerConfig llama = train::test::llama_config(2, 64, 4, 2, 300, 64, false);
  for (model::TransformerConfig c : {gpt2_config(3, 64, 4, 300, 64), llama}) {
    for (int hd : {8, 24}) {
      c.head_dim = hd;
      for (model::Recompute rc :
           {model::Recompute::kNone, model::Recompute::kSelective, model::Recompute::kFull}) {
        SCOPED_TRACE(c.model_type + " head_dim " + std::to_string(hd) + " recompute " +
                     std::string(model::recompute_name(rc)));
        model::ExecOptions e;
        e.recompute.assign(size_t(c.n_layer), rc);
        Result<plan::MemoryPlan> mp =
            plan::plan_training_memory(c, plan::Policy{2, 1, 32, "fp32", e});
        ASSERT_TRUE(mp.is_ok()) << mp.status().to_string();
        const model::Gpt2ActivationIds& id = mp->activations.ids;
        EXPECT_EQ(mp->step.buffers[id.fwd[0].atty].shape, (Shape{2, 32, 4 * hd}));
        EXPECT_EQ(mp->step.buffers[id.d_c].shape, (Shape{2, 32, std::max(64, 4 * hd)}));
        auto planned = one_micro_batch(c, *mp, mp->step.layout);
        auto plain = one_micro_batch(c, *mp, memory::sequential_layout(mp->step.buffers));
        EXPECT_TRUE(std::isfinite(planned.second));
        EXPECT_EQ(planned.second, plain.second);
        ASSERT_EQ(planned.first.size(), plain.first.size());
        EXPECT_EQ(0,
                  std::memcmp(planned.first.data(), plain.first.data(), planned.first.size() * 4));
      }
    }
  }
}

// Padding the MLP rows off 4 KiB multiples (C = 256: 4C = 1024 floats = 4 KiB) is a layout
// choice only: the same loss and gradients as dense rows, to the rounding of a different GEMM
// blocking.
TEST(PlanEquality, PaddedMlpRowsMatchDenseRows) {
  model::Gpt2Config c = gpt2_config(2, 256, 4, 300, 64);
  model::ExecOptions padded, dense;
  dense.pad_rows = false;
  Result<plan::MemoryPlan> mp_pad =
      plan::plan_training_memory(c, plan::Policy{2, 1, 32, "fp32", padded});
  Result<plan::MemoryPlan> mp_dense =
      plan::plan_training_memory(c, plan::Policy{2, 1, 32, "fp32", dense});
  ASSERT_TRUE(mp_pad.is_ok() && mp_dense.is_ok());
  const auto& fch = mp_pad->step.buffers[mp_pad->activations.ids.fwd[0].fch];
  EXPECT_EQ(fch.shape[2], 1024 + 16);  // padded
  EXPECT_EQ(mp_dense->step.buffers[mp_dense->activations.ids.fwd[0].fch].shape[2], 1024);
  auto a = one_micro_batch(c, *mp_pad, mp_pad->step.layout);
  auto b = one_micro_batch(c, *mp_dense, mp_dense->step.layout);
  EXPECT_NEAR(a.second, b.second, 1e-6 * std::fabs(b.second));
  double worst = 0, scale = 0;
  for (size_t i = 0; i < a.first.size(); i++) {
    worst = std::max(worst, double(std::fabs(a.first[i] - b.first[i])));
    scale = std::max(scale, double(std::fabs(b.first[i])));
  }
  EXPECT_LE(worst, 1e-5 * scale);
  EXPECT_GT(scale, 0);
}

}  // namespace
}  // namespace headroom
