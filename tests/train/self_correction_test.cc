// Self-correction of the cost model in a training run (Note [Self-correction] in
// docs/notes/cost-model.md): after the first steps the run's prediction is its measured time per
// kind, the correction is kept for the next run, which starts from it, and every step reports
// what was predicted. Nothing here asserts a time: only that the machinery did what it says.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "plan/cost_model.h"
#include "plan/cost_terms.h"
#include "train_test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

// Terms of the right order (not measurements): a device the cost model prices kind by kind.
plan::DeviceSpec measured_cpu() {
  plan::DeviceSpec d;
  d.name = d.kind = "cpu";
  d.flops_fp32 = 50e9;
  d.mem_bandwidth = 7e9;
  d.host_link_bandwidth = d.host_memory_bandwidth = 5e9;
  d.source = "synthetic terms";
  plan::CostTerms& t = d.terms;
  t.fitted = true;
  for (size_t p = 0; p < 2; p++) {
    t.gemm_small[p] = {20e9, 500};
    t.gemm_large[p] = {50e9, 200};
    t.gemm_head_small[p] = {40e9, 100};
    t.gemm_head[p] = {45e9, 100};
    t.attention[p] = {1e-5, 1.0 / 30e9};
  }
  t.norm = t.gelu = t.residual = t.loss = t.embedding = {5e-6, 1e-9};
  t.optimizer = {{{1e-4, 4e-9}, {1e-4, 5e-9}}};
  return d;
}

class SelfCorrection : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = train::test::fresh_test_dir("headroom_self_correction");
    data_ = (dir_ / "data.tok").string();
    train::test::write_random_tokens(data_, 3, 20000);
  }
  void TearDown() override { fs::remove_all(dir_); }

  train::TrainOptions options() const {
    train::TrainOptions o;
    o.config = train::test::tiny_config();
    o.model_name = "tiny";
    o.data = data_;
    o.seq = 32;
    o.micro_batch = 4;
    o.accumulation = 1;
    o.steps = 5;
    o.warmup_steps = 1;
    o.val_fraction = 0.05;
    o.device_memory = uint64_t(1) << 30;
    o.device = measured_cpu();
    o.self_correct.enabled = true;
    o.self_correct.cache_path = (dir_ / "corrections.json").string();
    o.self_correct.machine_key = plan::correction_machine_key("test cpu", 2);
    return o;
  }

  fs::path dir_;
  std::string data_;
};

bool has_event(const train::StepStats& s, const std::string& text) {
  for (const std::string& e : s.events) {
    if (e.find(text) != std::string::npos) return true;
  }
  return false;
}

TEST_F(SelfCorrection, CorrectsAfterTheMeasuredStepsAndKeepsItForTheNextRun) {
  const train::TrainOptions o = options();
  train::test::RunOutput a = train::test::run_collecting(o);
  ASSERT_TRUE(a.result.is_ok()) << a.result.status().to_string();
  ASSERT_EQ(a.steps.size(), 5u);
  // Step 1 is skipped, steps 2-3 measured: the correction comes with step 3.
  EXPECT_FALSE(has_event(a.steps[1], "cost model corrected"));
  EXPECT_TRUE(has_event(a.steps[2], "cost model corrected from 2 measured steps"));
  for (const train::StepStats& s : a.steps) EXPECT_GT(s.predicted_step_ms, 0);
  // Before the correction the synthetic terms' prediction; from step 3 on the corrected one,
  // which is the measured steps' mean (the same plan: each kind as measured, the rest per token).
  EXPECT_EQ(a.steps[0].predicted_step_ms, a.steps[1].predicted_step_ms);
  EXPECT_NE(a.steps[2].predicted_step_ms, a.steps[1].predicted_step_ms);
  const double mean = (a.steps[1].step_ms + a.steps[2].step_ms) / 2;

  // Kept for this machine and model; the next run starts from it (and reports so).
  Result<plan::CostCorrection> kept =
      plan::load_correction(o.self_correct.cache_path, o.self_correct.machine_key,
                            plan::correction_model_key(o.config, "fp32"));
  ASSERT_TRUE(kept.is_ok()) << kept.status().to_string();
  EXPECT_EQ(kept->steps, 2);
  // The corrected prediction is the measured mean when no kind's scale is clamped. A kind
  // measured in microseconds on a loaded host (ctest -j2, other builds) can fall below 1/20 of its
  // price: its scale stops at the clamp and the prediction stays above the measurement (seen: 1.36
  // ms predicted for 1.04 measured, and 0.46 ms over a 0.87 ms mean). So the timing is checked
  // only when nothing was clamped; the test is about the mechanism, not the host's timing.
  const bool clamped = std::any_of(kept->scale.begin(), kept->scale.end(),
                                   [](double s) { return s <= 0.05 || s >= 20.0; });
  if (!clamped) {
    EXPECT_NEAR(a.steps[2].predicted_step_ms, mean, 0.5 * mean);
  }
  train::test::RunOutput b = train::test::run_collecting(o);
  ASSERT_TRUE(b.result.is_ok()) << b.result.status().to_string();
  EXPECT_TRUE(has_event(b.steps[0], "measured by an earlier run on this machine"));
  EXPECT_NEAR(b.steps[0].predicted_step_ms, a.steps[2].predicted_step_ms,
              1e-6 * a.steps[2].predicted_step_ms);

  // Another thread count is another machine: nothing to start from.
  train::TrainOptions other = o;
  other.self_correct.machine_key = plan::correction_machine_key("test cpu", 1);
  other.steps = 1;
  train::test::RunOutput c = train::test::run_collecting(other);
  ASSERT_TRUE(c.result.is_ok());
  EXPECT_FALSE(has_event(c.steps[0], "earlier run"));
  EXPECT_EQ(c.steps[0].predicted_step_ms, a.steps[0].predicted_step_ms);
}

TEST_F(SelfCorrection, OffLeavesThePredictionAlone) {
  train::TrainOptions o = options();
  o.self_correct.enabled = false;
  train::test::RunOutput a = train::test::run_collecting(o);
  ASSERT_TRUE(a.result.is_ok());
  for (const train::StepStats& s : a.steps) {
    EXPECT_EQ(s.predicted_step_ms, a.steps[0].predicted_step_ms);
    EXPECT_FALSE(has_event(s, "cost model"));
  }
  EXPECT_FALSE(fs::exists(o.self_correct.cache_path));
}

}  // namespace
}  // namespace headroom
