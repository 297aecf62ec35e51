// What the trainer's tests share (tests/train/{checkpoint,elastic,step_events}_test.cc,
// tests/dist/trainer_dp_test.cc): the tiny model, a fresh directory per test with a random token
// file, and a training run that collects every step's stats and the final weights.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "data/token_file.h"
#include "model/gpt2.h"
#include "train/trainer.h"

namespace headroom::train::test {

// 2 layers, 64 wide, 4 heads, a 211-token vocabulary, 32 positions: a step takes milliseconds.
inline model::Gpt2Config tiny_config() {
  model::Gpt2Config c;
  c.n_layer = 2;
  c.n_embd = 64;
  c.n_head = 4;
  c.vocab_size = 211;
  c.n_positions = 32;
  return c;
}

// A fresh, empty directory for the running test: TempDir()/<prefix>_<pid>_<test name>.
inline std::filesystem::path fresh_test_dir(const std::string& prefix) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(testing::TempDir()) /
                       (prefix + "_" + std::to_string(getpid()) + "_" +
                        testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Writes `count` tokens drawn uniformly below 210 from `seed` to `path`, as one document of
// tiny_config()'s vocabulary (211 tokens, 210 the end-of-text token). Fails the test on error.
inline void write_random_tokens(const std::string& path, uint32_t seed, size_t count) {
  std::mt19937 rng(seed);
  std::vector<int32_t> toks(count);
  for (auto& t : toks) t = int32_t(rng() % 210u);
  ASSERT_TRUE(data::write_token_file(path, toks, 211, 210, 1).is_ok()) << path;
}

// A run's outcome: the result, every step's stats (on_step) and the final weights (on_finish;
// empty when the run failed or was stopped early).
struct RunOutput {
  Result<TrainResult> result = Status::internal("not run");
  std::vector<StepStats> steps;
  std::vector<float> params;
};

// Runs `o` collecting a RunOutput. `on_step` runs after each step is collected (e.g. to edit a
// budget file); `should_stop` ends the run early as an interruption would.
inline RunOutput run_collecting(const TrainOptions& o,
                                std::function<void(const StepStats&)> on_step = nullptr,
                                std::function<bool(const StepStats&)> should_stop = nullptr) {
  RunOutput r;
  TrainCallbacks cb;
  cb.on_step = [&](const StepStats& s) {
    r.steps.push_back(s);
    if (on_step) on_step(s);
  };
  cb.should_stop = std::move(should_stop);
  cb.on_finish = [&](const model::Gpt2Config& c, const float* p, memory::MemoryResource*) {
    r.params.assign(p, p + model::gpt2_param_table(c).total_floats);
    return Status::ok();
  };
  r.result = run_training(o, cb);
  return r;
}

}  // namespace headroom::train::test
