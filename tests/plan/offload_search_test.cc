// Optimizer offload in the planner (issue #4; issue #8's 7B on 4 x L4): what leaves the device,
// what the offload tier holds, how the copies are priced, and when the search turns it on.
#include <gtest/gtest.h>

#include <algorithm>

#include <chrono>

#include "core/units.h"
#include "model/config.h"
#include "plan/search.h"

namespace headroom::plan {
namespace {

using memory::Category;

uint64_t round64(uint64_t b) { return (b + 63) / 64 * 64; }

DeviceSpec cpu_like(uint64_t memory) {
  DeviceSpec d;
  d.name = "test";
  d.kind = "cpu";
  d.memory_bytes = memory;
  d.flops_fp32 = 2e11;
  d.mem_bandwidth = 2e10;
  d.host_link_bandwidth = 1e10;
  d.host_memory_bandwidth = 2e10;
  d.gemm_efficiency = 1;
  d.interconnect_bandwidth = 1e10;
  return d;
}

SearchRequest seven_b_on_four_l4s() {
  SearchRequest r;
  r.config = *model::resolve_model(std::string(HEADROOM_SOURCE_DIR) + "/configs/gpt-7b.json");
  r.device = *named_device("L4");
  r.device_memory = 24 * kGiB;
  r.devices = 4;
  r.seq = 2048;
  r.global_batch = 64;
  r.precision = "auto";
  return r;
}

TEST(OffloadPlan, RegionsMoveToTheOffloadTier) {
  const model::Gpt2Config c = *model::preset_config("gpt2-tiny");
  for (const char* precision : {"fp32", "bf16"}) {
    Policy p;
    p.micro_batch = 2;
    p.accumulation = 2;
    p.seq = 64;
    p.precision = precision;
    Result<MemoryPlan> off = plan_training_memory(c, p);
    p.offload_optimizer = true;
    Result<MemoryPlan> on = plan_training_memory(c, p);
    ASSERT_TRUE(off.is_ok() && on.is_ok()) << on.status().to_string();
    const uint64_t P4 = round64(uint64_t(off->params.total_floats) * 4);
    // The device loses m and v (and nothing else: the fp32 parameters stay as the weights the
    // executor reads, with bf16 next to the bf16 copy); the step region is the same.
    EXPECT_EQ(off->peak_bytes - on->peak_bytes, 2 * P4) << precision;
    EXPECT_EQ(on->step_bytes, off->step_bytes);
    EXPECT_EQ(on->persistent.size(), off->persistent.size());  // indices do not move
    EXPECT_TRUE(on->persistent[2].buffers.empty());
    EXPECT_EQ(on->persistent[2].layout.size, 0u);
    EXPECT_EQ(on->by_category[size_t(Category::kOptimizer)], 0u);
    EXPECT_EQ(on->by_category[size_t(Category::kMaster)], 0u);
    // The offload tier: master, m, v and the gradient copy, 16 bytes a parameter.
    ASSERT_EQ(on->offload.size(), 3u);
    EXPECT_EQ(on->offload_bytes, 4 * P4);
    ASSERT_TRUE(offload_region(*on, kOffloadMasterRegion) &&
                offload_region(*on, kOffloadOptimizerRegion) &&
                offload_region(*on, kOffloadGradientsRegion));
    EXPECT_EQ(offload_region(*on, kOffloadMasterRegion)->category, Category::kMaster);
    EXPECT_EQ(offload_region(*on, kOffloadOptimizerRegion)->buffers.size(), 2u);
    EXPECT_EQ(offload_region(*on, kOffloadGradientsRegion)->category, Category::kGrads);
    EXPECT_EQ(offload_region(*on, kOffloadedActivationsRegion), nullptr);
    EXPECT_EQ(offloaded_optimizer_bytes(*on), 4 * P4);
    EXPECT_EQ(offloaded_activation_bytes(*on), 0u);
    EXPECT_TRUE(off->offload.empty());
    EXPECT_EQ(off->offload_bytes, 0u);
    EXPECT_NE(offload_table(*on, 0).find("adam_m"), std::string::npos);
    EXPECT_EQ(offload_table(*off, 0), "");
  }
  // ZeRO-1 over 2 ranks: the offload tier holds the rank's shard.
  Policy p;
  p.micro_batch = 1;
  p.seq = 32;
  p.ranks = 2;
  p.zero_stage = 1;
  p.offload_optimizer = true;
  Result<MemoryPlan> sharded = plan_training_memory(c, p);
  ASSERT_TRUE(sharded.is_ok());
  const int64_t P = sharded->params.total_floats;
  const int64_t S = ((P + 1) / 2 + 15) / 16 * 16;
  EXPECT_EQ(sharded->offload_bytes, 4 * round64(uint64_t(S) * 4));
}

TEST(OffloadPlan, SevenBOnFourL4sFitsOnlyWithOptimizerOffload) {
  SearchRequest r = seven_b_on_four_l4s();
  const auto t0 = std::chrono::steady_clock::now();
  Result<SearchResult> res = search_plan(r);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(res.is_ok()) << res.status().to_string();
  ASSERT_TRUE(res->chosen) << res->advice;
  // A runaway-search detector, not a timing (docs/notes/offload.md quotes the real figure): 4.4 s
  // under ASan in a debug build, 0.1 s in release.
  EXPECT_LT(ms, 30000.0);
  const Candidate& c = *res->chosen;
  EXPECT_TRUE(c.fits);
  EXPECT_TRUE(c.policy.offload_optimizer);
  EXPECT_LE(c.peak_bytes, 24 * kGiB);
  EXPECT_EQ(c.policy.ranks, 4);
  EXPECT_EQ(c.policy.micro_batch * c.policy.accumulation * 4, 64);
  // No master weights or moments on the device.
  EXPECT_EQ(c.by_category[size_t(Category::kOptimizer)], 0u);
  EXPECT_EQ(c.by_category[size_t(Category::kMaster)], 0u);
  // The offload tier holds this rank's shard of master, m, v and the gradient copy: 16 bytes a
  // shard float, about 16 P / 4 = 24.8 GiB.
  const model::ParamTable table = model::gpt2_param_table(r.config);
  const ZeroSpec z = planned_zero_spec(table, c.policy, /*windows=*/true);
  ASSERT_GE(z.stage, 1);  // 16 P bytes on the host per device would be 99 GiB
  const int64_t S = z.stage == 3 ? z.shard_floats : ((table.total_floats + 3) / 4 + 15) / 16 * 16;
  EXPECT_EQ(c.offload_bytes, uint64_t(16 * S));
  EXPECT_EQ(int64_t(c.offload_bytes), zero_memory(z).offloaded);
  const double quarter = 16.0 * double(table.total_floats) / 4;
  EXPECT_NEAR(double(c.offload_bytes), quarter, 1e-3 * quarter);
  // Priced: the gradient shard out (4 bytes) and the weights back in the working dtype (bf16
  // where the device holds bf16 weights only), plus AdamW's pass on the host.
  const double back = c.policy.precision == "bf16" ? 2.0 : 4.0;
  EXPECT_DOUBLE_EQ(c.cost.offload_bytes, double(c.offload_bytes) / 16.0 * (4.0 + back));
  EXPECT_NEAR(c.cost.offload_seconds, c.cost.offload_bytes / (31.5e9 * 0.8), 1e-9);
  EXPECT_GT(c.cost.host_optimizer_seconds, 0);
  // On a GPU the gradients out, the host's AdamW and the weights back are pipelined
  // (OptimizerOffload's pieces): all but the longest of the three is hidden.
  const double back_seconds = c.cost.offload_seconds * back / (4.0 + back);
  const double out_seconds = c.cost.offload_seconds - back_seconds;
  EXPECT_GT(c.cost.optimizer_overlap_seconds, 0);
  EXPECT_NEAR(c.cost.optimizer_overlap_seconds,
              out_seconds + back_seconds + c.cost.host_optimizer_seconds -
                  std::max({out_seconds, back_seconds, c.cost.host_optimizer_seconds}),
              1e-12);
  EXPECT_NEAR(c.cost.step_seconds,
              c.cost.gemm_seconds + c.cost.memory_seconds + c.cost.comm_seconds +
                  c.cost.offload_seconds + c.cost.host_optimizer_seconds -
                  c.cost.optimizer_overlap_seconds,
              1e-9);
  ASSERT_TRUE(res->chosen_plan);
  EXPECT_EQ(res->chosen_plan->peak_bytes, c.peak_bytes);
  EXPECT_EQ(res->chosen_plan->offload_bytes, c.offload_bytes);

  // Without offload nothing fits, and the advice names it as built.
  r.offload_optimizer = false;
  Result<SearchResult> without = search_plan(r);
  ASSERT_TRUE(without.is_ok());
  EXPECT_FALSE(without->chosen);
  EXPECT_NE(without->advice.find("--offload-optimizer on"), std::string::npos) << without->advice;
  EXPECT_EQ(without->advice.find("not built"), std::string::npos) << without->advice;
}

TEST(OffloadPlan, OnOnlyWhereItFitsAndNoOffloadDoesNotOrIsFaster) {
  SearchRequest r;
  r.config = *model::preset_config("gpt2");
  r.seq = 256;
  r.global_batch = 8;
  r.precision = "fp32";
  // Memory to spare: offload only adds copies and a host pass: off.
  r.device = cpu_like(64 * kGiB);
  r.device_memory = 64 * kGiB;
  Result<SearchResult> roomy = search_plan(r);
  ASSERT_TRUE(roomy.is_ok() && roomy->chosen);
  EXPECT_FALSE(roomy->chosen->policy.offload_optimizer);
  // Forced on: the same techniques are slower by the copies and the host pass.
  SearchRequest forced = r;
  forced.offload_optimizer = true;
  Result<SearchResult> on = search_plan(forced);
  ASSERT_TRUE(on.is_ok() && on->chosen);
  EXPECT_TRUE(on->chosen->policy.offload_optimizer);
  EXPECT_LT(on->chosen->cost.tokens_per_s, roomy->chosen->cost.tokens_per_s);
  EXPECT_GT(on->chosen->offload_bytes, 0u);

  // Between the leanest plan with and without offload: only offload fits.
  SearchRequest lean = r;
  lean.micro_batch = 1;
  lean.global_batch = 1;
  lean.offload_optimizer = false;
  lean.recompute = model::Recompute::kFull;
  lean.fused_head = true;
  Result<SearchResult> base = search_plan(lean);
  lean.offload_optimizer = true;
  Result<SearchResult> base_on = search_plan(lean);
  ASSERT_TRUE(base.is_ok() && base->chosen && base_on.is_ok() && base_on->chosen);
  r.device_memory = (base->chosen->peak_bytes + base_on->chosen->peak_bytes) / 2;
  r.micro_batch = 1;
  r.global_batch = 1;
  Result<SearchResult> tight = search_plan(r);
  ASSERT_TRUE(tight.is_ok());
  ASSERT_TRUE(tight->chosen) << tight->advice;
  EXPECT_TRUE(tight->chosen->policy.offload_optimizer);
  EXPECT_LE(tight->chosen->peak_bytes, r.device_memory);

  // The offload tier has a budget of its own: too small, and nothing fits, saying which tier.
  r.offload_memory = tight->chosen->offload_bytes - 1;
  Result<SearchResult> starved = search_plan(r);
  ASSERT_TRUE(starved.is_ok());
  EXPECT_FALSE(starved->chosen);
  EXPECT_NE(starved->advice.find("--offload-memory"), std::string::npos) << starved->advice;
  bool named = false;
  for (const Candidate& c : starved->rejected) {
    named |= c.rejected_because.find("offload budget") != std::string::npos;
  }
  EXPECT_TRUE(named);
  r.offload_memory = tight->chosen->offload_bytes;
  Result<SearchResult> enough = search_plan(r);
  ASSERT_TRUE(enough.is_ok());
  EXPECT_TRUE(enough->chosen);
}

// auto is the faster of off and on (ties to off), whatever the budget: skipping the offload
// search where the plan without it is already the fastest of all loses nothing.
TEST(OffloadPlan, AutoIsTheFasterOfOffAndOn) {
  int with = 0, without = 0;
  for (double gib : {0.9, 1.2, 1.6, 2.5, 4.0, 16.0}) {
    SearchRequest r;
    r.config = *model::preset_config("gpt2");
    r.seq = 256;
    r.global_batch = 8;
    r.precision = "fp32";
    r.device = cpu_like(uint64_t(gib * double(kGiB)));
    r.device_memory = r.device.memory_bytes;
    SearchRequest off = r, on = r;
    off.offload_optimizer = false;
    on.offload_optimizer = true;
    Result<SearchResult> a = search_plan(r), f = search_plan(off), n = search_plan(on);
    ASSERT_TRUE(a.is_ok() && f.is_ok() && n.is_ok());
    const double fs = f->chosen ? f->chosen->cost.tokens_per_s : -1;
    const double ns = n->chosen ? n->chosen->cost.tokens_per_s : -1;
    SCOPED_TRACE(::testing::Message() << gib << " GiB: off " << fs << ", on " << ns);
    ASSERT_EQ(bool(a->chosen), fs > 0 || ns > 0);
    if (!a->chosen) continue;
    EXPECT_EQ(a->chosen->cost.tokens_per_s, std::max(fs, ns));
    EXPECT_EQ(a->chosen->policy.offload_optimizer, ns > fs);
    (a->chosen->policy.offload_optimizer ? with : without)++;
  }
  EXPECT_GT(with, 0);  // both regimes were seen
  EXPECT_GT(without, 0);
}

TEST(OffloadPlan, ExecutorLayoutMatchesTheTrainersPlan) {
  // With several ranks, the search's per-rank bytes with offload equal the trainer's plan.
  for (const char* precision : {"fp32", "bf16"}) {
    for (int z = 0; z <= 3; z++) {
      SearchRequest r;
      r.config = *model::preset_config("gpt2");
      r.device = cpu_like(64 * kGiB);
      r.device_memory = 64 * kGiB;
      r.devices = 2;
      r.seq = 256;
      r.global_batch = 8;
      r.precision = precision;
      r.executor_layout = true;  // each rank planned as the trainer allocates it
      r.zero_stage = z;
      r.micro_batch = 2;
      r.recompute = model::Recompute::kNone;
      r.fused_head = false;
      r.offload_optimizer = true;
      // Optimizer offload alone, and with every block's activations in the same tier.
      for (bool acts : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << precision << " stage " << z << (acts ? " with activation offload" : ""));
        r.offload_activations = acts;
        Result<SearchResult> res = search_plan(r);
        ASSERT_TRUE(res.is_ok() && res->chosen) << res.status().to_string();
        const Candidate& c = *res->chosen;
        ASSERT_TRUE(c.policy.offload_optimizer);
        EXPECT_EQ(offloaded_blocks(c.policy.exec), acts ? 12 : 0);
        Result<MemoryPlan> trainer = plan_training_memory(r.config, c.policy);
        ASSERT_TRUE(trainer.is_ok()) << trainer.status().to_string();
        EXPECT_EQ(c.peak_bytes, trainer->peak_bytes);
        EXPECT_EQ(c.by_category, trainer->by_category);
        // The trainer's regions are 64-byte aligned: within 3 x 64 bytes of 16 S.
        EXPECT_LE(c.offload_bytes, trainer->offload_bytes);
        EXPECT_LT(trainer->offload_bytes - c.offload_bytes, 4u * 64);
        EXPECT_EQ(c.offload_activation_bytes, offloaded_activation_bytes(*trainer));
        EXPECT_EQ(c.offload_activation_bytes > 0, acts);
      }
    }
  }
}

// Note [Optimizer offload], "Both kinds": one tier holds the optimizer state and the offloaded
// activations; its bytes are the sum of the two kinds', the device loses both, and the link
// time is the sum of both kinds' (neither hides the other).
TEST(OffloadPlan, BothKindsShareOneTierAndAddUp) {
  const model::Gpt2Config c = *model::preset_config("gpt2-tiny");
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    Policy p;
    p.micro_batch = 2;
    p.accumulation = 3;
    p.seq = 64;
    p.precision = precision;
    Result<MemoryPlan> none = plan_training_memory(c, p);
    p.offload_optimizer = true;
    Result<MemoryPlan> opt = plan_training_memory(c, p);
    p.offload_optimizer = false;
    p.exec.offload.assign(size_t(c.n_layer), true);
    p.exec.offload[1] = false;  // a mix: block 1 keeps its activations
    Result<MemoryPlan> act = plan_training_memory(c, p);
    p.offload_optimizer = true;
    Result<MemoryPlan> both = plan_training_memory(c, p);
    ASSERT_TRUE(none.is_ok() && opt.is_ok() && act.is_ok() && both.is_ok())
        << both.status().to_string();
    EXPECT_GT(offloaded_activation_bytes(*act), 0u);
    EXPECT_EQ(both->offload_bytes, opt->offload_bytes + act->offload_bytes);
    EXPECT_EQ(offloaded_activation_bytes(*both), act->offload_bytes);
    EXPECT_EQ(offloaded_optimizer_bytes(*both), opt->offload_bytes);
    // The device: what each kind frees, both together.
    EXPECT_EQ(none->peak_bytes - both->peak_bytes,
              (none->peak_bytes - opt->peak_bytes) + (none->peak_bytes - act->peak_bytes));
    EXPECT_EQ(both->step_bytes, act->step_bytes);
    // The tier's regions, by name: the optimizer's three, then the activations'.
    ASSERT_EQ(both->offload.size(), 4u);
    EXPECT_EQ(both->offload[0].name, kOffloadMasterRegion);
    EXPECT_EQ(both->offload[3].name, kOffloadedActivationsRegion);
    EXPECT_EQ(offload_region(*both, kOffloadedActivationsRegion)->layout.size, act->offload_bytes);
    EXPECT_NE(offload_parts(*both).find("optimizer state"), std::string::npos);
    EXPECT_NE(offload_parts(*both).find("offloaded activations"), std::string::npos);
    EXPECT_NE(category_table(*both, 0).find("optimizer state"), std::string::npos);
    EXPECT_NE(offload_table(*both, 0).find("adam_v"), std::string::npos);
    EXPECT_NE(offload_table(*both, 0).find(kOffloadedActivationsRegion), std::string::npos);
    // Moving the optimizer state of a plan that already offloads activations (what the search
    // does to the plans it has) gives the same plan.
    MemoryPlan moved = *act;
    offload_optimizer_state(&moved);
    EXPECT_EQ(moved.offload_bytes, both->offload_bytes);
    EXPECT_EQ(moved.peak_bytes, both->peak_bytes);
    EXPECT_EQ(moved.by_category, both->by_category);
    // Priced on one link: bytes and seconds of the two kinds add up.
    const DeviceSpec d = cpu_like(8 * kGiB);
    const StepCost co = estimate_step(c, *opt, d), ca = estimate_step(c, *act, d),
                   cb = estimate_step(c, *both, d);
    EXPECT_DOUBLE_EQ(cb.offload_bytes, co.offload_bytes + ca.offload_bytes);
    EXPECT_DOUBLE_EQ(cb.offload_seconds, co.offload_seconds + ca.offload_seconds);
    EXPECT_DOUBLE_EQ(cb.activation_offload_bytes, ca.offload_bytes);
    EXPECT_DOUBLE_EQ(cb.host_optimizer_seconds, co.host_optimizer_seconds);
    // The CPU backend copies after the update, on the same cores: nothing overlaps.
    EXPECT_EQ(co.optimizer_overlap_seconds, 0.0);
  }
}

