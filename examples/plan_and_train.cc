// Embedding headroom: plan gpt2-tiny for a memory budget and train a few steps through the
// engine's public headers (find_package(headroom), target headroom::engine).
//
//   plan_and_train [--steps N] [--budget-mib M]
//
// The data is a token file of a repeating pattern, written here, so the loss falls within a few
// steps and no vocabulary or corpus is needed.
#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/units.h"
#include "data/token_file.h"
#include "model/config.h"
#include "plan/calibrate.h"
#include "plan/memory_plan.h"
#include "plan/search.h"
#include "train/trainer.h"

namespace hr = headroom;

int main(int argc, char** argv) {
  int steps = 4;
  uint64_t budget = uint64_t(512) << 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--steps") == 0) {
      steps = std::atoi(argv[i + 1]);
    } else if (std::strcmp(argv[i], "--budget-mib") == 0) {
      budget = uint64_t(std::atoll(argv[i + 1])) << 20;
    } else {
      std::fprintf(stderr, "usage: %s [--steps N] [--budget-mib M]\n", argv[0]);
      return 2;
    }
  }
  if (steps < 1 || budget == 0) {
    std::fprintf(stderr, "--steps and --budget-mib must be positive\n");
    return 2;
  }

  // The model and this machine (its calibrated speeds, measured once and cached).
  hr::Result<hr::model::Gpt2Config> config = hr::model::resolve_model("gpt2-tiny");
  if (!config.is_ok()) return std::fprintf(stderr, "%s\n", config.status().message().c_str()), 1;
  hr::Result<hr::plan::Calibration> cal =
      hr::plan::load_or_calibrate(hr::plan::default_calibration_path(), {});
  if (!cal.is_ok()) return std::fprintf(stderr, "%s\n", cal.status().message().c_str()), 1;

  // Plan: the fastest micro-batch, accumulation and techniques that fit the budget.
  hr::plan::SearchRequest req;
  req.config = *config;
  req.device = hr::plan::cpu_device_spec(*cal, budget);
  req.device_memory = budget;
  req.seq = 64;
  req.global_batch = 8;
  req.executor_layout = true;  // plan each buffer as the trainer allocates it
  hr::Result<hr::plan::SearchResult> plan = hr::plan::search_plan(req);
  if (!plan.is_ok()) return std::fprintf(stderr, "%s\n", plan.status().message().c_str()), 1;
  if (!plan->chosen) {
    std::fprintf(stderr, "nothing fits %s:\n%s", hr::format_bytes(budget).c_str(),
                 plan->advice.c_str());
    return 3;
  }
  const hr::plan::Candidate& c = *plan->chosen;
  std::printf("plan: micro-batch %d x %d accumulation, %s, %s; peak %s of %s\n%s",
              c.policy.micro_batch, c.policy.accumulation, c.policy.precision.c_str(),
              hr::plan::describe_exec(c.policy.exec).c_str(),
              hr::format_bytes(c.peak_bytes).c_str(), hr::format_bytes(budget).c_str(),
              hr::plan::category_table(*plan->chosen_plan, budget).c_str());

  // Data: a repeating pattern of 97 tokens.
  const std::string data =
      (std::filesystem::temp_directory_path() / ("plan_and_train_" + std::to_string(getpid())))
          .string();
  std::vector<int32_t> tokens(200'000);
  for (size_t i = 0; i < tokens.size(); i++) tokens[i] = int32_t(i % 97);
  if (hr::Status s = hr::data::write_token_file(data, tokens, config->vocab_size, 96, 1);
      !s.is_ok()) {
    return std::fprintf(stderr, "%s\n", s.message().c_str()), 1;
  }

  // Train with the chosen plan.
  hr::train::TrainOptions o;
  o.config = *config;
  o.model_name = "gpt2-tiny";
  o.data = data;
  o.seq = req.seq;
  o.micro_batch = c.policy.micro_batch;
  o.accumulation = c.policy.accumulation;
  o.exec = c.policy.exec;
  o.offload_optimizer = c.policy.offload_optimizer;
  o.device = req.device;
  o.device_memory = budget;
  o.steps = steps;
  o.warmup_steps = 1;
  o.adamw.lr = 1e-3f;
  o.val_fraction = 0;
  o.eval_batches = 0;
  hr::train::TrainCallbacks cb;
  cb.on_step = [](const hr::train::StepStats& s) {
    std::printf("step %d: loss %.4f, peak %s (planned %s)\n", s.step, s.loss,
                hr::format_bytes(s.device_bytes_peak).c_str(),
                hr::format_bytes(s.planned_peak_bytes).c_str());
  };
  hr::Result<hr::train::TrainResult> r = hr::train::run_training(o, cb);
  std::filesystem::remove(data);
  if (!r.is_ok()) return std::fprintf(stderr, "%s\n", r.status().message().c_str()), 1;
  std::printf("final loss %.4f, %.0f tokens/s\n", r->final_loss, r->tokens_per_s);
  return 0;
}
