// The search with activation offload: under a tight budget and a fast link the schedule
// offloads blocks and beats recomputation; with a slow link (or no room in the offload tier) it
// recomputes instead; the cost model hides transfers behind compute, never below zero.
#include <gtest/gtest.h>

#include "core/units.h"
#include "plan/search.h"

namespace headroom::plan {
namespace {

model::Gpt2Config gpt2_124m() { return *model::preset_config("gpt2"); }

DeviceSpec device(double offload_bandwidth) {
  DeviceSpec d;
  d.name = "test-gpu";
  d.kind = "gpu";
  d.flops_fp32 = 2e13;
  d.mem_bandwidth = 1e12;
  d.gemm_efficiency = 1;
  d.offload_bandwidth = offload_bandwidth;
  return d;
}

Policy policy(const model::ExecOptions& e) { return Policy{8, 1, 256, "fp32", e}; }

uint64_t peak_of(const model::ExecOptions& e) {
  Result<MemoryPlan> mp = plan_training_memory(gpt2_124m(), policy(e));
  EXPECT_TRUE(mp.is_ok());
  return mp.is_ok() ? mp->peak_bytes : 0;
}

// Between the all-offload peak and the no-technique peak: something must give.
SearchRequest tight(double offload_bandwidth) {
  model::ExecOptions all_off;
  all_off.offload.assign(12, true);
  SearchRequest r;
  r.config = gpt2_124m();
  r.device = device(offload_bandwidth);
  r.device_memory = peak_of(all_off) + 64 * kMiB;
  EXPECT_LT(r.device_memory, peak_of({}));
  r.seq = 256;
  r.global_batch = 8;
  r.micro_batch = 8;
  r.offload_memory = 64 * kGiB;
  r.fused_head = false;
  // About activations: the same link would also price optimizer offload (offload_link_bandwidth),
  // which has its own tests.
  r.offload_optimizer = false;
  return r;
}

TEST(OffloadSearch, AFastLinkOffloadsBlocksAndBeatsRecomputation) {
  SearchRequest r = tight(1e13);
  Result<SearchResult> fast = search_plan(r);
  ASSERT_TRUE(fast.is_ok() && fast->chosen) << (fast.is_ok() ? fast->advice : "");
  const Candidate& c = *fast->chosen;
  EXPECT_GT(offloaded_blocks(c.policy.exec), 0) << describe_exec(c.policy.exec);
  EXPECT_LE(c.peak_bytes, r.device_memory);
  EXPECT_GT(c.offload_bytes, 0u);
  EXPECT_GT(c.cost.offload_bytes, 0.0);
  ASSERT_TRUE(fast->chosen_plan);
  EXPECT_EQ(fast->chosen_plan->offload_bytes, c.offload_bytes);
  // The transfers hide behind compute on this link.
  EXPECT_EQ(c.cost.offload_seconds, 0.0);
  // Cheaper than the recomputation-only schedule for the same budget, and than full
  // recomputation everywhere.
  SearchRequest no_off = r;
  no_off.offload_activations = false;
  Result<SearchResult> rc = search_plan(no_off);
  ASSERT_TRUE(rc.is_ok() && rc->chosen);
  EXPECT_EQ(offloaded_blocks(rc->chosen->policy.exec), 0);
  EXPECT_NE(recompute_summary(rc->chosen->policy.exec), "none");
  EXPECT_LT(c.cost.step_seconds, rc->chosen->cost.step_seconds);
  model::ExecOptions full;
  full.recompute.assign(12, model::Recompute::kFull);
  Result<MemoryPlan> full_plan = plan_training_memory(gpt2_124m(), policy(full));
  ASSERT_TRUE(full_plan.is_ok());
  EXPECT_LT(c.cost.step_seconds, estimate_step(gpt2_124m(), *full_plan, r.device).step_seconds);
  // The schedule per block names the choice of every block.
  const std::vector<std::string> per_block = schedule_per_block(c.policy.exec, 12);
  ASSERT_EQ(per_block.size(), 12u);
  EXPECT_EQ(std::count(per_block.begin(), per_block.end(), "offload") +
                std::count(per_block.begin(), per_block.end(), "selective+offload"),
            offloaded_blocks(c.policy.exec));
}

TEST(OffloadSearch, ASlowLinkRecomputesInstead) {
  Result<SearchResult> slow = search_plan(tight(1e6));  // 1 MB/s
  ASSERT_TRUE(slow.is_ok() && slow->chosen);
  EXPECT_EQ(offloaded_blocks(slow->chosen->policy.exec), 0)
      << describe_exec(slow->chosen->policy.exec);
  EXPECT_NE(recompute_summary(slow->chosen->policy.exec), "none");
}

TEST(OffloadSearch, NoRoomInTheOffloadTierNoOffload) {
  SearchRequest r = tight(1e13);
  r.offload_memory = kMiB;
  Result<SearchResult> s = search_plan(r);
  ASSERT_TRUE(s.is_ok() && s->chosen);
  EXPECT_EQ(offloaded_blocks(s->chosen->policy.exec), 0);
  // No offload tier at all (the library default): never offloaded.
  r.offload_memory = 0;
  s = search_plan(r);
  ASSERT_TRUE(s.is_ok() && s->chosen);
  EXPECT_EQ(offloaded_blocks(s->chosen->policy.exec), 0);
}

TEST(OffloadSearch, OnOffloadsEveryBlockAndBadCombinationsAreRefused) {
  SearchRequest r = tight(1e13);
  r.offload_activations = true;
  Result<SearchResult> on = search_plan(r);
  ASSERT_TRUE(on.is_ok() && on->chosen);
  EXPECT_EQ(offloaded_blocks(on->chosen->policy.exec), 12);
  r.recompute = model::Recompute::kFull;
  Result<SearchResult> bad = search_plan(r);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("--offload-activations on"), std::string::npos);
  r.recompute.reset();
  r.device.offload_bandwidth = 0;
  r.device.host_link_bandwidth = 0;
  bad = search_plan(r);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("offload bandwidth"), std::string::npos);
}

