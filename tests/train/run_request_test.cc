// train::resolve_run, the library call behind `headroom train`'s flags: a plan file's choices
// become the options and contradictions are refused by flag name; defaults fill what is unset.
#include "train/run_request.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "plan/calibrate.h"
#include "plan/cost_model.h"
#include "plan/cost_terms.h"
#include "train_test_util.h"

namespace headroom::train {
namespace {

std::string write_plan(const std::filesystem::path& dir, int micro_batch, int accumulation,
                       int seq) {
  const std::string path = (dir / "plan.json").string();
  std::ofstream(path) << "{\"chosen\": {\"micro_batch\": " << micro_batch
                      << ", \"accumulation\": " << accumulation << ", \"seq\": " << seq
                      << ", \"precision\": \"fp32\"}}";
  return path;
}

TEST(RunRequest, PlanFileChoicesBecomeTheOptions) {
  const auto dir = test::fresh_test_dir("run_request");
  RunRequest r;
  r.model = "gpt2-tiny";
  r.data = (dir / "unused.tokens").string();  // resolve_run does not open it
  r.plan_file = write_plan(dir, 2, 3, 32);
  r.device_memory = uint64_t(1) << 30;
  r.steps = 7;
  r.quiet = true;
  Result<ResolvedRun> run = resolve_run(r);
  ASSERT_TRUE(run.is_ok()) << run.status().message();
  const TrainOptions& o = run->options;
  EXPECT_EQ(o.micro_batch, 2);
  EXPECT_EQ(o.accumulation, 3);
  EXPECT_EQ(o.seq, 32);
  EXPECT_EQ(o.steps, 7);
  EXPECT_EQ(o.device_memory, uint64_t(1) << 30);
  EXPECT_EQ(o.data, r.data);
  EXPECT_EQ(o.warmup_steps, 1);                   // unset: 10% of the steps, at least 1
  EXPECT_FLOAT_EQ(o.adamw.lr, 1e-3f);             // unset: below 50M parameters
  EXPECT_EQ(o.plan_note, "from " + r.plan_file);  // not searched here
  EXPECT_FALSE(run->search.has_value());
  EXPECT_EQ(run->model, "gpt2-tiny");
}

// The first run's model (docs/notes/first-run.md): bytes-tiny with the byte tokenizer and its own
// steps, learning rate and batch, each only where the request leaves it unset.
TEST(RunRequest, TheDefaultModelReadsBytesWithItsOwnDefaults) {
  const auto dir = test::fresh_test_dir("run_request");
  RunRequest r;
  r.data = (dir / "unused.tokens").string();
  r.device_memory = uint64_t(1) << 30;
  r.quiet = true;
  Result<ResolvedRun> run = resolve_run(r);
  ASSERT_TRUE(run.is_ok()) << run.status().message();
  EXPECT_EQ(run->model, "bytes-tiny");
  EXPECT_EQ(run->tokenizer, "bytes");
  EXPECT_EQ(run->options.config.vocab_size, 257);
  EXPECT_EQ(run->options.steps, 3000);
  EXPECT_EQ(run->options.minutes, 3.0);  // bounded in time too: the first run ends in minutes
  EXPECT_EQ(run->options.warmup_steps, 100);
  EXPECT_FLOAT_EQ(run->options.adamw.lr, 3e-3f);
  EXPECT_EQ(run->options.micro_batch * run->options.accumulation, 16);
  // --minutes alone: the budget sets the count (no cap but a large one), warmup 100.
  r.minutes = 0.5;
  run = resolve_run(r);
  ASSERT_TRUE(run.is_ok()) << run.status().message();
  EXPECT_EQ(run->options.minutes, 0.5);
  EXPECT_GT(run->options.steps, 1'000'000);
  EXPECT_EQ(run->options.warmup_steps, 100);
  // --minutes with a few --steps: they cap it, and the warmup still outlasts the 4 timed steps.
  r.steps = 20;
  run = resolve_run(r);
  ASSERT_TRUE(run.is_ok()) << run.status().message();
  EXPECT_EQ(run->options.steps, 20);
  EXPECT_EQ(run->options.warmup_steps, 4);
  r.minutes = 0;
  // Flags win over the preset's defaults (--steps drops its time budget); another preset keeps
  // the general ones.
  r.steps = 9;
  r.lr = 5e-4f;
  r.global_batch = 4;
  run = resolve_run(r);
  ASSERT_TRUE(run.is_ok()) << run.status().message();
  EXPECT_EQ(run->options.steps, 9);
  EXPECT_EQ(run->options.minutes, 0.0);
  EXPECT_FLOAT_EQ(run->options.adamw.lr, 5e-4f);
  EXPECT_EQ(run->options.micro_batch * run->options.accumulation, 4);
  RunRequest g;
  g.model = "gpt2-tiny";
  g.data = r.data;
  g.device_memory = r.device_memory;
  g.quiet = true;
  run = resolve_run(g);
  ASSERT_TRUE(run.is_ok()) << run.status().message();
  EXPECT_EQ(run->options.steps, 200);
  EXPECT_FLOAT_EQ(run->options.adamw.lr, 1e-3f);
  EXPECT_EQ(run->tokenizer, "");
}

TEST(RunRequest, ContradictionsAndBadValuesNameTheFlag) {
  const auto dir = test::fresh_test_dir("run_request");
  RunRequest r;
  r.data = (dir / "unused.tokens").string();
  r.plan_file = write_plan(dir, 2, 3, 32);
  r.device_memory = uint64_t(1) << 30;
  r.quiet = true;
  r.seq = 64;
  Result<ResolvedRun> run = resolve_run(r);
  ASSERT_FALSE(run.is_ok());
  EXPECT_EQ(run.status().message(), "--seq 64 contradicts the plan's seq 32 in " + r.plan_file);
  r.seq.reset();
  r.lr = -1.0f;
  run = resolve_run(r);
  ASSERT_FALSE(run.is_ok());
  EXPECT_EQ(run.status().message(), "--lr -1 must be positive");
  r.lr.reset();
  r.zero = "4";
  run = resolve_run(r);
  ASSERT_FALSE(run.is_ok());
  EXPECT_EQ(run.status().message(), "--zero 4: use auto, 0, 1, 2 or 3");
  r.zero = "auto";
  r.plan_file = (dir / "missing.json").string();
  run = resolve_run(r);
  ASSERT_FALSE(run.is_ok());
  EXPECT_EQ(run.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(run.status().message(), "cannot open --plan '" + r.plan_file + "'");
}

// Note [Self-correction]: the corrections earlier runs measured on this machine price the search
// (each precision its own), so that a precision measured slow loses the choice; --no-self-correct
// plans without them. The cache is this test's (HEADROOM_CACHE_DIR), with this machine's
// calibration copied in.
TEST(RunRequest, StoredCorrectionsPriceTheSearch) {
  const auto dir = test::fresh_test_dir("run_request");
  Result<plan::DeviceSpec> dev = cpu_device(uint64_t(1) << 30, true);  // calibrated once
  ASSERT_TRUE(dev.is_ok()) << dev.status().message();
  if (!dev->terms.fitted || !(dev->flops_bf16 > 0)) {
    GTEST_SKIP() << "needs this machine's measured terms and bf16 GEMMs";
  }
  const std::string calibration = plan::default_calibration_path();
  const char* old = std::getenv("HEADROOM_CACHE_DIR");
  const std::string restore = old ? old : "";
  std::filesystem::copy_file(calibration, dir / "calibration.json");
  setenv("HEADROOM_CACHE_DIR", dir.c_str(), 1);
  RunRequest r;
  r.model = "gpt2-tiny";
  r.data = (dir / "unused.tokens").string();
  r.device_memory = uint64_t(1) << 30;
  r.quiet = true;
  Result<ResolvedRun> plain = resolve_run(r);
  ASSERT_TRUE(plain.is_ok()) << plain.status().message();
  const std::string first =
      plain->options.exec.precision == model::Precision::kBf16 ? "bf16" : "fp32";
  EXPECT_EQ(plain->options.plan_note.find("cost model"), std::string::npos);
  // The chosen precision measured 20x slower than its terms say in every kind.
  plan::CostCorrection slow;
  slow.steps = 2;
  slow.scale.fill(20);
  const std::string machine =
      plan::correction_machine_key(plan::current_cpu_model(), plan::calibration_threads());
  const std::string cache = plan::corrections_path(plan::default_calibration_path());
  ASSERT_TRUE(plan::save_correction(cache, machine,
                                    plan::correction_model_key(plain->options.config, first), slow)
                  .is_ok());
  Result<ResolvedRun> corrected = resolve_run(r);
  ASSERT_TRUE(corrected.is_ok()) << corrected.status().message();
  const std::string second =
      corrected->options.exec.precision == model::Precision::kBf16 ? "bf16" : "fp32";
  EXPECT_NE(second, first);
  EXPECT_NE(corrected->options.plan_note.find("corrections earlier runs measured"),
            std::string::npos)
      << corrected->options.plan_note;
  EXPECT_NE(corrected->options.plan_note.find(first + " (2 steps)"), std::string::npos);
  // Without self-correction: the uncorrected choice.
  r.self_correct = false;
  Result<ResolvedRun> off = resolve_run(r);
  ASSERT_TRUE(off.is_ok());
  EXPECT_EQ(off->options.exec.precision, plain->options.exec.precision);
  // A damaged cache is a note, never an error.
  r.self_correct = true;
  std::ofstream(cache) << "{\"" << machine << "\": {\""
                       << "gpt2-L2"
                       << "\": 3";
  Result<ResolvedRun> damaged = resolve_run(r);
  ASSERT_TRUE(damaged.is_ok()) << damaged.status().message();
  EXPECT_EQ(damaged->options.exec.precision, plain->options.exec.precision);
  EXPECT_NE(damaged->options.plan_note.find("-- not used"), std::string::npos)
      << damaged->options.plan_note;
  if (old) {
    setenv("HEADROOM_CACHE_DIR", restore.c_str(), 1);
  } else {
    unsetenv("HEADROOM_CACHE_DIR");
  }
}

}  // namespace
}  // namespace headroom::train
