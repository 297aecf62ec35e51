// Checkpoints resume exactly: 20 steps straight and 10 + resume + 10 give bit-identical weights
// and the same logged losses; a corrupt checkpoint is refused with the file named; only the
// newest K are kept and no temporary directory is left behind.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "train_test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using train::test::tiny_config;

class Checkpoints : public train::test::RandomTokensTest {
 protected:
  train::TrainOptions options(const std::string& out) {
    train::TrainOptions o;
    o.config = tiny_config();
    o.model_name = "tiny";
    o.data = data_;
    o.seq = 16;
    o.micro_batch = 2;
    o.accumulation = 2;
    o.steps = 20;
    o.warmup_steps = 3;
    o.device_memory = uint64_t(1) << 30;
    o.eval_every = 0;
    o.out_dir = (dir_ / out).string();
    return o;
  }
  // Runs `o`; collects the losses and the final parameters; stops after `stop_after` steps.
  Result<train::TrainResult> run(const train::TrainOptions& o, std::vector<double>* losses,
                                 std::vector<float>* params, int stop_after = 0) {
    std::function<bool(const train::StepStats&)> stop;
    if (stop_after) stop = [=](const train::StepStats& s) { return s.step == stop_after; };
    train::test::RunOutput r = train::test::run_collecting(o, nullptr, stop);
    for (const train::StepStats& s : r.steps) losses->push_back(s.loss);
    if (!r.params.empty()) *params = std::move(r.params);
    return std::move(r.result);
  }
};

// The micro-batch only says how a step is cut (principle 2): a checkpoint of 2 x 2 continues at
// 4 x 1 with the same data per step, equal within rounding (the accumulation test's tolerances).
TEST_F(Checkpoints, ResumeAtAnotherMicroBatchOfTheSameGlobalBatch) {
  std::vector<double> straight_losses, first, second;
  std::vector<float> straight, resumed, unused;
  train::TrainOptions o = options("straight");
  o.steps = 6;
  ASSERT_TRUE(run(o, &straight_losses, &straight).is_ok());
  train::TrainOptions a = options("cut");
  a.steps = 6;
  a.save_every = 3;
  ASSERT_TRUE(run(a, &first, &unused, 3).is_ok());
  train::TrainOptions b = options("continued");
  b.steps = 6;
  b.micro_batch = 4;
  b.accumulation = 1;
  b.resume = (dir_ / "cut/checkpoints/step-000003").string();
  ASSERT_TRUE(run(b, &second, &resumed).is_ok());
  ASSERT_EQ(second.size(), 3u);
  for (size_t i = 0; i < 3; i++)
    EXPECT_NEAR(second[i], straight_losses[i + 3], 1e-5 * straight_losses[i + 3]);
  ASSERT_EQ(resumed.size(), straight.size());
  double worst = 0;
  for (size_t i = 0; i < resumed.size(); i++)
    worst = std::max(worst, double(std::fabs(resumed[i] - straight[i])));
  EXPECT_LE(worst, 1e-4);
}

TEST_F(Checkpoints, ResumeIsBitIdentical) {
  std::vector<double> straight_losses, first, second;
  std::vector<float> straight, resumed, unused;
  ASSERT_TRUE(run(options("straight"), &straight_losses, &straight).is_ok());

  train::TrainOptions a = options("interrupted");
  a.save_every = 10;
  Result<train::TrainResult> r1 = run(a, &first, &unused, /*stop_after=*/10);
  ASSERT_TRUE(r1.is_ok()) << r1.status().to_string();
  EXPECT_TRUE(r1->stopped);
  ASSERT_TRUE(fs::exists(dir_ / "interrupted/checkpoints/step-000010/trainer_state.json"));

  train::TrainOptions b = options("interrupted");
  b.save_every = 10;
  b.resume = (dir_ / "interrupted").string();  // the run's directory: its newest checkpoint
  Result<train::TrainResult> r2 = run(b, &second, &resumed);
  ASSERT_TRUE(r2.is_ok()) << r2.status().to_string();

  ASSERT_EQ(straight_losses.size(), 20u);
  ASSERT_EQ(first.size(), 10u);
  ASSERT_EQ(second.size(), 10u);
  for (size_t i = 0; i < 10; i++) {
    EXPECT_EQ(first[i], straight_losses[i]) << i;
    EXPECT_EQ(second[i], straight_losses[10 + i]) << 10 + i;
  }
  ASSERT_EQ(resumed.size(), straight.size());
  EXPECT_EQ(0, std::memcmp(resumed.data(), straight.data(), straight.size() * sizeof(float)));
}