// The search puts both kinds in the tier when only both fit: GPT-2 124M with its activations
// kept (--recompute none), a device budget between the plan with both and either alone.
TEST(OffloadPlan, TheSearchChoosesBothWhenOnlyBothFit) {
  SearchRequest r;
  r.config = *model::preset_config("gpt2");
  r.device.name = "test-gpu";
  r.device.kind = "gpu";
  r.device.flops_fp32 = 2e13;
  r.device.mem_bandwidth = 1e12;
  r.device.gemm_efficiency = 1;
  r.device.offload_bandwidth = 1e13;  // both kinds priced on this link
  r.seq = 256;
  r.global_batch = 8;
  r.micro_batch = 8;
  r.precision = "fp32";
  r.recompute = model::Recompute::kNone;
  r.fused_head = false;
  r.offload_memory = 64 * kGiB;
  Policy p{8, 1, 256, "fp32", {}};
  p.exec.tiled_attention = true;
  p.offload_optimizer = true;
  Result<MemoryPlan> opt = plan_training_memory(r.config, p);
  p.exec.offload.assign(12, true);
  Result<MemoryPlan> both = plan_training_memory(r.config, p);
  p.offload_optimizer = false;
  Result<MemoryPlan> act = plan_training_memory(r.config, p);
  ASSERT_TRUE(opt.is_ok() && both.is_ok() && act.is_ok());
  r.device_memory = both->peak_bytes + 16 * kMiB;
  ASSERT_GT(opt->peak_bytes, r.device_memory);
  ASSERT_GT(act->peak_bytes, r.device_memory);
  r.device.memory_bytes = r.device_memory;

  Result<SearchResult> res = search_plan(r);
  ASSERT_TRUE(res.is_ok()) << res.status().to_string();
  ASSERT_TRUE(res->chosen) << res->advice;
  const Candidate& c = *res->chosen;
  EXPECT_TRUE(c.policy.offload_optimizer);
  EXPECT_EQ(offloaded_blocks(c.policy.exec), 12);
  EXPECT_EQ(c.peak_bytes, both->peak_bytes);
  EXPECT_EQ(c.offload_bytes, both->offload_bytes);
  EXPECT_EQ(c.offload_activation_bytes, act->offload_bytes);
  EXPECT_DOUBLE_EQ(c.cost.offload_bytes, estimate_step(r.config, *both, r.device).offload_bytes);
  EXPECT_GT(c.cost.activation_offload_bytes, 0.0);
  EXPECT_LT(c.cost.activation_offload_bytes, c.cost.offload_bytes);
  ASSERT_TRUE(res->chosen_plan);
  EXPECT_EQ(res->chosen_plan->offload_bytes, c.offload_bytes);
  EXPECT_EQ(res->chosen_plan->offload.size(), 4u);

  // Either kind alone: nothing fits.
  for (int alone = 0; alone < 2; alone++) {
    SearchRequest one = r;
    (alone == 0 ? one.offload_activations : one.offload_optimizer) = false;
    Result<SearchResult> s = search_plan(one);
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    EXPECT_FALSE(s->chosen) << (alone == 0 ? "optimizer offload alone" : "activations alone");
  }
  // The tier's one budget counts both kinds: room for the optimizer state but not for the
  // activations on top, and nothing fits; the rejection names both parts.
  // (--offload-activations on: the leanest plan offloads them, so the tier is what refuses.)
  r.offload_memory = opt->offload_bytes + act->offload_bytes / 2;
  r.offload_activations = true;
  Result<SearchResult> small = search_plan(r);
  ASSERT_TRUE(small.is_ok());
  EXPECT_FALSE(small->chosen);
  bool named = false;
  for (const Candidate& rej : small->rejected) {
    named |= rej.rejected_because.find("optimizer state") != std::string::npos &&
             rej.rejected_because.find("offloaded activations") != std::string::npos &&
             rej.rejected_because.find("--offload-memory") != std::string::npos;
  }
  EXPECT_TRUE(named);
}

TEST(OffloadPlan, ExplicitOffloadNeedsAHostLink) {
  SearchRequest r;
  r.config = *model::preset_config("gpt2-tiny");
  r.device = cpu_like(8 * kGiB);
  r.device.host_link_bandwidth = 0;
  r.device_memory = 8 * kGiB;
  r.seq = 64;
  r.global_batch = 2;
  Result<SearchResult> any = search_plan(r);  // auto: offload is not searched
  ASSERT_TRUE(any.is_ok() && any->chosen);
  EXPECT_FALSE(any->chosen->policy.offload_optimizer);
  r.offload_optimizer = true;
  Result<SearchResult> on = search_plan(r);
  EXPECT_FALSE(on.is_ok());
  EXPECT_NE(on.status().message().find("host link"), std::string::npos);
}

}  // namespace
}  // namespace headroom::plan
