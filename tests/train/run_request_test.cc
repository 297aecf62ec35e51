// train::resolve_run, the library call behind `headroom train`'s flags: a plan file's choices
// become the options and contradictions are refused by flag name; defaults fill what is unset.
#include "train/run_request.h"

#include <gtest/gtest.h>

#include <fstream>

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

}  // namespace
}  // namespace headroom::train