// A checkpoint written before the shuffle (no "data_order" in trainer_state.json: its
// data_position is a token index) continues in file order, as it started; and a shuffled one
// continues with its own seed's order whatever --seed the resume gives. Both bit for bit.
TEST_F(Checkpoints, ResumeKeepsTheCheckpointsDataOrder) {
  for (const bool old_checkpoint : {true, false}) {
    SCOPED_TRACE(old_checkpoint ? "checkpoint from before the shuffle" : "shuffled, other seed");
    const std::string tag = old_checkpoint ? "old" : "seed";
    std::vector<double> straight_losses, first, second;
    std::vector<float> straight, resumed, unused;
    train::TrainOptions o = options("straight-" + tag);
    o.steps = 6;
    o.shuffle = !old_checkpoint;
    ASSERT_TRUE(run(o, &straight_losses, &straight).is_ok());
    train::TrainOptions a = options("cut-" + tag);
    a.steps = 6;
    a.save_every = 3;
    a.shuffle = !old_checkpoint;
    ASSERT_TRUE(run(a, &first, &unused, 3).is_ok());
    const fs::path state = dir_ / ("cut-" + tag) / "checkpoints/step-000003/trainer_state.json";
    std::ifstream in(state);
    nlohmann::json j = nlohmann::json::parse(in);
    in.close();
    EXPECT_EQ(j["data_order"], old_checkpoint ? "sequential" : "shuffled");
    if (old_checkpoint) {
      j.erase("data_order");
      std::ofstream(state) << j.dump();
    }
    train::TrainOptions b = options("continued-" + tag);
    b.steps = 6;
    b.resume = state.parent_path().string();
    if (!old_checkpoint) b.seed = 99;  // init does not matter on resume; the order must not move
    ASSERT_TRUE(run(b, &second, &resumed).is_ok());
    ASSERT_EQ(second.size(), 3u);
    for (size_t i = 0; i < 3; i++) EXPECT_EQ(second[i], straight_losses[i + 3]) << i;
    ASSERT_EQ(resumed.size(), straight.size());
    EXPECT_EQ(0, std::memcmp(resumed.data(), straight.data(), straight.size() * sizeof(float)));
  }
}

TEST_F(Checkpoints, KeepsTheNewestAndLeavesNoTemporaries) {
  train::TrainOptions o = options("run");
  o.steps = 9;
  o.save_every = 2;
  o.keep_checkpoints = 2;
  std::vector<double> l;
  std::vector<float> p;
  ASSERT_TRUE(run(o, &l, &p).is_ok());
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_ / "run/checkpoints")) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step-000008", "step-000009"}));
}

TEST_F(Checkpoints, CorruptOrMismatchedCheckpointsAreRefused) {
  train::TrainOptions o = options("run");
  o.steps = 4;
  o.save_every = 2;
  o.keep_checkpoints = 0;
  std::vector<double> l;
  std::vector<float> p;
  ASSERT_TRUE(run(o, &l, &p).is_ok());
  const fs::path ck = dir_ / "run/checkpoints/step-000002";

  train::TrainOptions r = options("run");
  r.steps = 8;
  r.resume = ck.string();
  // Another global batch would train on other data per step: refused, and the flag named.
  r.micro_batch = 4;
  r.accumulation = 2;
  Result<train::TrainResult> shape = run(r, &l, &p);
  ASSERT_FALSE(shape.is_ok());
  EXPECT_NE(shape.status().message().find("--global-batch 4"), std::string::npos)
      << shape.status().message();

  // A truncated optimizer file: the error names it.
  r.micro_batch = 2;
  r.accumulation = 2;
  fs::resize_file(ck / "optimizer.safetensors", fs::file_size(ck / "optimizer.safetensors") / 2);
  Result<train::TrainResult> cut = run(r, &l, &p);
  ASSERT_FALSE(cut.is_ok());
  EXPECT_NE(cut.status().message().find("optimizer.safetensors"), std::string::npos)
      << cut.status().message();
  // The newer checkpoint is untouched and still resumes.
  r.resume = (dir_ / "run/checkpoints/step-000004").string();
  EXPECT_TRUE(run(r, &l, &p).is_ok());

  // Already at the end: nothing to do, said plainly.
  r.steps = 4;
  Result<train::TrainResult> done = run(r, &l, &p);
  ASSERT_FALSE(done.is_ok());
  EXPECT_NE(done.status().message().find("raise --steps"), std::string::npos);
}

}  // namespace
}  // namespace headroom
