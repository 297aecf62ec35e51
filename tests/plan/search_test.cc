// The memory plan and the search: lifetimes, the choice, the largest micro-batch, and the advice
// when nothing fits.
#include <gtest/gtest.h>

#include "backend/cpu/amx_gemm.h"
#include "core/units.h"
#include "plan/cost_model.h"
#include "plan/memory_plan.h"
#include "plan/search.h"

namespace headroom::plan {
namespace {

model::Gpt2Config gpt2_124m() { return *model::preset_config("gpt2"); }

DeviceSpec test_device(uint64_t memory) {
  DeviceSpec d;
  d.name = "test";
  d.kind = "cpu";
  d.memory_bytes = memory;
  d.flops_fp32 = 2e11;
  d.mem_bandwidth = 2e10;
  d.gemm_efficiency = 1;
  return d;
}

SearchRequest request(uint64_t memory, int global) {
  SearchRequest r;
  r.config = gpt2_124m();
  r.device = test_device(memory);
  r.device_memory = memory;
  r.seq = 256;
  r.global_batch = global;
  return r;
}

TEST(MemoryPlan, LifetimesFollowTheSchedule) {
  Result<MemoryPlan> mp = plan_training_memory(gpt2_124m(), Policy{2, 1, 64, "fp32", {}});
  ASSERT_TRUE(mp.is_ok());
  const auto& ids = mp->activations.ids;
  // Block 0's saved activations live from its forward to its backward (the last block op).
  const int fwd0 = 1, bwd0 = int(mp->ops.size()) - 2;
  EXPECT_EQ(mp->first_op[ids.fwd[0].fch], fwd0);
  EXPECT_EQ(mp->last_op[ids.fwd[0].fch], bwd0);
  // The logits die in the LM head's backward.
  EXPECT_EQ(mp->ops[size_t(mp->last_op[ids.logits])].name, "backward head");
  // Peak by category adds up to no more than the peak.
  uint64_t sum = 0;
  for (uint64_t b : mp->by_category) sum += b;
  EXPECT_LE(sum, mp->peak_bytes);
  EXPECT_GE(mp->peak_bytes, mp->lower_bound_bytes);
  // Persistent state: parameters, gradients and two Adam moments, 16 bytes per parameter.
  EXPECT_GE(mp->persistent_bytes, 16u * uint64_t(mp->params.num_parameters));
}

TEST(MemoryPlan, RejectsImpossiblePolicies) {
  EXPECT_FALSE(plan_training_memory(gpt2_124m(), Policy{1, 1, 4096, "fp32", {}}).is_ok());
  EXPECT_FALSE(plan_training_memory(gpt2_124m(), Policy{0, 1, 64, "fp32", {}}).is_ok());
  EXPECT_EQ(plan_training_memory(gpt2_124m(), Policy{1, 1, 64, "fp8", {}}).status().code(),
            StatusCode::kUnsupported);
}

TEST(Search, ChoosesAFittingPlanAndRejectsTheRest) {
  Result<SearchResult> r = search_plan(request(3 * kGiB, 512));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_TRUE(r->chosen);
  EXPECT_TRUE(r->chosen->fits);
  EXPECT_LE(r->chosen->peak_bytes, 3 * kGiB);
  EXPECT_EQ(r->chosen->policy.micro_batch * r->chosen->policy.accumulation, 512);
  for (const Candidate& c : r->candidates) {
    EXPECT_TRUE(c.fits);
    EXPECT_LE(c.peak_bytes, 3 * kGiB);
    EXPECT_LE(c.cost.tokens_per_s, r->chosen->cost.tokens_per_s);
  }
  ASSERT_FALSE(r->rejected.empty());  // micro-batch 512 cannot fit 3 GiB with any technique
  for (const Candidate& c : r->rejected) {
    EXPECT_GT(c.peak_bytes, 3 * kGiB);
    EXPECT_NE(c.rejected_because.find("over"), std::string::npos);
  }
  EXPECT_EQ(r->candidates.size() + r->rejected.size(), 10u);  // the divisors of 512
}

TEST(Search, RecomputationOnlyWhenItPaysOrIsNeeded) {
  // Plenty of memory: no recomputation, full logits (both are faster).
  Result<SearchResult> roomy = search_plan(request(64 * kGiB, 8));
  ASSERT_TRUE(roomy.is_ok() && roomy->chosen);
  EXPECT_EQ(recompute_summary(roomy->chosen->policy.exec), "none");
  EXPECT_EQ(roomy->chosen->policy.exec.head_chunk, 0);
  // --batch 32 in 3 GiB only fits with recomputation; the planner finds a schedule that fits.
  SearchRequest tight = request(3 * kGiB, 32);
  tight.micro_batch = 32;
  Result<SearchResult> t = search_plan(tight);
  ASSERT_TRUE(t.is_ok() && t->chosen);
  EXPECT_NE(recompute_summary(t->chosen->policy.exec), "none");
  EXPECT_LE(t->chosen->peak_bytes, 3 * kGiB);
  // The same with recomputation forbidden does not fit, and the advice names what would.
  tight.recompute = model::Recompute::kNone;
  Result<SearchResult> none = search_plan(tight);
  ASSERT_TRUE(none.is_ok());
  EXPECT_FALSE(none->chosen);
  EXPECT_NE(none->advice.find("--recompute auto: micro-batch 32 x 1"), std::string::npos)
      << none->advice;
  EXPECT_NE(none->advice.find("micro-batch 32 -> the planner's choice"), std::string::npos)
      << none->advice;
}

TEST(Search, LargestMicroBatchIsExact) {
  SearchRequest req = request(4 * kGiB, 64);
  req.sweep = true;
  Result<SearchResult> r = search_plan(req);
  ASSERT_TRUE(r.is_ok());
  const int m = r->max_micro_batch;
  ASSERT_GE(m, 64);  // the memory-techniques issue's figure for GPT-2 124M, T=256, 4 GiB
  // With the leanest techniques: fused head, full recomputation of every block.
  model::ExecOptions lean;
  lean.head_chunk = req.head_chunk;
  lean.recompute.assign(12, model::Recompute::kFull);
  Result<MemoryPlan> at = plan_training_memory(req.config, Policy{m, 1, 256, "fp32", lean});
  Result<MemoryPlan> above = plan_training_memory(req.config, Policy{m + 1, 1, 256, "fp32", lean});
  EXPECT_LE(at->peak_bytes, 4 * kGiB);
  EXPECT_GT(above->peak_bytes, 4 * kGiB);
  ASSERT_FALSE(r->sweep.empty());
  EXPECT_EQ(r->sweep.front().policy.micro_batch, 1);
  bool has_max = false;
  for (const Candidate& c : r->sweep) has_max |= c.policy.micro_batch == m;
  EXPECT_TRUE(has_max);
  EXPECT_FALSE(r->sweep.back().fits);  // the sweep goes one step past the limit
}

TEST(Search, ExplicitMicroBatchIsAConstraint) {
  SearchRequest req = request(8 * kGiB, 64);
  req.micro_batch = 4;
  Result<SearchResult> r = search_plan(req);
  ASSERT_TRUE(r.is_ok());
  ASSERT_TRUE(r->chosen);
  EXPECT_EQ(r->chosen->policy.micro_batch, 4);
  EXPECT_EQ(r->chosen->policy.accumulation, 16);
  req.micro_batch = 5;  // does not divide 64
  EXPECT_EQ(search_plan(req).status().code(), StatusCode::kInvalidArgument);
}

TEST(Search, TooSmallForTheWeightsSaysWhatIsMissing) {
  Result<SearchResult> r = search_plan(request(1 * kGiB, 8));
  ASSERT_TRUE(r.is_ok());
  EXPECT_FALSE(r->chosen);
  EXPECT_EQ(r->max_micro_batch, 0);
  EXPECT_NE(r->advice.find("nothing fits"), std::string::npos) << r->advice;
  EXPECT_NE(r->advice.find("more than the 1.00 GiB budget"), std::string::npos) << r->advice;
  EXPECT_NE(r->advice.find("bf16"), std::string::npos) << r->advice;
  EXPECT_NE(r->advice.find("optimizer offload"), std::string::npos) << r->advice;
}

// The fused head's GEMMs run per chunk: small chunks are priced at the efficiency of their rows,
// so the same step costs more GEMM time with chunk 128 than with 1024, and the body's GEMMs the
// same as with full logits.
TEST(CostModel, FusedHeadGemmsArePricedPerChunk) {
  const model::Gpt2Config c = gpt2_124m();
  auto gemm_seconds = [&](int chunk) {
    Policy p;
    p.micro_batch = 8;
    p.seq = 256;
    p.exec.tiled_attention = true;
    p.exec.head_chunk = chunk;
    Result<MemoryPlan> mp = plan_training_memory(c, p);
    EXPECT_TRUE(mp.is_ok()) << mp.status().to_string();
    return estimate_step(c, *mp, test_device(64 * kGiB)).gemm_seconds;
  };
  const double small = gemm_seconds(128), large = gemm_seconds(1024), full = gemm_seconds(0);
  EXPECT_GT(small, large * 1.02);
  // chunk 1024 of 2048 rows: the head at 1024/(1024+64) of the speed, plus its recompute GEMM.
  const double V = c.vocab_size, C = c.n_embd, tokens = 8 * 256;
  const double head = 8 * V * C * tokens, full_head = 6 * V * C * tokens;
  const double rate = 2e11;
  const double body = full - full_head / (rate * 2048 / (2048 + kGemmHalfRows));
  EXPECT_NEAR(large, body + head / (rate * 1024 / (1024 + kGemmHalfRows)), 1e-9 * large);
}

// bf16: the transposing copies of the weight-gradient GEMMs that take them (GPT-2 124M: the MLP's
// two and the full-logits head, docs/gemm.md) are memory traffic of the step.
TEST(CostModel, CountsTheWeightGradientTransposes) {
  const model::Gpt2Config c = *model::preset_config("gpt2");
  Policy p;
  p.micro_batch = 8;
  p.accumulation = 1;
  p.seq = 256;
  p.precision = "bf16";
  p.exec.precision = model::Precision::kBf16;
  Result<MemoryPlan> mp = plan_training_memory(c, p);
  ASSERT_TRUE(mp.is_ok()) << mp.status().to_string();
  MemoryPlan without = *mp;
  uint64_t staging = 0;
  for (size_t i = 0; i < without.step.buffers.size(); i++) {
    if (without.step.buffers[i].name != "bf16_wgrad_staging") continue;
    staging = without.step.buffers[i].bytes();
    without.step.buffers.erase(without.step.buffers.begin() + ptrdiff_t(i));
    break;
  }
  ASSERT_GT(staging, 0u);
  const DeviceSpec d = test_device(64 * kGiB);
  const double with_copies = estimate_step(c, *mp, d).memory_bytes;
  const double none = estimate_step(c, without, d).memory_bytes;
  const double N = 8 * 256, C = c.n_embd, V = c.vocab_size;
  // The staging buffer's own traffic (as every step buffer's: 4 passes), then the copies, 4 bytes
  // an element. oneDNN: the MLP's two per GEMM (inp^T and dout^T: C + 4C columns each), the
  // head's (C + V). Our AMX kernel: the GEMM's A only: the MLP's inp^T (C, then 4C), the head's
  // dlogits^T (V).
  const bool amx = cpu::amx_gemm_takes(int(N), DType::kF32);
  const double mlp_cols = amx ? 5 * C : 2 * 5 * C, head_cols = amx ? V : C + V;
  const double expected = 4.0 * double(staging) + c.n_layer * 4 * N * mlp_cols + 4 * N * head_cols;
  EXPECT_NEAR(with_copies - none, expected, 1e-9 * with_copies);
}

TEST(Search, CostModelPrefersFewerLargerMicroBatches) {
  Result<SearchResult> r = search_plan(request(64 * kGiB, 16));
  ASSERT_TRUE(r.is_ok());
  ASSERT_TRUE(r->chosen);
  EXPECT_EQ(r->chosen->policy.micro_batch, 16);
}

}  // namespace
}  // namespace headroom::plan
