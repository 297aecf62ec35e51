// What the subcommands share (cli/*.cc): the flag structs, the flag parsers and resolvers, the JSON
// of plans and steps, and each subcommand's entry point. Internal to the CLI, not a public API.
#pragma once

#include <CLI/CLI.hpp>
#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/flag_rules.h"
#include "core/status.h"
#include "data/tokenizer.h"
#include "memory/resource.h"
#include "model/config.h"
#include "plan/search.h"
#include "train/run_request.h"
#include "train/trainer.h"

namespace headroom::cli {

namespace fs = std::filesystem;
using nlohmann::json;

// The resolvers the library has (train/run_request.h).
using train::cache_dir;
using train::check_precision;
using train::default_corpus;
using train::model_dir_tokenizer;
using train::parse_offload;
using train::parse_recompute;
using train::precision_of;

// Prints "headroom: error: <message>" to stderr; returns the exit code 1.
int fail(const Status& s);

// OpenMP threads: `threads`, or the cores available when 0.
void set_threads(int threads);

// The tokenizer of a run: `dir` (tokenizer.json, tokenizer.model or GPT-2's files), or GPT-2's
// from the vocabulary directory.
Result<std::unique_ptr<data::Tokenizer>> run_tokenizer(const std::string& dir,
                                                       const std::string& vocab);

// --device-memory: a size, or auto: available memory less a margin (cgroup limits respected).
Result<uint64_t> device_budget(const std::string& flag);

// ---------------------------------------------------------------------------------------------
struct TrainFlags {
  std::string model = "bytes-tiny";
  std::string data;
  std::string tokenizer;  // --tokenizer, or the model directory's own
  int seq = 0;
  int batch = 0;
  int global_batch = 0;
  int steps = 0;        // 0: the model's default (200; bytes-tiny 1500)
  std::string minutes;  // a time budget in minutes (empty: none), parsed by resolve_train_options
  std::string precision = "auto";
  std::string recompute = "auto";
  std::string offload_activations = "auto";  // --offload-activations auto|on|off
  std::string offload_memory = "auto";       // --offload-memory SIZE: the offload tier's budget
  std::string device = "cpu";
  bool managed_memory = false;  // --device cuda: the arenas in managed memory
  std::string device_memory = "auto";
  std::string device_memory_file;  // train: the budget, read again before every step
  std::string plan = "auto";
  uint64_t seed = 1337;
  std::string out = "out";
  std::string log_json;
  std::string profile;  // --profile DIR
  int save_every = 0;
  int keep_checkpoints = 3;
  std::string resume;
  CLI::Option* model_option = nullptr;       // to tell a given --model from the default
  std::optional<plan::SearchResult> search;  // the auto plan's search, for the report
  float lr = 0;
  int warmup = -1;
  int eval_every = 0;
  double val_fraction = 0.05;
  int sample_tokens = -1;  // -1: the model's default (48; bytes-tiny 320); 0: none
  int threads = 0;
  std::string vocab;
  bool json = false;
  std::string zero = "auto";  // train: --zero auto|0|1|2
  std::string batching;       // train: packed|bucketed; empty: packed, or the checkpoint's
  int bucket = 32;            // train: bucket granularity in tokens
  CLI::Option* bucket_option = nullptr;    // to tell a given --bucket from the default
  std::string offload_optimizer = "auto";  // --offload-optimizer auto|on|off
  int ranks = 1;                       // train: the processes of the job (mpirun), set by run_train
  std::string loss_scale = "dynamic";  // train, fp16: --loss-scale dynamic|VALUE
  int loss_scale_window = 2000;        // train, fp16: --loss-scale-window (growth interval)
  std::vector<int> inject_overflow;    // train: --inject-overflow-at STEP (tests; hidden)
  bool self_correct = true;            // train: --no-self-correct (docs/notes/cost-model.md)
  // train: training with a sparsity mask (docs/notes/pruning.md).
  std::string sparsity_mask;         // --sparsity-mask DIR (a pruned model)
  int prune_at = 0;                  // --prune-at STEP
  std::string prune_method = "2:4";  // --prune-method magnitude|N:M
  double prune_sparsity = 0.5;       // --prune-sparsity (magnitude)
  bool prune_per_layer = false;      // --prune-per-layer (magnitude)
  // train, plan: knowledge distillation (docs/notes/distillation.md).
  std::string teacher;                       // --teacher DIR
  std::optional<float> distill_alpha;        // --distill-alpha (default 0.5)
  std::optional<float> distill_temperature;  // --distill-temperature (default 2)
  std::string teacher_dtype = "auto";        // --teacher-dtype auto|fp32|bf16
};

// The integer flags' rules (cli/flag_rules.h, docs/notes/flags.md): counts start at 1 and "auto"
// stands for the default where there is one; 0 is accepted only where it means something, said
// in --help. The upper bounds keep products such as micro-batch x seq x ranks inside int.
inline constexpr uint64_t kMaxCount = uint64_t(1) << 20;
inline constexpr IntRule kSeqRule{.max = kMaxCount,
                                  .what = "the sequence length in tokens",
                                  .auto_means = "min(128, n_positions)"};
inline constexpr IntRule kBatchRule{
    .max = kMaxCount, .what = "the micro-batch in sequences", .auto_means = "the planner's choice"};
inline constexpr IntRule kGlobalBatchRule{.max = kMaxCount,
                                          .what = "sequences per optimizer step",
                                          .auto_means = "--batch times the ranks, or 8"};
inline constexpr IntRule kStepsRule{.what = "optimizer steps"};
inline constexpr IntRule kSeedRule{
    .min = 0, .max = std::numeric_limits<uint64_t>::max(), .what = "the random seed"};
inline constexpr IntRule kThreadsRule{
    .max = 1 << 16, .what = "OpenMP threads", .auto_means = "the cores available"};

// The flags train, plan and bench share (the model, the batch shape, the techniques, the budget).
void add_train_flags(CLI::App* app, TrainFlags& f);
// Distillation's flags (train and plan): --teacher, --distill-alpha, --distill-temperature,
// --teacher-dtype (cli/train_options.cc).
void add_distill_flags(CLI::App* app, TrainFlags& f);

// --offload-memory: a size, or auto: the host's available memory (MemAvailable, cgroup limits
// respected) when the offload tier is this host's, or not limited (0) for a named GPU's host.
Result<uint64_t> offload_budget(const std::string& flag, bool this_host);

// The device to plan for: the CPU (measured by calibration, budget from --device-memory) or a
// named GPU from the spec table.
Result<plan::DeviceSpec> resolve_device(const std::string& device, const std::string& memory_flag,
                                        bool quiet);

// `headroom train`'s flags into a train::RunRequest, resolved by train::resolve_run (the plan, the
// schedule, loss scaling, the data; a --resume checkpoint's state); sets f.search and
// f.tokenizer from the result.
Status resolve_train_options(TrainFlags& f, train::TrainOptions* o);

// The JSON of plans (plan --json, plan files) and of steps (--log-json).
json categories_json(const std::array<uint64_t, memory::kNumCategories>& by);
json recompute_json(const model::ExecOptions& e);
json offload_json(const model::ExecOptions& e);
// Per block none/selective/full/offload/selective+offload; empty when every block is "none".
json schedule_json(const model::ExecOptions& e);
// The offload kinds in a plan file and --json: "none", "optimizer", "activations" or "all"
// (both, in one offload tier), DESIGN.md's --offload names.
const char* offload_kind(bool optimizer, bool activations);
json candidate_json(const plan::Candidate& c);
json step_json(const train::StepStats& s);

// ---------------------------------------------------------------------------------------------
struct GenerateFlags {
  std::string model_dir;
  std::string prompt;
  int max_new_tokens = 64;
  float temperature = 0.8f;
  int top_k = 40;
  uint64_t seed = 42;
  std::string vocab;
  int threads = 0;
  bool json = false;
};

// ---------------------------------------------------------------------------------------------
struct PrepareFlags {
  std::vector<std::string> inputs;
  std::string out;
  std::string separator;
  std::string vocab;
  std::string tokenizer;
  std::string field = "text";  // JSON Lines: the text's member
  bool json = false;
};

// ---------------------------------------------------------------------------------------------
struct PlanFlags {
  TrainFlags t;
  int devices = 1;
  std::string zero = "auto";  // --zero auto|0|1|2|3
  bool sweep = false;
};

// ---------------------------------------------------------------------------------------------
// `headroom bench`: whole training steps on random tokens, median after warm-up.
struct BenchFlags {
  TrainFlags t;
  int warmup = 1;
  bool breakdown = false;
  int head_chunk = 0;
  std::string bf16_weights = "copy";
  std::string attention = "tiled";
  bool pad_rows = true;
  bool record = false;
  bool peak_between_steps = true;
  std::string alternate;  // VAR=A,B: a per-call knob alternated between steps
};

// The subcommands; each returns the process exit code.
int run_train(TrainFlags& f);
int run_generate(GenerateFlags& f);
int run_prepare(PrepareFlags& f);
int run_plan(PlanFlags& pf);
int run_bench(BenchFlags& bf);
int run_version(bool as_json);
int run_calibrate(bool as_json, const std::string& device);
// `headroom --version`: the version and what it was built with; `version --json`'s object.
std::string version_text();
json version_json();

}  // namespace headroom::cli
