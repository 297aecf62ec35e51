// The flag parsers and resolvers the subcommands share, and the JSON of plans and steps.
#include "cli/common.h"

#include <omp.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <functional>

#include <fmt/format.h>

#include "backend/cpu/device.h"
#include "core/log.h"
#include "data/prepare.h"
#include "memory/resource.h"
#include "plan/calibrate.h"

namespace headroom::cli {

int fail(const Status& s) {
  std::fprintf(stderr, "headroom: error: %s\n", s.message().c_str());
  return 1;
}

void set_threads(int threads) {
  int n = threads > 0 ? threads : cpu::query_cpu_device().cores;
  omp_set_num_threads(n);
}

// The tokenizer of a run: `dir` (tokenizer.json, tokenizer.model or GPT-2's files), or GPT-2's
// from the vocabulary directory.
Result<std::unique_ptr<data::Tokenizer>> run_tokenizer(const std::string& dir,
                                                       const std::string& vocab) {
  if (!dir.empty()) return data::load_tokenizer(dir);
  std::string vocab_dir = vocab;
  if (vocab_dir.empty()) {
    HR_ASSIGN_OR_RETURN(vocab_dir, data::find_vocab_dir());
  }
  HR_ASSIGN_OR_RETURN(data::Gpt2Tokenizer t, data::Gpt2Tokenizer::load(vocab_dir));
  return std::unique_ptr<data::Tokenizer>(std::make_unique<data::Gpt2Tokenizer>(std::move(t)));
}

Result<uint64_t> device_budget(const std::string& flag) {
  HR_ASSIGN_OR_RETURN(const std::optional<uint64_t> b,
                      parse_size_flag("--device-memory", flag, true));
  return train::device_budget(b);
}

void add_train_flags(CLI::App* app, TrainFlags& f) {
  f.model_option = app->add_option("--model", f.model,
                                   "preset (bytes-tiny: one token a byte; gpt2-tiny, gpt2, "
                                   "gpt2-medium, gpt2-large, gpt2-xl, llama-tiny), a config.json, "
                                   "or a directory holding one (train starts from its "
                                   "model.safetensors when it has one)")
                       ->capture_default_str();
  app->add_option("--data", f.data,
                  "token file from `headroom prepare` (default: Debian's fortunes, prepared once)");
  // Integer and size flags go through one parser with one set of rules (cli/flag_rules.h).
  add_int_flag(app, "--seq", f.seq, kSeqRule,
               "sequence length T in tokens (default, or auto: min(128, n_positions))");
  add_int_flag(app, "--batch", f.batch, kBatchRule,
               "micro-batch in sequences, at least 1 (default, or auto: the planner's choice)");
  add_int_flag(app, "--global-batch", f.global_batch, kGlobalBatchRule,
               "sequences per optimizer step; a multiple of --batch (default, or auto: --batch "
               "times the ranks, or 8)");
  add_int_flag(app, "--steps", f.steps, kStepsRule,
               "optimizer steps (default: 200; bytes-tiny 3000 within 3 minutes, see --minutes)",
               true);
  app->add_option("--minutes", f.minutes,
                  "a time budget: at the end of the warmup (4 steps or more) the run fixes its "
                  "step count from the steps' times so that it ends about M minutes after its "
                  "first step, validation included, with the learning rate's decay complete "
                  "(--steps is then the most it may take)")
      ->type_name("FLOAT");
  app->add_option("--precision", f.precision,
                  "auto (the planner chooses fp32 or bf16), fp32, bf16 (mixed: bf16 GEMMs and "
                  "activations, fp32 master weights and optimizer state), or fp16 (the same with "
                  "IEEE half activations and dynamic loss scaling; an explicit choice only)")
      ->capture_default_str();
  app->add_option("--recompute", f.recompute,
                  "activation recomputation: auto (the planner chooses, per block), none, "
                  "selective or full")
      ->capture_default_str();
  app->add_option("--offload-activations", f.offload_activations,
                  "activation offload to the offload tier: auto (the planner chooses, per block), "
                  "on (every block that keeps activations) or off")
      ->capture_default_str();
  app->add_option("--device", f.device,
                  "cpu; for `train`, cuda in a CUDA build (the process's GPU; every option the "
                  "CPU runs); for `plan`, a GPU name (H100-80GB, L4, ...)")
      ->capture_default_str();
  app->add_flag("--managed-memory", f.managed_memory,
                "with --device cuda: the plan's arenas in managed (unified) memory "
                "(cudaMallocManaged) instead of cudaMalloc, never beyond the GPU's free memory");
  add_size_flag(app, "--device-memory", f.device_memory, true,
                "device memory budget, e.g. 4GiB (default, or auto: available memory less a "
                "margin, cgroup limits respected)",
                true);
  add_int_flag(app, "--seed", f.seed, kSeedRule, "seed for initialisation", true);
  app->add_option("--plan", f.plan,
                  "auto (the planner chooses micro-batch and accumulation) or the JSON file of "
                  "`headroom plan --json`")
      ->capture_default_str();
  app->add_option("--lr", f.lr,
                  "peak learning rate (default: 1e-3 below 50M parameters, else 6e-4)");
  add_int_flag(app, "--warmup", f.warmup,
               {.min = 0, .what = "warmup steps", .auto_means = "10% of --steps, at most 100"},
               "warmup steps, 0 for none (default, or auto: 10% of --steps, at most 100)", false,
               -1);
  add_int_flag(app, "--threads", f.threads, kThreadsRule,
               "OpenMP threads (default, or auto: the cores available)");
  app->add_option("--vocab", f.vocab, "directory with the GPT-2 vocabulary (default: set-up's)");
  app->add_option("--tokenizer", f.tokenizer,
                  "directory with tokenizer.json, tokenizer.model or GPT-2's files: the default "
                  "corpus is tokenised with it, samples decoded, and its files saved with the "
                  "model; `bytes`: one token a byte (default: the --model directory's own, else "
                  "the preset's: bytes for bytes-tiny, else GPT-2's)");
  app->add_option("--offload-optimizer", f.offload_optimizer,
                  "optimizer offload: auto (the planner chooses: on only where it fits and no "
                  "offload does not, or is faster), on (fp32 master weights and AdamW m, v in the "
                  "offload tier, where AdamW runs), or off")
      ->capture_default_str();
  add_size_flag(app, "--offload-memory", f.offload_memory, true,
                "the offload tier's budget (host memory), e.g. 64GiB, for the offloaded "
                "optimizer state and activations together (default, or auto: the host's "
                "available memory, MemAvailable; `plan` for a named GPU: not limited)",
                true);
}

// --offload-memory: a size, or auto: the host's available memory (MemAvailable, cgroup limits
// respected) when the offload tier is this host's, or not limited (0) for a named GPU's host.
Result<uint64_t> offload_budget(const std::string& flag, bool this_host) {
  HR_ASSIGN_OR_RETURN(const std::optional<uint64_t> b,
                      parse_size_flag("--offload-memory", flag, true));
  return train::offload_budget(b, this_host);
}

// The device to plan for: the CPU (measured by calibration, budget from --device-memory) or a
// named GPU from the spec table.
Result<plan::DeviceSpec> resolve_device(const std::string& device, const std::string& memory_flag,
                                        bool quiet) {
  if (device == "cpu") {
    HR_ASSIGN_OR_RETURN(uint64_t budget, device_budget(memory_flag));
    return train::cpu_device(budget, quiet);
  }
  HR_ASSIGN_OR_RETURN(plan::DeviceSpec spec, plan::named_device(device));
  HR_ASSIGN_OR_RETURN(const std::optional<uint64_t> memory,
                      parse_size_flag("--device-memory", memory_flag, true));
  if (memory) spec.memory_bytes = *memory;
  return spec;
}

json categories_json(const std::array<uint64_t, memory::kNumCategories>& by) {
  json j = json::object();
  for (size_t i = 0; i < by.size(); i++) {
    if (by[i]) j[std::string(memory::category_name(static_cast<memory::Category>(i)))] = by[i];
  }
  return j;
}

json recompute_json(const model::ExecOptions& e) {
  json a = json::array();
  for (int l = 0; l < int(e.recompute.size()); l++) {
    a.push_back(std::string(model::recompute_name(e.recompute_at(l))));
  }
  return a;
}

json offload_json(const model::ExecOptions& e) {
  json a = json::array();
  for (bool b : e.offload) a.push_back(b);
  return a;
}

// Per block none/selective/full/offload/selective+offload; empty when every block is "none".
json schedule_json(const model::ExecOptions& e) {
  return plan::schedule_per_block(e, int(std::max(e.recompute.size(), e.offload.size())));
}

// The offload kinds in a plan file and --json: "none", "optimizer", "activations" or "all"
// (both, in one offload tier), DESIGN.md's --offload names.
const char* offload_kind(bool optimizer, bool activations) {
  return optimizer && activations ? "all"
         : optimizer              ? "optimizer"
         : activations            ? "activations"
                                  : "none";
}

json candidate_json(const plan::Candidate& c) {
  json j = {{"micro_batch", c.policy.micro_batch},
            {"accumulation", c.policy.accumulation},
            {"seq", c.policy.seq},
            {"precision", c.policy.precision},
            {"recompute", plan::recompute_summary(c.policy.exec)},
            {"recompute_per_block", recompute_json(c.policy.exec)},
            {"attention", c.policy.exec.tiled_attention ? "tiled" : "plain"},
            {"lm_head", c.policy.exec.head_chunk > 0 ? "fused" : "full"},
            {"head_chunk", c.policy.exec.head_chunk},
            {"bf16_weights", c.policy.exec.bf16_weight_copy ? "copy" : "cast per layer"},
            {"techniques", plan::describe_exec(c.policy.exec)},
            {"offload",
             offload_kind(c.policy.offload_optimizer, plan::offloaded_blocks(c.policy.exec) > 0)},
            {"offload_per_block", offload_json(c.policy.exec)},
            {"schedule_per_block", schedule_json(c.policy.exec)},
            {"offload_bytes", c.offload_bytes},
            {"offload_optimizer_bytes", c.offload_bytes - c.offload_activation_bytes},
            {"offload_activation_bytes", c.offload_activation_bytes},
            {"offload_activation_link_bytes_per_step", c.cost.activation_offload_bytes},
            {"offload_activation_seconds", c.cost.activation_offload_seconds},
            {"offload_link_bytes_per_step", c.cost.offload_bytes},
            {"offload_seconds", c.cost.offload_seconds},
            {"host_optimizer_seconds", c.cost.host_optimizer_seconds},
            {"optimizer_overlap_seconds", c.cost.optimizer_overlap_seconds},
            {"zero", c.policy.zero_stage},
            {"ranks", c.policy.ranks},
            {"comm_bytes_per_step", c.cost.comm_bytes},
            {"comm_seconds", c.cost.comm_seconds},
            {"peak_bytes", c.peak_bytes},
            {"lower_bound_bytes", c.lower_bound_bytes},
            {"by_category", categories_json(c.by_category)},
            {"predicted_tokens_per_s", c.cost.tokens_per_s},
            {"predicted_step_ms", c.cost.step_seconds * 1e3},
            {"fits", c.fits}};
  if (!c.fits) j["rejected_because"] = c.rejected_because;
  return j;
}

json step_json(const train::StepStats& s) {
  json j = {{"step", s.step},
            {"loss", s.loss},
            {"lr", s.lr},
            {"grad_norm", s.grad_norm},
            {"tokens", s.tokens},
            {"tokens_per_s", s.tokens_per_s},
            {"step_ms", s.step_ms},
            {"data_wait_ms", s.data_wait_ms},
            {"device_bytes_in_use", s.device_bytes_in_use},
            {"device_bytes_peak", s.device_bytes_peak},
            {"planned_peak_bytes", s.planned_peak_bytes},
            {"lower_bound_bytes", s.lower_bound_bytes},
            {"pool_reserved_bytes", s.pool_reserved_bytes},
            {"fragmentation",
             s.lower_bound_bytes ? double(s.device_bytes_peak) / double(s.lower_bound_bytes) : 0.0},
            {"micro_batch", s.micro_batch},
            {"accumulation", s.accumulation},
            {"recompute", s.recompute},
            {"device_budget", s.device_budget},
            {"predicted_step_ms", s.predicted_step_ms},
            {"replans", s.replans},
            {"oom_recoveries", s.oom_recoveries},
            {"budget_rank", s.budget_rank},
            {"padding", s.padding},
            {"micro_batches", s.micro_batches},
            {"loss_scale", s.loss_scale},
            {"skipped", s.skipped}};
  if (s.planned_offload_bytes) {
    j["offload_bytes_in_use"] = s.offload_bytes_in_use;
    j["offload_bytes_peak"] = s.offload_bytes_peak;
    j["planned_offload_bytes"] = s.planned_offload_bytes;
    j["offload_copy_ms"] = s.offload_copy_ms;
  }
  if (s.offload_bytes > 0) {
    j["offload_bytes"] = s.offload_bytes;
    j["offload_copy_ms"] = s.offload_copy_ms;
    j["offload_wait_ms"] = s.offload_wait_ms;
  }
  if (!s.events.empty()) j["events"] = s.events;
  if (s.val_loss) j["val_loss"] = *s.val_loss;
  return j;
}

}  // namespace headroom::cli
