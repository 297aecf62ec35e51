// `train --minutes`: the step count that fits a time budget (train/time_budget.h), and a run that
// fixes it equal, bit for bit, to a run given that count with --steps; across a resume too.
#include <gtest/gtest.h>

#include <filesystem>

#include "train/time_budget.h"
#include "train_test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using train::steps_within;
using train::TimeBudget;

TimeBudget budget(double budget_s, double elapsed_s, int done, double step_s, double eval_s,
                  int eval_every, int max_steps) {
  return {budget_s, elapsed_s, done, step_s, eval_s, eval_every, max_steps};
}

TEST(TimeBudget, StepsAndTheFinalValidationFillTheRest) {
  // 60 s, 4 s spent, 1/8 s a step, a final validation of 1 s: 440 more steps (55 s + 1 s).
  EXPECT_EQ(steps_within(budget(60, 4, 4, 0.125, 1.0, 0, 1'000'000)), 444);
  // Every 100th step validates too: 56 s hold k = 408 (51 s, and validations at steps 100, 200,
  // 300, 400 and the last, 412).
  EXPECT_EQ(steps_within(budget(60, 4, 4, 0.125, 1.0, 100, 1'000'000)), 412);
}

TEST(TimeBudget, CappedBySteps) {
  EXPECT_EQ(steps_within(budget(60, 4, 4, 0.125, 1.0, 0, 300)), 300);
}

TEST(TimeBudget, SpentBudgetStillTakesOneMoreStep) {
  // The decision comes after a step; the run then takes at least one more (which validates).
  EXPECT_EQ(steps_within(budget(1, 5, 4, 0.1, 1.0, 0, 1000)), 5);
  EXPECT_EQ(steps_within(budget(1, 5, 4, 0.1, 1.0, 0, 5)), 5);
  EXPECT_EQ(steps_within(budget(1, 5, 4, 0.1, 1.0, 0, 4)), 4);
}

TEST(TimeBudget, LargestCountThatFits) {
  // Exhaustively against the definition over small cases.
  for (int every : {0, 3, 7}) {
    for (double rest : {0.5, 2.0, 7.3}) {
      const TimeBudget b = budget(10 + rest, 10, 6, 0.25, 0.6, every, 200);
      const int n = steps_within(b);
      auto cost = [&](int last) {
        int evals = 0;
        for (int s = 7; s <= last; s++) evals += (every > 0 && s % every == 0) || s == last;
        return (last - 6) * 0.25 + evals * 0.6;
      };
      if (n > 7) {
        EXPECT_LE(cost(n), rest) << every << " " << rest;
      }
      EXPECT_GT(cost(n + 1), rest) << every << " " << rest;
    }
  }
}

class Minutes : public train::test::RandomTokensTest {
 protected:
  train::TrainOptions options() {
    train::TrainOptions o;
    o.config = train::test::tiny_config();
    o.model_name = "tiny";
    o.data = data_;
    o.seq = 16;
    o.micro_batch = 2;
    o.accumulation = 2;
    o.warmup_steps = 5;
    o.device_memory = uint64_t(1) << 30;
    o.val_fraction = 0.1;
    o.eval_every = 10;
    return o;
  }
};

// 0.5 minutes at an assumed second a step, a validation also a second: after the warmup's 5 steps,
// 25 s left hold 22 more steps, the validations of steps 10 and 20 and that of the last: 27.
TEST_F(Minutes, FixesTheCountAndEqualsThatManySteps) {
  train::TrainOptions o = options();
  o.steps = 1000;
  o.minutes = 0.5;
  o.minutes_assume_step_s = 1.0;
  train::test::RunOutput timed = train::test::run_collecting(o);
  ASSERT_TRUE(timed.result.is_ok()) << timed.result.status().to_string();
  EXPECT_EQ(timed.result->total_steps, 27);
  ASSERT_EQ(int(timed.steps.size()), timed.result->total_steps);
  EXPECT_EQ(timed.steps.back().steps, timed.result->total_steps);
  // Estimated after step 4 (for the progress line), fixed after step 5, the warmup's last.
  bool estimated = false, fixed = false;
  for (const std::string& e : timed.steps[3].events)
    estimated |= e.find("about 27 steps") != e.npos;
  for (const std::string& e : timed.steps[4].events) fixed |= e.find(": 27 steps") != e.npos;
  EXPECT_TRUE(estimated && fixed);
  EXPECT_EQ(timed.steps[3].steps, 27);

  train::TrainOptions p = options();
  p.steps = timed.result->total_steps;
  train::test::RunOutput plain = train::test::run_collecting(p);
  ASSERT_TRUE(plain.result.is_ok()) << plain.result.status().to_string();
  ASSERT_EQ(plain.steps.size(), timed.steps.size());
  for (size_t i = 0; i < plain.steps.size(); i++) {
    EXPECT_EQ(plain.steps[i].loss, timed.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(plain.steps[i].lr, timed.steps[i].lr) << "step " << i + 1;
  }
  EXPECT_EQ(plain.params, timed.params);
}

TEST_F(Minutes, CappedByStepsAndRefusedWithoutAWarmup) {
  train::TrainOptions o = options();
  o.steps = 12;
  o.minutes = 10;
  o.minutes_assume_step_s = 1.0;
  train::test::RunOutput r = train::test::run_collecting(o);
  ASSERT_TRUE(r.result.is_ok()) << r.result.status().to_string();
  EXPECT_EQ(r.result->total_steps, 12);

  o.warmup_steps = 2;
  r = train::test::run_collecting(o);
  ASSERT_FALSE(r.result.is_ok());
  EXPECT_NE(r.result.status().message().find("--warmup 4 or more"), std::string::npos)
      << r.result.status().message();
  o.warmup_steps = 5;
  o.minutes = -1;
  r = train::test::run_collecting(o);
  ASSERT_FALSE(r.result.is_ok());
  EXPECT_NE(r.result.status().message().find("--minutes -1"), std::string::npos);
}

// The count is kept in the checkpoint: a run stopped after step 8 and resumed (with --minutes,
// at another assumed speed, which must not matter any more) ends where the whole run ends.
TEST_F(Minutes, ResumeKeepsTheChosenCount) {
  train::TrainOptions o = options();
  o.steps = 1000;
  o.minutes = 0.5;
  o.minutes_assume_step_s = 1.0;
  o.save_every = 4;
  o.out_dir = (dir_ / "whole").string();
  train::test::RunOutput whole = train::test::run_collecting(o);
  ASSERT_TRUE(whole.result.is_ok()) << whole.result.status().to_string();

  o.out_dir = (dir_ / "parts").string();
  train::test::RunOutput first = train::test::run_collecting(
      o, nullptr, [](const train::StepStats& s) { return s.step == 8; });
  ASSERT_TRUE(first.result.is_ok()) << first.result.status().to_string();
  o.resume = o.out_dir;
  o.minutes_assume_step_s = 0.01;
  train::test::RunOutput rest = train::test::run_collecting(o);
  ASSERT_TRUE(rest.result.is_ok()) << rest.result.status().to_string();
  EXPECT_EQ(rest.result->total_steps, whole.result->total_steps);
  EXPECT_EQ(rest.params, whole.params);
}

}  // namespace
}  // namespace headroom
