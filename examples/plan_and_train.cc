// Embedding headroom: plan gpt2-tiny for a memory budget and train a few steps through the
// engine's public headers (find_package(headroom), target headroom::engine).
//
//   plan_and_train [--steps N] [--budget-mib M]
//
// The run is resolved by the library call `headroom train` uses (train::resolve_run: the
// planner's choice for what is left open). The data is a token file of a repeating pattern,
// written here, so no vocabulary or corpus is needed.
#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/units.h"
#include "data/token_file.h"
#include "plan/memory_plan.h"
#include "plan/search.h"
#include "train/run_request.h"
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

  // Data: a repeating pattern of 97 tokens, in a token file for GPT-2's 50257-token vocabulary.
  const std::string data =
      (std::filesystem::temp_directory_path() / ("plan_and_train_" + std::to_string(getpid())))
          .string();
  std::vector<int32_t> tokens(200'000);
  for (size_t i = 0; i < tokens.size(); i++) tokens[i] = int32_t(i % 97);
  if (hr::Status s = hr::data::write_token_file(data, tokens, 50257, 96, 1); !s.is_ok()) {
    return std::fprintf(stderr, "%s\n", s.message().c_str()), 1;
  }

  // The run as a user chooses it; what is left unset (micro-batch, accumulation, precision,
  // recomputation, offload) the planner chooses: the fastest plan that fits the budget, on this
  // machine's calibrated speeds (measured once and cached).
  hr::train::RunRequest req;
  req.model = "gpt2-tiny";
  req.data = data;
  req.seq = 64;
  req.global_batch = 8;
  req.device_memory = budget;
  req.steps = steps;
  req.warmup = 1;
  req.val_fraction = 0;
  req.quiet = true;
  hr::Result<hr::train::ResolvedRun> run = hr::train::resolve_run(req);
  if (!run.is_ok()) {
    std::filesystem::remove(data);
    return std::fprintf(stderr, "%s\n", run.status().message().c_str()), 1;
  }
  const hr::plan::Candidate& c = *run->search->chosen;
  std::printf("plan: micro-batch %d x %d accumulation, %s, %s; peak %s of %s\n%s",
              c.policy.micro_batch, c.policy.accumulation, c.policy.precision.c_str(),
              hr::plan::describe_exec(c.policy.exec).c_str(),
              hr::format_bytes(c.peak_bytes).c_str(), hr::format_bytes(budget).c_str(),
              hr::plan::category_table(*run->search->chosen_plan, budget).c_str());

  // Train with the chosen plan.
  hr::train::TrainOptions& o = run->options;
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