TEST(OffloadCost, ExposedTimeIsTransferLessOverlappedComputeNeverNegative) {
  model::ExecOptions e;
  e.offload = {false, false, true, false, false, false, false, false, false, false, false, false};
  Result<MemoryPlan> mp = plan_training_memory(gpt2_124m(), policy(e));
  ASSERT_TRUE(mp.is_ok());
  const DeviceSpec d = device(1);
  const double bytes = double(mp->activations.offloaded[0].bytes);
  // Block 3's forward hides block 2's copy out, its backward (twice the forward) the copy back.
  const double rows = 8.0 * 256, C = 768, T = 256;
  const double rate = d.flops_fp32 * rows / (rows + kGemmHalfRows);
  const double fwd = (24.0 * C * C + 4.0 * T * C) * rows / rate;
  for (double bw : {1e6, bytes / fwd * 1.5, bytes / fwd, 1e13}) {
    const double t = bytes / bw;
    const double want = std::max(0.0, t - fwd) + std::max(0.0, t - 2.0 * fwd);
    EXPECT_NEAR(offload_exposed_seconds(gpt2_124m(), *mp, d, bw), want, 1e-9 * (1 + want)) << bw;
  }
  // Accumulation multiplies it; the step time includes it.
  DeviceSpec slow = device(1e6);
  Policy p = policy(e);
  p.accumulation = 3;
  Result<MemoryPlan> mp3 = plan_training_memory(gpt2_124m(), p);
  ASSERT_TRUE(mp3.is_ok());
  const StepCost c3 = estimate_step(gpt2_124m(), *mp3, slow);
  EXPECT_NEAR(c3.offload_seconds, 3 * offload_exposed_seconds(gpt2_124m(), *mp3, slow, 1e6), 1e-9);
  EXPECT_DOUBLE_EQ(c3.offload_bytes, 3 * 2 * bytes);
  EXPECT_GE(c3.step_seconds, c3.offload_seconds + c3.gemm_seconds);
}

}  // namespace
}  // namespace headroom::plan
