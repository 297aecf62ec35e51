// Subcommands and their flags (the contract in DESIGN.md), human and JSON output.
#include "cli/cli.h"

#include <omp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <tuple>

#include <fmt/format.h>

#include "backend/cpu/amx_gemm.h"
#include "backend/cpu/build_info.h"
#include "backend/cpu/device.h"
#include "backend/cpu/fused_kernels.h"
#include "backend/cpu/kernels.h"
#include "cli/flag_rules.h"
#include "core/log.h"
#include "core/units.h"
#include "core/utf8.h"
#include "data/prepare.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "memory/host_resource.h"
#include "model/config.h"
#include "model/weights.h"
#include "plan/calibrate.h"
#include "plan/cost_model.h"
#include "plan/generation_plan.h"
#include "plan/search.h"
#include "report/profile.h"
#include "report/progress.h"
#include "train/checkpoint.h"
#include "train/elastic.h"
#include "train/generate.h"
#include "train/trainer.h"

#ifndef HEADROOM_VERSION
#define HEADROOM_VERSION "0.1.0"
#endif
#ifndef HEADROOM_BUILD_TYPE
#define HEADROOM_BUILD_TYPE "unknown"
#endif

namespace headroom::cli {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

int fail(const Status& s) {
  std::fprintf(stderr, "headroom: error: %s\n", s.message().c_str());
  return 1;
}

void set_threads(int threads) {
  int n = threads > 0 ? threads : cpu::query_cpu_device().cores;
  omp_set_num_threads(n);
}

std::string cache_dir() {
  if (const char* d = std::getenv("HEADROOM_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/headroom";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/headroom";
  return ".headroom-cache";
}

// The tokenizer directory a model directory carries (tokenizer.json or tokenizer.model), or "".
std::string model_dir_tokenizer(const std::string& model) {
  std::error_code ec;
  if (!fs::is_directory(model, ec)) return "";
  for (const char* f : {"tokenizer.json", "tokenizer.model"}) {
    if (fs::exists(fs::path(model) / f, ec)) return model;
  }
  return "";
}

// The tokenizer of a run: `dir` (tokenizer.json, tokenizer.model or GPT-2's files), or GPT-2's
// from the vocabulary directory.
Result<std::unique_ptr<data::Tokenizer>> run_tokenizer(const std::string& dir,
                                                       const std::string& vocab) {
  if (!dir.empty()) return data::load_tokenizer(dir);
  HR_ASSIGN_OR_RETURN(data::Gpt2Tokenizer t,
                      data::Gpt2Tokenizer::load(vocab.empty() ? data::default_vocab_dir() : vocab));
  return std::unique_ptr<data::Tokenizer>(std::make_unique<data::Gpt2Tokenizer>(std::move(t)));
}

// The default corpus: Debian's fortunes, tokenised once into the cache (per tokenizer: GPT-2's
// into fortunes.tokens, another's into fortunes.<name>-<hash of its directory>.tokens).
Result<std::string> default_corpus(const std::string& vocab_dir,
                                   const std::string& tokenizer_dir = "") {
  std::string path = cache_dir() + "/fortunes.tokens";
  if (!tokenizer_dir.empty()) {
    std::error_code ec;
    const std::string abs = fs::weakly_canonical(tokenizer_dir, ec).string();
    std::string name = fs::path(abs).filename().string();
    for (char& ch : name) {
      if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
    }
    path = cache_dir() + fmt::format("/fortunes.{}-{:08x}.tokens", name,
                                     uint32_t(std::hash<std::string>{}(abs)&0xffffffffu));
  }
  if (fs::exists(path)) return path;
  std::vector<std::string> inputs = data::default_corpus_inputs();
  if (inputs.empty()) {
    return Status::not_found(
        "no --data given and the default corpus (Debian's fortunes package, "
        "/usr/share/games/fortunes) is not installed: run `make setup` or pass --data FILE");
  }
  std::error_code ec;
  fs::create_directories(cache_dir(), ec);
  if (ec)
    return Status::io_error(
        fmt::format("cannot create cache directory '{}': {}", cache_dir(), ec.message()));
  log_info("preparing the default corpus ({} fortune files) into {}", inputs.size(), path);
  data::PrepareOptions po;
  po.inputs = inputs;
  po.out = path;
  po.vocab_dir = tokenizer_dir.empty() ? vocab_dir : "";
  po.tokenizer_dir = tokenizer_dir;
  po.doc_separator = "%";
  HR_ASSIGN_OR_RETURN(data::PrepareStats st, data::prepare_token_file(po));
  log_info("  {} documents, {} tokens in {:.1f} s", st.documents, st.tokens, st.seconds);
  return path;
}

Result<uint64_t> device_budget(const std::string& flag) {
  HR_ASSIGN_OR_RETURN(const std::optional<uint64_t> b,
                      parse_size_flag("--device-memory", flag, true));
  if (!b) {
    cpu::CpuDeviceInfo info = cpu::query_cpu_device();
    return cpu::default_device_budget(info);
  }
  return *b;
}

// ---------------------------------------------------------------------------------------------
struct TrainFlags {
  std::string model = "gpt2-tiny";
  std::string data;
  std::string tokenizer;  // --tokenizer, or the model directory's own
  int seq = 0;
  int batch = 0;
  int global_batch = 0;
  int steps = 200;
  std::string precision = "auto";
  std::string recompute = "auto";
  std::string offload_activations = "auto";  // --offload-activations auto|on|off
  std::string offload_memory = "auto";       // --offload-memory SIZE: the offload tier's budget
  std::string device = "cpu";
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
  int sample_tokens = 48;
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
};

// The integer flags' rules (cli/flag_rules.h, docs/notes/flags.md): counts start at 1 and "auto"
// stands for the default where there is one; 0 is accepted only where it means something, said
// in --help. The upper bounds keep products such as micro-batch x seq x ranks inside int.
constexpr uint64_t kMaxCount = uint64_t(1) << 20;
constexpr IntRule kSeqRule{.max = kMaxCount,
                           .what = "the sequence length in tokens",
                           .auto_means = "min(128, n_positions)"};
constexpr IntRule kBatchRule{
    .max = kMaxCount, .what = "the micro-batch in sequences", .auto_means = "the planner's choice"};
constexpr IntRule kGlobalBatchRule{.max = kMaxCount,
                                   .what = "sequences per optimizer step",
                                   .auto_means = "--batch times the ranks, or 8"};
constexpr IntRule kStepsRule{.what = "optimizer steps"};
constexpr IntRule kSeedRule{
    .min = 0, .max = std::numeric_limits<uint64_t>::max(), .what = "the random seed"};
constexpr IntRule kThreadsRule{
    .max = 1 << 16, .what = "OpenMP threads", .auto_means = "the cores available"};

void add_train_flags(CLI::App* app, TrainFlags& f) {
  f.model_option = app->add_option("--model", f.model,
                                   "preset (gpt2-tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl), "
                                   "a config.json, or a directory holding one")
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
  add_int_flag(app, "--steps", f.steps, kStepsRule, "optimizer steps", true);
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
  app->add_option("--device", f.device, "cpu or a GPU name for `plan` (H100-80GB, L4, ...)")
      ->capture_default_str();
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
                  "model (default: the --model directory's own, else GPT-2's)");
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

// --offload-optimizer, --offload-activations (`name`): auto (unset: the planner chooses), on, off.
Result<std::optional<bool>> parse_offload(const std::string& flag, const char* name) {
  if (flag == "auto") return std::optional<bool>();
  if (flag == "on") return std::optional<bool>(true);
  if (flag == "off") return std::optional<bool>(false);
  return Status::invalid_argument(fmt::format("{} {}: use auto, on or off", name, flag));
}

// --offload-memory: a size, or auto: the host's available memory (MemAvailable, cgroup limits
// respected) when the offload tier is this host's, or not limited (0) for a named GPU's host.
Result<uint64_t> offload_budget(const std::string& flag, bool this_host) {
  HR_ASSIGN_OR_RETURN(const std::optional<uint64_t> b,
                      parse_size_flag("--offload-memory", flag, true));
  if (!b) return this_host ? cpu::query_cpu_device().available_bytes : uint64_t(0);
  return *b;
}

Result<plan::DeviceSpec> resolve_device(const std::string& device, const std::string& memory_flag,
                                        bool quiet);

Result<std::optional<model::Recompute>> parse_recompute(const std::string& flag) {
  if (flag == "auto") return std::optional<model::Recompute>();
  for (model::Recompute r :
       {model::Recompute::kNone, model::Recompute::kSelective, model::Recompute::kFull}) {
    if (flag == model::recompute_name(r)) return std::optional<model::Recompute>(r);
  }
  return Status::invalid_argument(
      fmt::format("--recompute {}: use auto, none, selective or full", flag));
}

// --precision: auto, fp32, bf16 or fp16; bf16 only where this machine has bf16 GEMM kernels.
// fp16 runs everywhere (its GEMMs widen to fp32 on a CPU without f16 ones: Note [fp16 GEMMs]).
Status check_precision(const std::string& precision, const plan::DeviceSpec& dev) {
  if (precision != "auto" && precision != "fp32" && precision != "bf16" && precision != "fp16") {
    return Status::invalid_argument(
        fmt::format("--precision {}: use auto, fp32, bf16 or fp16", precision));
  }
  if (precision == "bf16" && !(dev.flops_bf16 > 0)) {
    return Status::unsupported(fmt::format(
        "--precision bf16: {} has no bf16 GEMM kernels (calibration found none: oneDNN needs "
        "AVX512-BF16 or AMX); use --precision fp32",
        dev.name));
  }
  return Status::ok();
}

model::Precision precision_of(const std::string& name) {
  if (name == "bf16") return model::Precision::kBf16;
  if (name == "fp16") return model::Precision::kFp16;
  return model::Precision::kFp32;
}

Status resolve_train_options(TrainFlags& f, train::TrainOptions* o) {
  if (!f.resume.empty()) {
    // Continue with the checkpoint's model, data and batch shape unless flags say otherwise
    // (the trainer refuses another global batch or seq; another micro-batch continues it within
    // rounding).
    HR_ASSIGN_OR_RETURN(train::LoadedCheckpoint ck, train::find_checkpoint(f.resume));
    if (!f.model_option || f.model_option->count() == 0) f.model = ck.dir;  // its config
    if (f.data.empty()) f.data = ck.state.data;
    if (f.seq == 0) f.seq = ck.state.seq;
    if (f.batch == 0) f.batch = ck.state.micro_batch;
    if (f.global_batch == 0) f.global_batch = ck.state.micro_batch * ck.state.accumulation;
    // The schedule too: its defaults depend on --steps, which a resume may raise.
    if (f.lr == 0) f.lr = ck.state.lr;
    if (f.warmup < 0) f.warmup = ck.state.warmup_steps;
    if (f.batching.empty()) f.batching = ck.state.batching;
    if ((!f.bucket_option || f.bucket_option->count() == 0) && ck.state.bucket > 0)
      f.bucket = ck.state.bucket;
  }
  HR_ASSIGN_OR_RETURN(o->batching,
                      data::parse_batching(f.batching.empty() ? "packed" : f.batching));
  const bool bucket_given = f.bucket_option && f.bucket_option->count() > 0;
  if (bucket_given && o->batching == data::Batching::kPacked) {
    return Status::invalid_argument(fmt::format(
        "--bucket {} applies to --batching bucketed only (packed rows are all --seq long)",
        f.bucket));
  }
  if (f.bucket <= 0) {
    return Status::invalid_argument(fmt::format(
        "--bucket {} must be positive: bucket lengths are its multiples (e.g. 32), up to --seq",
        f.bucket));
  }
  o->bucket = f.bucket;
  HR_ASSIGN_OR_RETURN(o->config, model::resolve_model(f.model));
  o->model_name = f.model;
  if (f.tokenizer.empty()) f.tokenizer = model_dir_tokenizer(f.model);
  if (f.device != "cpu") {
    return Status::unsupported(fmt::format("--device {}: only the cpu device is built", f.device));
  }
  if (f.seq < 0) return Status::invalid_argument(fmt::format("--seq {} must be positive", f.seq));
  if (f.batch < 0)
    return Status::invalid_argument(fmt::format("--batch {} must be positive", f.batch));
  if (f.global_batch < 0) {
    return Status::invalid_argument(
        fmt::format("--global-batch {} must be positive", f.global_batch));
  }
  o->seq = f.seq > 0 ? f.seq : std::min(128, o->config.n_positions);
  HR_ASSIGN_OR_RETURN(o->device_memory, device_budget(f.device_memory));
  if (!f.device_memory_file.empty()) {
    if (f.device_memory != "auto") {
      return Status::invalid_argument(fmt::format(
          "--device-memory {} and --device-memory-file {}: give one (the file holds the budget "
          "and may change while training runs)",
          f.device_memory, f.device_memory_file));
    }
    // With several ranks, each reads its own file ({rank} in the path) or the one shared file.
    HR_ASSIGN_OR_RETURN(o->device_memory, train::read_budget_file(train::budget_file_for_rank(
                                              f.device_memory_file, dist::launcher_rank())));
    o->device_memory_file = f.device_memory_file;
  }
  HR_ASSIGN_OR_RETURN(o->offload_memory, offload_budget(f.offload_memory, true));
  HR_ASSIGN_OR_RETURN(const std::optional<bool> offload_flag,
                      parse_offload(f.offload_activations, "--offload-activations"));
  const int global = f.global_batch > 0 ? f.global_batch : (f.batch > 0 ? f.batch * f.ranks : 8);
  // Data parallel: the global batch splits evenly over the ranks; micro-batch and accumulation
  // below are per rank (train/trainer.h).
  if (global % f.ranks != 0) {
    return Status::invalid_argument(fmt::format(
        "--global-batch {} must be divisible by the {} ranks (each computes an equal share)",
        global, f.ranks));
  }
  std::optional<int> zero;  // explicit --zero
  HR_ASSIGN_OR_RETURN(const std::optional<bool> offload,
                      parse_offload(f.offload_optimizer, "--offload-optimizer"));
  if (f.zero == "auto") {
    // With --plan auto the planner picks the stage (below); with a plan file, ZeRO-1: it sends
    // what stage 0 sends (reduce-scatter + all-gather = all-reduce) and holds less.
    o->zero_stage = f.ranks > 1 ? 1 : 0;
  } else if (f.zero == "0" || f.zero == "1" || f.zero == "2" || f.zero == "3") {
    zero = f.zero[0] - '0';
    o->zero_stage = *zero;
  } else {
    return Status::invalid_argument(fmt::format("--zero {}: use auto, 0, 1, 2 or 3", f.zero));
  }
  if (f.plan == "auto") {
    plan::SearchRequest req;
    req.config = o->config;
    HR_ASSIGN_OR_RETURN(req.device, resolve_device("cpu", f.device_memory, f.json));
    o->device = req.device;  // prices re-plans and the expected step time
    HR_RETURN_IF_ERROR(check_precision(f.precision, req.device));
    req.precision = f.precision;
    req.device_memory = o->device_memory;
    req.seq = o->seq;
    // With several ranks: the ZeRO-aware search over the job's ranks, each rank planned exactly
    // as the trainer allocates it (stages 0-3 with the executor's windows), so the chosen plan's
    // peak is the trainer's. An explicit --zero is a constraint; auto searches every stage.
    req.global_batch = global;
    req.devices = f.ranks;
    req.executor_layout = true;
    // Bucketed ranks run different numbers of micro-batches: no per-micro-batch windows (2-3).
    req.max_zero_stage = o->batching == data::Batching::kBucketed ? 1 : 3;
    if (f.ranks > 1) req.zero_stage = zero;
    if (f.batch > 0) req.micro_batch = f.batch;
    HR_ASSIGN_OR_RETURN(req.recompute, parse_recompute(f.recompute));
    HR_ASSIGN_OR_RETURN(req.offload_optimizer,
                        parse_offload(f.offload_optimizer, "--offload-optimizer"));
    req.offload_activations = offload_flag;
    req.offload_memory = o->offload_memory;
    req.sweep = !f.profile.empty();  // the report shows memory versus micro-batch
    HR_ASSIGN_OR_RETURN(plan::SearchResult res, plan::search_plan(req));
    if (!res.chosen) {
      return Status::out_of_memory(
          fmt::format("no plan for {} at seq {} and global batch {} fits the {} device budget.\n{}",
                      f.model, o->seq, global, format_bytes(o->device_memory), res.advice));
    }
    f.search = res;
    o->micro_batch = res.chosen->policy.micro_batch;
    o->exec = res.chosen->policy.exec;
    o->accumulation = res.chosen->policy.accumulation;
    if (f.ranks > 1) o->zero_stage = res.chosen->policy.zero_stage;
    o->offload_optimizer = res.chosen->policy.offload_optimizer;
    o->plan_note = fmt::format(
        "chosen by the planner: fastest of {} that fit, {} rejected; the "
        "largest micro-batch that fits is {}",
        res.candidates.size(), res.rejected.size(), res.max_micro_batch);
  } else {
    std::ifstream in(f.plan);
    if (!in) return Status::not_found(fmt::format("cannot open --plan '{}'", f.plan));
    json j;
    try {
      j = json::parse(in);
    } catch (const json::exception& e) {
      return Status::invalid_argument(
          fmt::format("--plan {}: not valid JSON: {}", f.plan, e.what()));
    }
    auto get_int = [&](const char* key, int* out) -> Status {
      if (!j.contains("chosen") || !j["chosen"].is_object() || !j["chosen"].contains(key) ||
          !j["chosen"][key].is_number_integer() || j["chosen"][key].get<int64_t>() <= 0) {
        return Status::invalid_argument(fmt::format(
            "--plan {}: field 'chosen.{}' is missing or not a positive integer (write the file "
            "with `headroom plan --json`)",
            f.plan, key));
      }
      *out = j["chosen"][key].get<int>();
      return Status::ok();
    };
    HR_RETURN_IF_ERROR(get_int("micro_batch", &o->micro_batch));
    HR_RETURN_IF_ERROR(get_int("accumulation", &o->accumulation));
    // Techniques (absent in older plan files: the defaults).
    const json& ch = j["chosen"];
    if (ch.contains("precision")) {
      if (!ch["precision"].is_string() ||
          (ch["precision"] != "fp32" && ch["precision"] != "bf16" && ch["precision"] != "fp16")) {
        return Status::invalid_argument(
            fmt::format("--plan {}: field 'chosen.precision' is {}; expected \"fp32\", \"bf16\" "
                        "or \"fp16\"",
                        f.plan, dump_json(ch["precision"])));
      }
      o->exec.precision = precision_of(ch["precision"].get<std::string>());
      if (f.precision != "auto" && f.precision != ch["precision"].get<std::string>()) {
        return Status::invalid_argument(
            fmt::format("--precision {} contradicts the plan's {} in {}", f.precision,
                        dump_json(ch["precision"]), f.plan));
      }
    } else if (f.precision == "bf16" || f.precision == "fp16") {
      o->exec.precision = precision_of(f.precision);
    }
    if (ch.contains("attention")) o->exec.tiled_attention = ch["attention"] != "plain";
    if (ch.contains("offload")) {
      if (ch["offload"] != "none" && ch["offload"] != "optimizer" &&
          ch["offload"] != "activations" && ch["offload"] != "all") {
        return Status::invalid_argument(
            fmt::format("--plan {}: field 'chosen.offload' is {}; expected \"none\", "
                        "\"optimizer\", \"activations\" or \"all\" (offload_per_block says which "
                        "blocks)",
                        f.plan, dump_json(ch["offload"])));
      }
      o->offload_optimizer = ch["offload"] == "optimizer" || ch["offload"] == "all";
    }
    if (offload && *offload != o->offload_optimizer) {
      return Status::invalid_argument(fmt::format(
          "--offload-optimizer {} contradicts the plan's offload {} in {}", f.offload_optimizer,
          ch.contains("offload") ? dump_json(ch["offload"]) : std::string("\"none\""), f.plan));
    }
    if (ch.contains("bf16_weights")) {
      if (ch["bf16_weights"] != "copy" && ch["bf16_weights"] != "cast per layer") {
        return Status::invalid_argument(fmt::format(
            "--plan {}: field 'chosen.bf16_weights' is {}; expected \"copy\" or \"cast per "
            "layer\"",
            f.plan, dump_json(ch["bf16_weights"])));
      }
      o->exec.bf16_weight_copy = ch["bf16_weights"] == "copy";
    }
    if (ch.contains("head_chunk")) {
      if (!ch["head_chunk"].is_number_integer() || ch["head_chunk"].get<int64_t>() < 0) {
        return Status::invalid_argument(fmt::format(
            "--plan {}: field 'chosen.head_chunk' must be a non-negative integer", f.plan));
      }
      o->exec.head_chunk = ch["head_chunk"].get<int>();
    }
    if (ch.contains("recompute_per_block")) {
      const json& rp = ch["recompute_per_block"];
      if (!rp.is_array() || (!rp.empty() && int(rp.size()) != o->config.n_layer)) {
        return Status::invalid_argument(fmt::format(
            "--plan {}: field 'chosen.recompute_per_block' must list one choice per block ({})",
            f.plan, o->config.n_layer));
      }
      for (const json& v : rp) {
        std::optional<model::Recompute> r;
        if (v.is_string()) {
          Result<std::optional<model::Recompute>> pr = parse_recompute(v.get<std::string>());
          if (pr.is_ok()) r = *pr;
        }
        if (!r) {
          return Status::invalid_argument(fmt::format(
              "--plan {}: 'chosen.recompute_per_block' has {}; use none, selective or full", f.plan,
              dump_json(v)));
        }
        o->exec.recompute.push_back(*r);
      }
    }
    if (ch.contains("offload_per_block")) {
      const json& op = ch["offload_per_block"];
      if (!op.is_array() || (!op.empty() && int(op.size()) != o->config.n_layer)) {
        return Status::invalid_argument(fmt::format(
            "--plan {}: field 'chosen.offload_per_block' must list one true/false per block ({})",
            f.plan, o->config.n_layer));
      }
      for (const json& v : op) {
        if (!v.is_boolean()) {
          return Status::invalid_argument(
              fmt::format("--plan {}: 'chosen.offload_per_block' has {}; use true or false", f.plan,
                          dump_json(v)));
        }
        o->exec.offload.push_back(v.get<bool>());
      }
      if (std::find(o->exec.offload.begin(), o->exec.offload.end(), true) ==
          o->exec.offload.end()) {
        o->exec.offload.clear();
      }
    }
    if (offload_flag && *offload_flag != !o->exec.offload.empty()) {
      return Status::invalid_argument(
          fmt::format("--offload-activations {} contradicts the plan in {}, which offloads {} "
                      "blocks",
                      f.offload_activations, f.plan, plan::offloaded_blocks(o->exec)));
    }
    int plan_seq = 0;
    HR_RETURN_IF_ERROR(get_int("seq", &plan_seq));
    if (f.seq > 0 && f.seq != plan_seq) {
      return Status::invalid_argument(
          fmt::format("--seq {} contradicts the plan's seq {} in {}", f.seq, plan_seq, f.plan));
    }
    o->seq = plan_seq;
    if (f.batch > 0 && f.batch != o->micro_batch) {
      return Status::invalid_argument(
          fmt::format("--batch {} contradicts the plan's micro-batch {} in {}", f.batch,
                      o->micro_batch, f.plan));
    }
    o->plan_note = "from " + f.plan;
    // The calibrated speeds price re-plans and the expected step time (nominal ones otherwise).
    Result<plan::DeviceSpec> dev = resolve_device("cpu", f.device_memory, f.json);
    if (dev.is_ok()) o->device = *dev;
  }
  // Note [Self-correction]: with this machine's measured terms, the run corrects the model by its
  // own op times (the correction kept next to the calibration), and with the micro-batch and
  // recomputation left to the planner re-plans by the corrected model.
  if (f.self_correct && o->device.terms.fitted) {
    o->self_correct.enabled = true;
    o->self_correct.cache_path = plan::corrections_path(plan::default_calibration_path());
    o->self_correct.machine_key =
        plan::correction_machine_key(plan::current_cpu_model(), plan::calibration_threads());
    o->self_correct.replan = f.plan == "auto" && f.batch == 0 && f.recompute == "auto" &&
                             f.ranks == 1 && f.device_memory_file.empty();
  }
  o->steps = f.steps;
  o->seed = f.seed;
  const int64_t nparams = model::gpt2_param_table(o->config).num_parameters;
  o->adamw.lr = f.lr > 0 ? f.lr : (nparams < 50'000'000 ? 1e-3f : 6e-4f);
  if (f.lr < 0 || !std::isfinite(f.lr)) {
    return Status::invalid_argument(fmt::format("--lr {} must be positive", f.lr));
  }
  o->warmup_steps = f.warmup >= 0 ? f.warmup : std::min(100, std::max(1, f.steps / 10));
  o->val_fraction = f.val_fraction;
  if (!(f.val_fraction >= 0 && f.val_fraction < 0.5)) {
    return Status::invalid_argument(
        fmt::format("--val-fraction {} must be in [0, 0.5)", f.val_fraction));
  }
  o->eval_every = f.eval_every;
  // Loss scaling (fp16 only; Note [Loss scaling]).
  HR_ASSIGN_OR_RETURN(o->loss_scale, train::parse_loss_scale(f.loss_scale));
  if (f.loss_scale_window <= 0) {
    return Status::invalid_argument(fmt::format(
        "--loss-scale-window {}: the good steps before the loss scale grows must be positive",
        f.loss_scale_window));
  }
  o->loss_scale.growth_interval = f.loss_scale_window;
  if (o->exec.precision != model::Precision::kFp16 &&
      (f.loss_scale != "dynamic" || f.loss_scale_window != 2000)) {
    return Status::invalid_argument(fmt::format(
        "--loss-scale {} / --loss-scale-window {}: loss scaling applies to --precision fp16 only "
        "(this run is {}, whose gradients need no scaling); drop the flag or use --precision fp16",
        f.loss_scale, f.loss_scale_window, model::precision_name(o->exec.precision)));
  }
  for (int k : f.inject_overflow) {
    if (k < 1) {
      return Status::invalid_argument(fmt::format("--inject-overflow-at {}: steps are 1-based", k));
    }
    o->inject_overflow_steps.push_back(k - 1);
  }
  if (f.data.empty()) {
    HR_ASSIGN_OR_RETURN(o->data, default_corpus(f.vocab, f.tokenizer));
  } else {
    o->data = f.data;
  }
  return Status::ok();
}

// The device to plan for: the CPU (measured by calibration, budget from --device-memory) or a
// named GPU from the spec table.
Result<plan::DeviceSpec> resolve_device(const std::string& device, const std::string& memory_flag,
                                        bool quiet) {
  if (device == "cpu") {
    HR_ASSIGN_OR_RETURN(uint64_t budget, device_budget(memory_flag));
    auto progress = [quiet](const std::string& line) {
      if (!quiet) log_info("calibrate: {}", line);
    };
    HR_ASSIGN_OR_RETURN(plan::Calibration cal,
                        plan::load_or_calibrate(plan::default_calibration_path(), progress));
    return plan::cpu_device_spec(cal, budget);
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

report::PlanCandidate plan_candidate(const plan::Candidate& c) {
  report::PlanCandidate p;
  p.micro_batch = c.policy.micro_batch;
  p.accumulation = c.policy.accumulation;
  p.precision = c.policy.precision;
  p.techniques = plan::describe_exec(c.policy.exec);
  p.peak_bytes = c.peak_bytes;
  p.lower_bound_bytes = c.lower_bound_bytes;
  p.predicted_tokens_per_s = c.cost.tokens_per_s;
  for (size_t i = 0; i < c.by_category.size(); i++) {
    if (c.by_category[i]) {
      p.by_category[std::string(memory::category_name(memory::Category(i)))] = c.by_category[i];
    }
  }
  return p;
}

// `--profile DIR`: trace.json, memory.json and report.html from what the run recorded: op spans
// and memory events from the event stream (train/step_events.h), trainer phases and kernels from
// the spans (docs/notes/report.md).
Status write_profile(const std::string& dir, const TrainFlags& f, const train::TrainOptions& o,
                     const train::TrainResult& r) {
  const train::ProfileRecord& rec = *r.profile;
  const plan::MemoryPlan& mp = rec.plan;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    return Status::io_error(
        fmt::format("cannot create --profile directory '{}': {}", dir, ec.message()));
  HR_ASSIGN_OR_RETURN(report::ChartLib lib, report::load_chart_lib());

  report::Profile p;
  p.title = "headroom profile: " + o.model_name;
  p.model = fmt::format("{} ({:.1f}M parameters), {} layers, d_model {}", o.model_name,
                        double(mp.params.num_parameters) / 1e6, o.config.n_layer, o.config.n_embd);
  p.device = fmt::format("cpu, budget {}", format_bytes(o.device_memory));
  p.run = fmt::format("seq {}, micro-batch {} x {} accumulation, {}, {}, {} steps", o.seq,
                      o.micro_batch, o.accumulation, model::precision_name(o.exec.precision),
                      plan::describe_exec(o.exec), o.steps);
  auto cat = [](memory::Category c) { return std::string(memory::category_name(c)); };
  // Spans: trainer phases, ops, kernels.
  for (const auto& sp : rec.spans) {
    if (sp.kind == "micro_batch") continue;  // the ops below cover it
    p.spans.push_back({sp.name, sp.kind,
                       sp.kind == "data" ? report::kThreadData : report::kThreadCompute,
                       sp.start_us, sp.dur_us, sp.step, sp.micro_batch, -1});
  }
  // Op spans from the recorded op_begin/op_end events, an end closing the latest open begin of the
  // same op on the same thread (the model's ops on the training thread; the optimizer step and the
  // data wait there too, the loader's fills on its own track); markers (re-plans, with their
  // cause) from marker events. Ops outside the schedule count as their phase ("optimizer",
  // "data") in the time per category, the loader's as "data loader (background)".
  const EventLog& log = rec.events.log();
  std::map<std::tuple<uint8_t, int32_t, uint32_t>, std::vector<const Event*>> open_ops;
  std::map<std::string, double> by_kind;
  for (const Event& e : log.events()) {
    if (e.kind == EventKind::kMarker) {
      p.markers.push_back({e.t_us, log.name(e.name), log.name(e.category), log.name(e.region)});
    } else if (e.kind == EventKind::kOpBegin) {
      open_ops[{e.thread, e.op, e.name}].push_back(&e);
    } else if (e.kind == EventKind::kOpEnd) {
      auto& open = open_ops[{e.thread, e.op, e.name}];
      if (open.empty()) continue;
      const Event& b = *open.back();
      open.pop_back();
      const bool scheduled = e.op >= 0;
      const std::string category = scheduled ? "op" : std::string(event_phase_name(e.phase));
      const int thread = e.thread == kEventThreadLoader ? report::kThreadData
                         : e.thread == kEventThreadCopy ? report::kThreadCopy
                                                        : report::kThreadCompute;
      p.spans.push_back({log.name(e.name), category, thread, b.t_us, e.t_us - b.t_us, e.step,
                         e.micro_batch, e.layer});
      if (!scheduled) {
        by_kind[thread == report::kThreadData   ? category + " loader (background)"
                : thread == report::kThreadCopy ? "offload copies (background)"
                                                : category] += (e.t_us - b.t_us) / 1e3;
      }
    }
  }
  for (const auto& k : rec.kernels) {
    std::string kind(model::op_kind_name(k.kind));
    p.spans.push_back({kind, kind, report::kThreadCompute, k.start_us, k.dur_us, -1, -1, -1});
    by_kind[kind] += k.dur_us / 1e3;
  }
  for (auto& [k, ms] : by_kind) p.time_by_category_ms[k] = ms / double(o.steps);
  // The cost model's figure for each of the kinds (docs/notes/cost-model.md), per step.
  const plan::StepCost predicted = plan::estimate_step(o.config, mp, o.device);
  for (size_t k = 0; k < plan::kCostKinds; k++) {
    p.predicted_time_by_category_ms[std::string(plan::cost_kind_name(plan::CostKind(k)))] =
        predicted.by_kind[k] * 1e3;
  }

  // Memory: the recorded allocations and releases (persistent regions at the start, each step
  // buffer from its first op's begin to its last op's end, every micro-batch).
  p.events = log;
  // The timeline shows the last step.
  for (const auto& sp : rec.spans) {
    if (sp.step != o.steps - 1) continue;
    if (p.window_start_us == 0 || sp.start_us < p.window_start_us) p.window_start_us = sp.start_us;
    p.window_end_us = std::max(p.window_end_us, sp.start_us + sp.dur_us);
  }
  // What was live at the peak: from the recorded events (right also after a re-plan); the plan's
  // peak op when nothing was recorded.
  p.live_at_peak = report::live_at_timeline_peak(p.events);
  if (p.live_at_peak.empty()) {
    for (const plan::Region& reg : mp.persistent) {
      for (size_t i = 0; i < reg.buffers.size(); i++) {
        p.live_at_peak.push_back({reg.buffers[i].name, cat(reg.buffers[i].category),
                                  reg.buffers[i].bytes(), reg.layout.offsets[i]});
      }
    }
    for (size_t i = 0; i < mp.step.buffers.size(); i++) {
      if (mp.first_op[i] <= mp.peak_op && mp.peak_op <= mp.last_op[i]) {
        const auto& b = mp.step.buffers[i];
        p.live_at_peak.push_back({b.name, cat(b.category), b.bytes(), mp.step.layout.offsets[i]});
      }
    }
  }
  p.peak_bytes = r.device_bytes_peak;
  p.planned_peak_bytes = mp.peak_bytes;
  p.arena_bytes = mp.peak_bytes;
  p.lower_bound_bytes = mp.lower_bound_bytes;
  p.budget_bytes = o.device_memory;
  if (f.search && f.search->chosen) {
    p.plan.chosen = plan_candidate(*f.search->chosen);
    for (size_t i = 1; i < f.search->candidates.size() && i < 6; i++) {
      p.plan.runners_up.push_back(plan_candidate(f.search->candidates[i]));
    }
    p.plan.planning_ms = f.search->planning_ms;
    for (const plan::Candidate& c : f.search->sweep) {
      report::SweepRow row;
      row.micro_batch = c.policy.micro_batch;
      row.planned_peak = c.peak_bytes;
      row.predicted_tokens_per_s = c.cost.tokens_per_s;
      row.fits = c.fits;
      row.techniques = plan::describe_exec(c.policy.exec);
      if (c.policy.micro_batch == o.micro_batch) {
        row.measured_peak = r.device_bytes_peak;
        row.measured_tokens_per_s = r.tokens_per_s;
      }
      p.sweep.push_back(row);
    }
  } else {
    p.plan.chosen.micro_batch = o.micro_batch;
    p.plan.chosen.accumulation = o.accumulation;
    p.plan.chosen.precision = std::string(model::precision_name(o.exec.precision));
    p.plan.chosen.techniques = plan::describe_exec(o.exec);
    p.plan.chosen.peak_bytes = mp.peak_bytes;
    p.plan.chosen.lower_bound_bytes = mp.lower_bound_bytes;
  }
  HR_RETURN_IF_ERROR(report::write_trace_json(p, dir + "/trace.json"));
  HR_RETURN_IF_ERROR(report::write_memory_json(p, dir + "/memory.json"));
  return report::write_html_report(p, dir + "/report.html", lib.js);
}

int run_train(TrainFlags& f) {
  // Under mpirun (or srun) one process per rank, each training its share of the global batch
  // (docs/notes/zero.md); otherwise one process. Only rank 0 prints and writes.
  Result<std::unique_ptr<dist::Communicator>> world = dist::make_world_communicator();
  if (!world.is_ok()) return fail(world.status());
  dist::Communicator& comm = **world;
  const int rank = comm.rank();
  f.ranks = comm.size();
  if (f.threads == 0 && f.ranks > 1) {
    // Ranks on one machine share its cores (Open MPI / MPICH name the ranks per node).
    const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (!local) local = std::getenv("MPI_LOCALNRANKS");
    const int per_node = local ? std::max(1, std::atoi(local)) : 1;
    set_threads(std::max(1, cpu::query_cpu_device().cores / per_node));
  } else {
    set_threads(f.threads);
  }
  if (rank != 0) f.json = true;  // quiet: no progress, no calibration lines
  train::TrainOptions o;
  o.comm = &comm;
  std::ofstream log;
  auto prepare = [&]() -> Status {
    HR_RETURN_IF_ERROR(resolve_train_options(f, &o));
    o.out_dir = f.out;
    o.save_every = f.save_every;
    o.keep_checkpoints = f.keep_checkpoints;
    o.resume = f.resume;
    o.eval_at_start = true;  // the summary's "validation loss A -> B"
    if (f.save_every < 0 || f.keep_checkpoints < 0) {
      return Status::invalid_argument("--save-every and --keep-checkpoints must not be negative");
    }
    o.profile = !f.profile.empty() && rank == 0;
    if (o.profile) {
      // Fail before training, not after, when the report cannot be written.
      HR_RETURN_IF_ERROR(report::load_chart_lib().status());
    }
    if (!f.log_json.empty() && rank == 0) {
      log.open(f.log_json, std::ios::trunc);
      if (!log) return Status::io_error(fmt::format("cannot write --log-json '{}'", f.log_json));
    }
    return Status::ok();
  };
  // Rank 0 first (it may calibrate this machine, which the others then read), then the rest;
  // each time all ranks agree, so a bad flag stops every rank with rank 0's message.
  const Status own = rank == 0 ? prepare() : Status::ok();
  Status prepared = own;
  if (f.ranks > 1) {
    prepared = dist::agree(comm, own);
    if (!own.is_ok()) prepared = own;  // rank 0's flag error, without the "rank 0: " prefix
    if (prepared.is_ok()) {
      if (rank != 0) prepared = prepare();
      prepared = dist::agree(comm, prepared);
    }
  }
  if (!prepared.is_ok()) return rank == 0 ? fail(prepared) : 1;
  std::unique_ptr<data::Tokenizer> tok;
  {
    Result<std::unique_ptr<data::Tokenizer>> t = run_tokenizer(f.tokenizer, f.vocab);
    if (t.is_ok()) tok = std::move(t).value();
  }

  report::ProgressBar bar;
  train::TrainCallbacks cb;
  cb.on_setup = [&](const train::SetupInfo& info) {
    if (f.json) return;
    std::fprintf(stderr,
                 "headroom train: %s, %.1fM parameters, micro-batch %d x seq %d, accumulation %d, "
                 "%d steps, lr %.2g\n",
                 o.model_name.c_str(), double(info.num_parameters) / 1e6, o.micro_batch, o.seq,
                 o.accumulation, o.steps, double(o.adamw.lr));
    if (f.ranks > 1) {
      std::fprintf(stderr,
                   "ranks: %s\n  global batch %d = %d ranks x micro-batch %d x accumulation %d; "
                   "per-rank planned peak %s (the memory plan below is one rank's)\n",
                   train::describe_ranks(f.ranks, o.zero_stage).c_str(),
                   f.ranks * o.micro_batch * o.accumulation, f.ranks, o.micro_batch, o.accumulation,
                   format_bytes(info.planned_bytes).c_str());
    }
    std::fprintf(stderr, "plan: %s\n  %s, %s\n", o.plan_note.c_str(),
                 std::string(model::precision_name(o.exec.precision)).c_str(),
                 plan::describe_exec(o.exec).c_str());
    std::fprintf(stderr, "data: %s (%lld train / %lld validation tokens)\n", o.data.c_str(),
                 static_cast<long long>(info.train_tokens),
                 static_cast<long long>(info.val_tokens));
    std::fprintf(
        stderr, "device: cpu, %d threads, budget %s%s\nmemory plan:\n%s", omp_get_max_threads(),
        format_bytes(o.device_memory).c_str(),
        o.device_memory_file.empty()
            ? ""
            : fmt::format(" (from {}, read before every step)", o.device_memory_file).c_str(),
        info.memory_table.c_str());
    if (!info.offload_table.empty()) {
      std::string what;
      if (info.offload_optimizer) {
        what =
            "optimizer offload: AdamW runs on the offload tier; per step the gradients go there "
            "and the updated weights come back";
      }
      if (info.offloaded_blocks > 0) {
        what += fmt::format(
            "{}activation offload: {} blocks' saved activations wait there "
            "between their forward and backward",
            what.empty() ? "" : "; ", info.offloaded_blocks);
      }
      std::fprintf(stderr, "%s (offload tier: host memory, one budget %s)\n%s", what.c_str(),
                   format_bytes(info.offload_budget).c_str(), info.offload_table.c_str());
    }
    std::fprintf(stderr, "expected step time: %.0f ms (cost model; speeds %s)\n",
                 info.predicted_step_ms, info.device_source.c_str());
    if (!info.batching.empty()) std::fprintf(stderr, "batching: %s\n", info.batching.c_str());
  };
  cb.on_step = [&](const train::StepStats& s) {
    if (rank != 0) return;  // every rank's step is the same step
    if (log.is_open()) log << dump_json(step_json(s)) << "\n" << std::flush;
    // Re-plans, recoveries and their memory reports are logged in every mode (stderr).
    for (const std::string& e : s.events) {
      f.json ? (void)std::fprintf(stderr, "%s\n", e.c_str()) : bar.println(e);
    }
    for (const std::string& r : s.oom_reports) {
      f.json ? (void)std::fprintf(stderr, "%s", r.c_str()) : bar.println(r);
    }
    if (f.json) return;
    // Memory: in use / budget, then the step's measured peak against the plan's, and the
    // fragmentation: the peak over the most bytes live at one moment (1.00x: no byte wasted).
    std::string text = fmt::format(
        "loss {:.4f}  lr {:.2e}  {:.0f} tok/s  mem {} / {}  peak {} (plan {}, frag {:.2f}x)",
        s.loss, s.lr, s.tokens_per_s, format_bytes(s.device_bytes_in_use),
        format_bytes(s.device_budget), format_bytes(s.device_bytes_peak),
        format_bytes(s.planned_peak_bytes),
        s.lower_bound_bytes ? double(s.device_bytes_peak) / double(s.lower_bound_bytes) : 1.0);
    if (s.planned_offload_bytes) {
      text += fmt::format("  offload {} (plan {})", format_bytes(s.offload_bytes_peak),
                          format_bytes(s.planned_offload_bytes));
    }
    if (s.val_loss)
      bar.println(fmt::format("step {}: validation loss {:.4f}", s.step, *s.val_loss));
    if (!s.checkpoint.empty())
      bar.println(fmt::format("step {}: checkpoint {}", s.step, s.checkpoint));
    bar.update(s.step, s.steps, text);
  };
  cb.on_initial_validation = [&](double loss) {
    if (rank != 0 || f.json) return;
    bar.println(fmt::format("validation loss {:.4f} before the first step", loss));
  };
  std::string sample_text;
  cb.on_finish = [&](const model::Gpt2Config& cfg, const float* params,
                     memory::MemoryResource* device) -> Status {
    if (!tok || f.sample_tokens <= 0 || rank != 0) return Status::ok();
    train::SampleOptions so;
    so.max_new_tokens = f.sample_tokens;
    so.temperature = 0.8f;
    so.top_k = 40;
    so.seed = f.seed;
    so.stop_token = tok->eos_token();
    HR_ASSIGN_OR_RETURN(
        std::vector<int32_t> ids,
        train::sample_tokens(cfg, params, {std::max(tok->eos_token(), 0)}, so, device));
    if (!ids.empty() && ids.back() == tok->eos_token()) ids.pop_back();
    sample_text = tok->decode(ids);
    return Status::ok();
  };
  Result<train::TrainResult> r = train::run_training(o, cb);
  bar.finish();
  if (!r.is_ok()) return rank == 0 ? fail(r.status()) : 1;  // every rank has the same status
  // Every rank's measured and planned peak, for rank 0's report (a sum of one-hot vectors).
  std::vector<double> peaks(size_t(2 * f.ranks), 0.0);
  peaks[size_t(2 * rank)] = double(r->device_bytes_peak);
  peaks[size_t(2 * rank + 1)] = double(r->planned_peak_bytes);
  if (Status s = comm.all_reduce(peaks.data(), int64_t(peaks.size())); !s.is_ok()) return fail(s);
  if (rank != 0) return 0;
  if (o.profile) {
    if (Status s = write_profile(f.profile, f, o, *r); !s.is_ok()) return fail(s);
    if (!f.json) {
      std::fprintf(stderr,
                   "profile: %s/trace.json (Perfetto, chrome://tracing), %s/report.html, "
                   "%s/memory.json\n",
                   f.profile.c_str(), f.profile.c_str(), f.profile.c_str());
    }
  }
  if (f.json) {
    json j = {{"final_loss", r->final_loss},
              {"tokens_per_s", r->tokens_per_s},
              {"device_bytes_peak", r->device_bytes_peak},
              {"planned_peak_bytes", r->planned_peak_bytes},
              {"lower_bound_bytes", r->lower_bound_bytes},
              {"out", o.out_dir},
              {"sample", sample_text},
              {"ranks", f.ranks},
              {"zero", o.zero_stage},
              {"batching", data::batching_name(o.batching)},
              {"padding", r->padding},
              {"offload", offload_kind(o.offload_optimizer, plan::offloaded_blocks(o.exec) > 0)}};
    if (r->planned_offload_bytes > 0) {
      j["offload_bytes_peak"] = r->offload_bytes_peak;
      j["planned_offload_bytes"] = r->planned_offload_bytes;
      j["offload_memory"] = o.offload_memory;
    }
    if (o.batching == data::Batching::kBucketed) {
      j["bucket"] = o.bucket;
      j["shape_plans"] = r->shape_plans;
      j["shape_plan_hits"] = r->shape_plan_hits;
    }
    if (f.ranks > 1) {
      json per_rank = json::array();
      for (int i = 0; i < f.ranks; i++) {
        per_rank.push_back({{"rank", i},
                            {"device_bytes_peak", uint64_t(peaks[size_t(2 * i)])},
                            {"planned_peak_bytes", uint64_t(peaks[size_t(2 * i + 1)])}});
      }
      j["per_rank"] = per_rank;
    }
    if (r->initial_val_loss) j["initial_val_loss"] = *r->initial_val_loss;
    if (r->final_val_loss) j["final_val_loss"] = *r->final_val_loss;
    // The sample may end inside a multi-byte character: U+FFFD for invalid UTF-8, never throw.
    std::printf("%s\n", dump_json(j, 2).c_str());
    return 0;
  }
  std::fprintf(stderr, "done: loss %.4f", r->final_loss);
  if (r->final_val_loss) {
    if (r->initial_val_loss) {
      std::fprintf(stderr, ", validation loss %.4f -> %.4f", *r->initial_val_loss,
                   *r->final_val_loss);
    } else {
      std::fprintf(stderr, ", validation loss %.4f", *r->final_val_loss);
    }
  }
  std::fprintf(stderr, ", median %.0f tokens/s", r->tokens_per_s);
  if (o.batching == data::Batching::kBucketed) {
    std::fprintf(stderr, " (real tokens; padding %.1f%%, %llu micro-batch shapes planned)",
                 100.0 * r->padding, static_cast<unsigned long long>(r->shape_plans));
  }
  std::fprintf(stderr, "\n");
  std::fprintf(
      stderr,
      "device memory: peak %s measured, %s planned, lower bound %s (fragmentation "
      "%.3fx), budget %s\n",
      format_bytes(r->device_bytes_peak).c_str(), format_bytes(r->planned_peak_bytes).c_str(),
      format_bytes(r->lower_bound_bytes).c_str(),
      r->lower_bound_bytes ? double(r->planned_peak_bytes) / double(r->lower_bound_bytes) : 1.0,
      format_bytes(o.device_memory).c_str());
  if (r->planned_offload_bytes > 0) {
    std::fprintf(stderr, "offload tier: peak %s measured, %s planned, budget %s\n",
                 format_bytes(r->offload_bytes_peak).c_str(),
                 format_bytes(r->planned_offload_bytes).c_str(),
                 format_bytes(o.offload_memory).c_str());
  }
  for (int i = 0; i < f.ranks && f.ranks > 1; i++) {
    std::fprintf(stderr, "  rank %d: peak %s measured, %s planned\n", i,
                 format_bytes(uint64_t(peaks[size_t(2 * i)])).c_str(),
                 format_bytes(uint64_t(peaks[size_t(2 * i + 1)])).c_str());
  }
  // The tokenizer travels with the model, so that generate (and any HF program) finds it.
  if (!f.tokenizer.empty()) {
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                             "special_tokens_map.json", "encoder.json", "vocab.bpe"}) {
      std::error_code ec;
      const fs::path src = fs::path(f.tokenizer) / name;
      if (!fs::exists(src, ec) || fs::equivalent(f.tokenizer, o.out_dir, ec)) continue;
      fs::copy_file(src, fs::path(o.out_dir) / name, fs::copy_options::overwrite_existing, ec);
      if (ec) log_warn("could not copy {} into {}: {}", src.string(), o.out_dir, ec.message());
    }
  }
  std::fprintf(stderr, "model saved to %s/ (config.json, model.safetensors%s)\n", o.out_dir.c_str(),
               f.tokenizer.empty() ? "" : ", the tokenizer");
  if (!sample_text.empty()) std::printf("sample:\n%s\n", sample_text.c_str());
  return 0;
}

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

int run_generate(GenerateFlags& f) {
  set_threads(f.threads);
  Result<model::Gpt2Config> cfg = model::load_config_file(f.model_dir + "/config.json");
  if (!cfg.is_ok()) return fail(cfg.status());
  Result<std::unique_ptr<data::Tokenizer>> loaded =
      run_tokenizer(model_dir_tokenizer(f.model_dir), f.vocab);
  if (!loaded.is_ok()) return fail(loaded.status());
  const std::unique_ptr<data::Tokenizer>& tok = *loaded;
  if (tok->vocab_size() > cfg->vocab_size) {
    return fail(Status::invalid_argument(
        fmt::format("{}/config.json: vocab_size {} is smaller than the tokenizer's {}", f.model_dir,
                    cfg->vocab_size, tok->vocab_size())));
  }
  const model::ParamTable table = model::gpt2_param_table(*cfg);
  memory::HostResource host_upstream;
  memory::TrackingResource host(&host_upstream);  // measured against the generation plan
  Result<memory::Arena> params = memory::Arena::create(
      &host, {{"parameters", DType::kF32, Shape{table.total_floats}, memory::Category::kWeights}},
      memory::sequential_layout(
          {{"parameters", DType::kF32, Shape{table.total_floats}, memory::Category::kWeights}}),
      memory::Category::kWeights);
  if (!params.is_ok()) return fail(params.status());
  if (Status s = model::load_pretrained(f.model_dir, table, params->f32(0)); !s.is_ok()) {
    return fail(s);
  }
  std::vector<int32_t> prompt = tok->encode(f.prompt);
  // An empty prompt starts a new document: after the end-of-document token, or the bos token.
  if (prompt.empty())
    prompt.push_back(tok->eos_token() >= 0 ? tok->eos_token() : std::max(tok->bos_token(), 0));
  train::SampleOptions so;
  so.max_new_tokens = f.max_new_tokens;
  so.temperature = f.temperature;
  so.top_k = f.top_k;
  so.seed = f.seed;
  so.stop_token = tok->eos_token();
  // The plan sample_tokens allocates by (docs/notes/generation.md): printed before the first
  // token, on stderr so that stdout is the text.
  const plan::GenerationPlan gp = plan::plan_generation(
      *cfg, int(std::min<size_t>(prompt.size(), size_t(cfg->n_positions))), f.max_new_tokens);
  if (!f.json) {
    std::fprintf(stderr,
                 "memory (planned): weights %s, KV cache %s (%d positions x %d layers x %d kv "
                 "heads), activations and logits %s (a pass of up to %d tokens); peak %s\n",
                 format_bytes(gp.weights_bytes).c_str(), format_bytes(gp.cache_layout.size).c_str(),
                 gp.shape.context, cfg->n_layer, cfg->kv_heads(),
                 format_bytes(gp.work_layout.size).c_str(), gp.shape.rows,
                 format_bytes(gp.peak_bytes).c_str());
    std::printf("%s", f.prompt.c_str());
  }
  Result<std::vector<int32_t>> ids =
      train::sample_tokens(*cfg, params->f32(0), prompt, so, &host, [&](int32_t t) {
        if (!f.json && t != tok->eos_token()) {
          std::printf("%s", tok->decode(std::span<const int32_t>(&t, 1)).c_str());
          std::fflush(stdout);
        }
      });
  if (!ids.is_ok()) return fail(ids.status());
  if (f.json) {
    // A byte-level BPE completion may stop inside a multi-byte character, and a prompt may be any
    // bytes: the text fields are lossy where they are not UTF-8 (U+FFFD; docs/notes/json-text.md),
    // the token ids exact. `tokens` are the completion's ids (the end-of-text token included when
    // sampling stopped on it), `prompt_tokens` the prompt's as the model saw them.
    std::vector<int32_t> out = *ids;
    if (!out.empty() && out.back() == tok->eos_token()) out.pop_back();
    const std::string completion = tok->decode(out);
    json j = {{"prompt", f.prompt},
              {"completion", completion},
              {"tokens", *ids},
              {"prompt_tokens", prompt},
              {"text_is_exact", is_valid_utf8(f.prompt) && is_valid_utf8(completion)},
              {"memory",
               {{"weights_bytes", gp.weights_bytes},
                {"kv_cache_bytes", gp.cache_layout.size},
                {"activations_bytes", gp.work_layout.size},
                {"context", gp.shape.context},
                {"planned_peak_bytes", gp.peak_bytes},
                {"measured_peak_bytes", host.stats().peak}}}};
    std::printf("%s\n", dump_json(j, 2).c_str());
  } else {
    std::printf("\n");
    std::fprintf(stderr, "measured peak %s (planned %s)\n", format_bytes(host.stats().peak).c_str(),
                 format_bytes(gp.peak_bytes).c_str());
  }
  return 0;
}

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

int run_prepare(PrepareFlags& f) {
  data::PrepareOptions po;
  po.inputs = f.inputs;
  po.out = f.out;
  po.doc_separator = f.separator;
  po.vocab_dir = f.vocab;
  po.tokenizer_dir = f.tokenizer;
  po.field = f.field;
  // A progress bar on large inputs (the read, then the tokeniser), where it is worth a line.
  constexpr uint64_t kProgressBytes = 16ull << 20;
  report::ProgressBar bar;
  if (!f.json) {
    po.progress = [&bar, last = std::string(), big = false](const char* stage, uint64_t done,
                                                            uint64_t total) mutable {
      // Large by the inputs' size (the read stage comes first): JSON Lines' documents are
      // smaller than their files.
      if (std::string_view(stage) == "read") big = total >= kProgressBytes;
      if (!big) return;
      const std::string at = fmt::format("{} {}", stage, done);
      if (at == last) return;  // the same figure once
      last = at;
      bar.update(long(done >> 20), long(std::max<uint64_t>(1, total >> 20)),
                 fmt::format("MiB {}", std::string_view(stage) == "read" ? "read" : "tokenised"));
      if (done == total) bar.finish();
    };
  }
  Result<data::PrepareStats> st = data::prepare_token_file(po);
  if (!st.is_ok()) return fail(st.status());
  if (f.json) {
    json j = {{"out", f.out},
              {"files", st->files},
              {"documents", st->documents},
              {"tokens", st->tokens},
              {"bytes", st->bytes},
              {"seconds", st->seconds},
              {"tokenizer", st->tokenizer},
              {"vocab_size", st->vocab_size},
              {"eot", st->eot}};
    std::printf("%s\n", dump_json(j, 2).c_str());
  } else {
    std::printf(
        "%s: %llu documents, %llu tokens from %llu files (%s of text) in %.1f s (tokenizer %s, "
        "vocab %d)\n",
        f.out.c_str(), static_cast<unsigned long long>(st->documents),
        static_cast<unsigned long long>(st->tokens), static_cast<unsigned long long>(st->files),
        format_bytes(st->bytes).c_str(), st->seconds, st->tokenizer.c_str(), st->vocab_size);
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
struct PlanFlags {
  TrainFlags t;
  int devices = 1;
  std::string zero = "auto";  // --zero auto|0|1|2|3
  bool sweep = false;
};

int run_plan(PlanFlags& pf) {
  TrainFlags& f = pf.t;
  set_threads(f.threads);
  Result<model::Gpt2Config> cfg = model::resolve_model(f.model);
  if (!cfg.is_ok()) return fail(cfg.status());
  Result<plan::DeviceSpec> dev = resolve_device(f.device, f.device_memory, f.json);
  if (!dev.is_ok()) return fail(dev.status());
  if (Status st = check_precision(f.precision, *dev); !st.is_ok()) return fail(st);
  plan::SearchRequest req;
  req.precision = f.precision;
  req.config = *cfg;
  req.device = *dev;
  req.device_memory = dev->memory_bytes;
  req.devices = pf.devices;
  req.seq = f.seq > 0 ? f.seq : std::min(128, cfg->n_positions);
  req.global_batch = f.global_batch > 0 ? f.global_batch : (f.batch > 0 ? f.batch * pf.devices : 8);
  if (f.batch > 0) req.micro_batch = f.batch;
  req.sweep = pf.sweep;
  Result<std::optional<model::Recompute>> rc = parse_recompute(f.recompute);
  if (!rc.is_ok()) return fail(rc.status());
  req.recompute = *rc;
  Result<std::optional<bool>> off = parse_offload(f.offload_optimizer, "--offload-optimizer");
  if (!off.is_ok()) return fail(off.status());
  req.offload_optimizer = *off;
  Result<uint64_t> off_budget = offload_budget(f.offload_memory, dev->kind == "cpu");
  if (!off_budget.is_ok()) return fail(off_budget.status());
  req.offload_memory = *off_budget;
  Result<std::optional<bool>> off_act =
      parse_offload(f.offload_activations, "--offload-activations");
  if (!off_act.is_ok()) return fail(off_act.status());
  req.offload_activations = *off_act;
  if (pf.zero != "auto") {
    if (pf.zero.size() != 1 || pf.zero[0] < '0' || pf.zero[0] > '3') {
      return fail(
          Status::invalid_argument(fmt::format("--zero {}: use auto, 0, 1, 2 or 3", pf.zero)));
    }
    req.zero_stage = pf.zero[0] - '0';
  }
  if (dev->kind == "cpu") {
    // Plan what `headroom train` runs here under mpirun: each rank exactly as the trainer
    // allocates it (docs/notes/zero.md). Named GPUs are planned as ZeRO designs them.
    req.executor_layout = true;
    req.max_zero_stage = 3;
  }
  Result<plan::SearchResult> r = plan::search_plan(req);
  if (!r.is_ok()) return fail(r.status());
  const int64_t nparams = model::gpt2_param_table(*cfg).num_parameters;

  if (f.json) {
    json j;
    j["model"] = {
        {"name", f.model},       {"n_layer", cfg->n_layer},       {"n_head", cfg->n_head},
        {"n_embd", cfg->n_embd}, {"vocab_size", cfg->vocab_size}, {"n_positions", cfg->n_positions},
        {"parameters", nparams}};
    j["device"] = {
        {"name", dev->name},
        {"memory_bytes", dev->memory_bytes},
        {"flops_fp32", dev->flops_fp32},
        {"mem_bandwidth", dev->mem_bandwidth},
        {"interconnect_bandwidth", dev->interconnect_bandwidth},
        {"host_link_bandwidth", dev->host_link_bandwidth},
        {"offload_link_bandwidth", plan::offload_link_bandwidth(*dev)},
        {"host_memory_bandwidth",
         dev->host_memory_bandwidth > 0 ? dev->host_memory_bandwidth : dev->mem_bandwidth},
        {"source", dev->source}};
    j["offload_memory"] = req.offload_memory;
    j["devices"] = pf.devices;
    j["seq"] = req.seq;
    j["global_batch"] = req.global_batch;
    j["chosen"] = r->chosen ? candidate_json(*r->chosen) : json(nullptr);
    j["candidates"] = json::array();
    for (const auto& c : r->candidates) j["candidates"].push_back(candidate_json(c));
    j["rejected"] = json::array();
    for (const auto& c : r->rejected) j["rejected"].push_back(candidate_json(c));
    j["max_micro_batch"] = r->max_micro_batch;
    if (pf.sweep) {
      j["sweep"] = json::array();
      for (const auto& c : r->sweep) j["sweep"].push_back(candidate_json(c));
    }
    if (!r->advice.empty()) j["advice"] = r->advice;
    j["planning_ms"] = r->planning_ms;
    std::printf("%s\n", dump_json(j, 2).c_str());
    return r->chosen ? 0 : 3;
  }

  std::printf(
      "headroom plan: %s (%.1fM parameters), seq %d, global batch %d, %d x %s "
      "(%s each; %s)\n",
      f.model.c_str(), double(nparams) / 1e6, req.seq, req.global_batch, pf.devices,
      dev->name.c_str(), format_bytes(dev->memory_bytes).c_str(), dev->source.c_str());
  const bool multi = pf.devices > 1;
  // " ZeRO-2," for several devices: the stage of a candidate in the lists below.
  auto stage_of = [&](const plan::Candidate& o) {
    return multi ? fmt::format(" ZeRO-{},", o.policy.zero_stage) : std::string();
  };
  if (r->chosen) {
    const plan::Candidate& c = *r->chosen;
    const int n_off = plan::offloaded_blocks(c.policy.exec);
    std::printf("\nchosen: micro-batch %d x %d accumulation steps%s, %s, %s, %s%s\n",
                c.policy.micro_batch, c.policy.accumulation, multi ? " per device" : "",
                c.policy.precision.c_str(), plan::describe_exec(c.policy.exec).c_str(),
                multi ? fmt::format("ZeRO stage {}, ", c.policy.zero_stage).c_str() : "",
                c.policy.offload_optimizer && n_off > 0 ? "optimizer and activation offload"
                : c.policy.offload_optimizer            ? "optimizer offload"
                : n_off > 0                             ? "activation offload"
                                                        : "no offload");
    const std::vector<std::string> per_block = plan::schedule_per_block(
        c.policy.exec, int(std::max(c.policy.exec.recompute.size(), c.policy.exec.offload.size())));
    if (!per_block.empty()) {
      // Runs of equal choices: "0-3: full, 4-9: offload, 10-11: none".
      std::string line;
      for (size_t l = 0; l < per_block.size();) {
        size_t end = l;
        while (end + 1 < per_block.size() && per_block[end + 1] == per_block[l]) end++;
        line +=
            fmt::format("{}{}: {}", l ? ", " : "",
                        end > l ? fmt::format("{}-{}", l, end) : std::to_string(l), per_block[l]);
        l = end + 1;
      }
      std::printf("  per block: %s\n", line.c_str());
    }
    if (n_off > 0) {
      const double bw = plan::offload_link_bandwidth(*dev);
      std::printf(
          "  activation offload: %d blocks, %s in the offload tier (budget %s%s); %s moved per "
          "step at %.1f GB/s, %.0f ms of it not hidden behind compute\n",
          n_off, format_bytes(c.offload_activation_bytes).c_str(),
          format_bytes(req.offload_memory).c_str(),
          c.policy.offload_optimizer ? fmt::format(", shared with the optimizer state: {} in all",
                                                   format_bytes(c.offload_bytes))
                                           .c_str()
                                     : "",
          format_bytes(uint64_t(c.cost.activation_offload_bytes)).c_str(), bw / 1e9,
          c.cost.activation_offload_seconds * 1e3);
    }
    std::printf(
        "  peak %s per device (lower bound %s), predicted %.0f tokens/s%s (%.0f ms a step)\n",
        format_bytes(c.peak_bytes).c_str(), format_bytes(c.lower_bound_bytes).c_str(),
        c.cost.tokens_per_s, multi ? " over all devices" : "", c.cost.step_seconds * 1e3);
    if (multi) {
      std::printf(
          "  step time: %.0f ms compute (GEMMs %.0f, memory-bound %.0f) + %.0f ms communication\n"
          "  communication: %s sent per device per step (ring collectives of ZeRO-%d), %.0f ms at "
          "%.1f GB/s (%s; not overlapped with compute)\n",
          (c.cost.gemm_seconds + c.cost.memory_seconds) * 1e3, c.cost.gemm_seconds * 1e3,
          c.cost.memory_seconds * 1e3, c.cost.comm_seconds * 1e3,
          format_bytes(uint64_t(c.cost.comm_bytes)).c_str(), c.policy.zero_stage,
          c.cost.comm_seconds * 1e3, dev->interconnect_bandwidth / 1e9,
          dev->kind == "cpu" ? "shared-memory MPI, measured" : "interconnect, datasheet x 0.8");
    }
    if (c.policy.offload_optimizer) {
      const double host_bw =
          dev->host_memory_bandwidth > 0 ? dev->host_memory_bandwidth : dev->mem_bandwidth;
      std::printf(
          "  optimizer offload: %s%s in the offload tier (fp32 master weights, AdamW m and v, "
          "the gradient copy%s)%s\n"
          "    per step %s over the host link (gradients out, weights back): %.0f ms at %.1f "
          "GB/s (%s), and AdamW on the host: %.0f ms at %.1f GB/s (%s); not overlapped\n",
          format_bytes(c.offload_bytes - c.offload_activation_bytes).c_str(),
          multi ? " per device" : "", multi && c.policy.zero_stage > 0 ? ", this rank's shard" : "",
          req.offload_memory ? fmt::format(", budget {}", format_bytes(req.offload_memory)).c_str()
                             : ", budget not limited",
          format_bytes(uint64_t(c.cost.offload_bytes - c.cost.activation_offload_bytes)).c_str(),
          (c.cost.offload_seconds - c.cost.activation_offload_seconds) * 1e3,
          plan::offload_link_bandwidth(*dev) / 1e9,
          dev->kind == "cpu" ? "memcpy, measured" : "host link, datasheet x 0.8",
          c.cost.host_optimizer_seconds * 1e3, host_bw / 1e9,
          dev->kind == "cpu" ? "triad, measured" : "assumed host share");
    }
    std::printf("\nmemory%s at the peak (%s):\n%s", multi ? " per device" : "",
                r->chosen_plan->ops[size_t(r->chosen_plan->peak_op)].name.c_str(),
                plan::category_table(*r->chosen_plan, dev->memory_bytes).c_str());
    if (c.offload_bytes > 0 && !multi) {
      std::printf("\noffload tier:\n%s",
                  plan::offload_table(*r->chosen_plan, req.offload_memory).c_str());
    }
    if (r->candidates.size() > 1) {
      std::printf("\nrunners-up:\n");
      for (size_t i = 1; i < r->candidates.size() && i < 6; i++) {
        const plan::Candidate& o = r->candidates[i];
        std::printf("  micro-batch %3d x %3d:%s %s%s, peak %10s, predicted %6.0f tokens/s (%s)\n",
                    o.policy.micro_batch, o.policy.accumulation, stage_of(o).c_str(),
                    o.policy.precision.c_str(),
                    o.policy.offload_optimizer ? ", optimizer offload" : "",
                    format_bytes(o.peak_bytes).c_str(), o.cost.tokens_per_s,
                    plan::describe_exec(o.policy.exec).c_str());
      }
    }
  }
  if (!r->rejected.empty()) {
    // The leanest first; with several precisions and stages, the ten leanest.
    std::vector<plan::Candidate> rejected = r->rejected;
    std::stable_sort(rejected.begin(), rejected.end(),
                     [](const plan::Candidate& a, const plan::Candidate& b) {
                       return a.peak_bytes < b.peak_bytes;
                     });
    std::printf("\nrejected:\n");
    for (size_t i = 0; i < rejected.size() && i < 10; i++) {
      const plan::Candidate& o = rejected[i];
      std::printf("  micro-batch %3d x %3d:%s %s%s: %s\n", o.policy.micro_batch,
                  o.policy.accumulation, stage_of(o).c_str(), o.policy.precision.c_str(),
                  o.policy.offload_optimizer ? ", optimizer offload" : "",
                  o.rejected_because.c_str());
    }
    if (rejected.size() > 10) {
      std::printf("  ... and %zu more (--json lists them all)\n", rejected.size() - 10);
    }
  }
  if (pf.sweep) {
    std::printf(
        "\nmemory versus micro-batch (seq %d; the fastest technique that fits, else the "
        "leanest):\n  %11s %12s %9s %14s %5s  %s\n",
        req.seq, "micro-batch", "planned peak", "of device", "tokens/s (est)", "fits",
        "techniques");
    for (const auto& o : r->sweep) {
      std::printf("  %11d %11s%s %8.1f%% %14.0f %5s  %s\n", o.policy.micro_batch,
                  format_bytes(o.peak_bytes).c_str(), o.placed ? " " : "+",
                  100.0 * double(o.peak_bytes) / double(dev->memory_bytes), o.cost.tokens_per_s,
                  o.fits ? "yes" : "no", plan::describe_exec(o.policy.exec).c_str());
    }
    std::printf("  (+: at least this much: rejected on the lower bound, never placed)\n");
  }
  std::printf("\nlargest micro-batch that fits: %d\n", r->max_micro_batch);
  if (!r->advice.empty()) std::printf("\n%s", r->advice.c_str());
  std::printf("planned in %.1f ms (%d offset plans placed)\n", r->planning_ms, r->plans_placed);
  return r->chosen ? 0 : 3;
}

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

// `bench --alternate VAR=A,B`: the knobs read at every call, which a step can switch (the others
// are read once a process). An empty value unsets the variable (the knob's default).
struct Alternation {
  std::string var;
  std::array<std::string, 2> values;
  void apply(int which) const {
    const std::string& v = values[size_t(which)];
    if (v.empty()) {
      ::unsetenv(var.c_str());
    } else {
      ::setenv(var.c_str(), v.c_str(), 1);
    }
  }
};

Result<std::optional<Alternation>> parse_alternation(const std::string& spec) {
  if (spec.empty()) return std::optional<Alternation>();
  static constexpr std::array<const char*, 3> kKnobs = {
      "HEADROOM_BF16_GEMM", "HEADROOM_BF16_WGRAD_TRANSPOSE", "HEADROOM_GELU_TABLE"};
  const size_t eq = spec.find('='), comma = spec.find(',', eq == std::string::npos ? 0 : eq);
  if (eq == std::string::npos || comma == std::string::npos ||
      spec.find(',', comma + 1) != std::string::npos) {
    return Status::invalid_argument("--alternate " + spec +
                                    ": expected VAR=A,B (two values, either may be empty)");
  }
  Alternation a{spec.substr(0, eq), {spec.substr(eq + 1, comma - eq - 1), spec.substr(comma + 1)}};
  if (std::ranges::none_of(kKnobs, [&](const char* k) { return a.var == k; })) {
    return Status::invalid_argument("--alternate: " + a.var +
                                    " is not a knob read at every call; alternate "
                                    "HEADROOM_BF16_GEMM, HEADROOM_BF16_WGRAD_TRANSPOSE or "
                                    "HEADROOM_GELU_TABLE");
  }
  const char* before = std::getenv(a.var.c_str());
  const std::string saved = before ? before : "";
  Status bad = Status::ok();
  for (int i = 0; i < 2 && bad.is_ok(); ++i) {
    a.apply(i);
    try {  // the knob's own check, as the CLI does for the environment's value
      (void)cpu::bf16_wgrad_transposes(1, 1, 1);
      (void)cpu::amx_gemm_takes(32, DType::kF32);
      (void)cpu::gelu_by_table();
    } catch (const std::invalid_argument& e) {
      bad = Status::invalid_argument(std::string("--alternate: ") + e.what());
    }
  }
  if (before) {
    ::setenv(a.var.c_str(), saved.c_str(), 1);
  } else {
    ::unsetenv(a.var.c_str());
  }
  if (!bad.is_ok()) return bad;
  return std::optional<Alternation>(a);
}

int run_bench(BenchFlags& bf) {
  TrainFlags& f = bf.t;
  set_threads(f.threads);
  train::TrainOptions o;
  Result<model::Gpt2Config> cfg = model::resolve_model(f.model);
  if (!cfg.is_ok()) return fail(cfg.status());
  if (f.steps <= 0 || bf.warmup < 0) {
    return fail(Status::invalid_argument("--steps must be positive and --warmup not negative"));
  }
  Result<std::optional<Alternation>> alt = parse_alternation(bf.alternate);
  if (!alt.is_ok()) return fail(alt.status());
  if (*alt && f.steps < 2) {
    return fail(Status::invalid_argument("--alternate needs --steps >= 2 (one pair of steps)"));
  }
  o.config = *cfg;
  o.model_name = f.model;
  o.seq = f.seq > 0 ? f.seq : std::min(256, cfg->n_positions);
  o.micro_batch = f.batch > 0 ? f.batch : 8;
  o.accumulation = 1;
  o.steps = f.steps + bf.warmup;
  o.warmup_steps = 1;
  o.adamw.lr = 6e-4f;
  o.val_fraction = 0;
  o.eval_batches = 0;
  o.breakdown = bf.breakdown;
  Result<std::optional<model::Recompute>> rc =
      parse_recompute(f.recompute == "auto" ? "none" : f.recompute);
  if (!rc.is_ok()) return fail(rc.status());
  if (**rc != model::Recompute::kNone) o.exec.recompute.assign(size_t(cfg->n_layer), **rc);
  // bench measures one configuration: --offload-activations on offloads every block (auto: off).
  Result<std::optional<bool>> off = parse_offload(f.offload_activations, "--offload-activations");
  if (!off.is_ok()) return fail(off.status());
  if (off->value_or(false)) {
    if (**rc == model::Recompute::kFull) {
      return fail(Status::invalid_argument(
          "--offload-activations on with --recompute full: a fully recomputed block keeps "
          "nothing to offload"));
    }
    o.exec.offload.assign(size_t(cfg->n_layer), true);
  }
  Result<uint64_t> off_mem = offload_budget(f.offload_memory, true);
  if (!off_mem.is_ok()) return fail(off_mem.status());
  o.offload_memory = *off_mem;
  if (bf.attention != "tiled" && bf.attention != "plain") {
    return fail(Status::invalid_argument("--attention must be tiled or plain"));
  }
  o.exec.tiled_attention = bf.attention == "tiled";
  if (bf.head_chunk < 0) return fail(Status::invalid_argument("--head-chunk must be >= 0"));
  o.exec.head_chunk = bf.head_chunk;
  if (bf.bf16_weights != "copy" && bf.bf16_weights != "cast") {
    return fail(Status::invalid_argument("--bf16-weights must be copy or cast"));
  }
  o.exec.bf16_weight_copy = bf.bf16_weights == "copy";
  o.exec.pad_rows = bf.pad_rows;
  o.profile = bf.record;
  Result<uint64_t> budget = device_budget(f.device_memory);
  if (!budget.is_ok()) return fail(budget.status());
  o.device_memory = *budget;
  Result<plan::DeviceSpec> dev = resolve_device("cpu", f.device_memory, f.json);
  if (!dev.is_ok()) return fail(dev.status());
  // bench measures one configuration: auto means fp32 here.
  if (Status st = check_precision(f.precision, *dev); !st.is_ok()) return fail(st);
  o.exec.precision = precision_of(f.precision);
  if (o.exec.precision != model::Precision::kFp32 && !o.exec.tiled_attention) {
    return fail(Status::invalid_argument(
        fmt::format("--precision {} needs --attention tiled", f.precision)));
  }
  const bool bf16 = o.exec.precision == model::Precision::kBf16;
  // fp16's GEMMs are fp32 GEMMs on this CPU (Note [fp16 GEMMs]): MFU against the fp32 rate.
  // MFU against the best GEMM this machine runs in that precision (calibrate's square 2048^3),
  // as MFU is usually quoted; the step's own shapes run slower (the cost model's rate).
  const double gemm_peak =
      bf16 ? (dev->peak_flops_bf16 > 0 ? dev->peak_flops_bf16 : dev->flops_bf16)
           : (dev->peak_flops_fp32 > 0 ? dev->peak_flops_fp32 : dev->flops_fp32);
  const std::string prec(model::precision_name(o.exec.precision));

  // Random tokens in a temporary token file: the data path is the trainer's own.
  std::string tmp =
      (fs::temp_directory_path() / ("headroom-bench-" + std::to_string(getpid()) + ".tokens"))
          .string();
  {
    std::mt19937 rng(1234);
    std::vector<int32_t> toks(size_t(o.steps + 1) * size_t(o.micro_batch) * size_t(o.seq) + 1);
    for (auto& t : toks) t = int32_t(rng() % uint32_t(cfg->vocab_size));
    Status s = data::write_token_file(tmp, toks, cfg->vocab_size, cfg->vocab_size - 1, 1);
    if (!s.is_ok()) return fail(s);
  }
  o.data = tmp;
  // What the calibrated peak is the best of, timed again after every timed step: MFU
  // against the machine's speed at that moment as well as against the cached peak (a shared host
  // moves both by 1.4-2x within minutes; docs/calibration.md). fp16 runs fp32 GEMMs here.
  std::unique_ptr<plan::GemmPeakProbe> probe;
  if (bf.peak_between_steps) {
    Result<std::unique_ptr<plan::GemmPeakProbe>> p = plan::GemmPeakProbe::create(bf16);
    if (!p.is_ok()) return fail(p.status());
    probe = std::move(*p);
  }
  constexpr int kProbeReps = 3;               // per timed step: ~40-80 ms of bf16, ~0.2 s of fp32
  std::vector<double> probe_flops, step_mfu;  // per timed step
  const model::ParamTable table = model::gpt2_param_table(*cfg);
  const double C = cfg->n_embd;
  const double n_no_pos = double(table.num_parameters) - double(cfg->lookup_parameters());
  const double flops_per_token = 6.0 * n_no_pos + 12.0 * cfg->n_layer * o.seq * C;
  const double tokens = double(o.micro_batch) * o.seq;
  std::vector<double> step_ms, step_cpu_ms;
  // --alternate: step s (from 1, warm-up included) runs with value (s - 1) % 2; the timed steps'
  // times per value, and the ratio (second value / first) of every two adjacent timed steps.
  std::array<std::vector<double>, 2> alt_ms;
  std::vector<double> alt_ratio;
  double alt_last_ms = 0;
  int alt_last_value = -1;
  if (*alt) (*alt)->apply(0);
  uint64_t peak = 0;
  model::OpTimes op_total;
  double opt_total = 0, opt_cpu_total = 0, data_total = 0;
  double off_copy_ms = 0, off_wait_ms = 0, off_bytes = 0;  // timed steps
  report::ProgressBar bar;
  train::TrainCallbacks cb;
  cb.on_step = [&](const train::StepStats& s) {
    if (s.step > bf.warmup) {
      step_ms.push_back(s.step_ms);
      step_cpu_ms.push_back(s.step_cpu_ms);
      for (size_t i = 0; i < op_total.ms.size(); i++) {
        op_total.ms[i] += s.op_ms.ms[i];
        op_total.cpu_ms[i] += s.op_ms.cpu_ms[i];
      }
      opt_total += s.optimizer_ms;
      opt_cpu_total += s.optimizer_cpu_ms;
      data_total += s.data_wait_ms;
      off_copy_ms += s.offload_copy_ms;
      off_wait_ms += s.offload_wait_ms;
      off_bytes += double(s.offload_bytes);
      if (probe) {
        const double rate = probe->measure(probe_flops.empty() ? 1 : 0, kProbeReps);
        probe_flops.push_back(rate);
        step_mfu.push_back(rate > 0 ? flops_per_token * tokens / (s.step_ms / 1e3) / rate : 0.0);
      }
      if (*alt) {
        const int v = (s.step - 1) % 2;
        alt_ms[size_t(v)].push_back(s.step_ms);
        // Every two adjacent timed steps are a pair, so that each value goes first in half of
        // them (a step right after the other one can run faster: position, not kernel).
        if (alt_last_value >= 0) {
          alt_ratio.push_back(v == 1 ? s.step_ms / alt_last_ms : alt_last_ms / s.step_ms);
        }
        alt_last_value = v;
        alt_last_ms = s.step_ms;
      }
    }
    if (*alt) (*alt)->apply(s.step % 2);  // the next step's value (after the probe)
    peak = std::max(peak, s.device_bytes_peak);
    if (!f.json)
      bar.update(s.step, s.steps,
                 fmt::format("{:.0f} ms  {:.0f} tok/s", s.step_ms, s.tokens_per_s));
  };
  Result<train::TrainResult> r = train::run_training(o, cb);
  bar.finish();
  std::error_code ec;
  fs::remove(tmp, ec);
  if (!r.is_ok()) return fail(r.status());
  std::sort(step_ms.begin(), step_ms.end());
  const double med = step_ms[step_ms.size() / 2];
  const double tps = tokens / (med / 1e3);
  const double mflops = flops_per_token * tps;
  const double mfu = mflops / gemm_peak;
  // In-run: the medians over timed steps of the probe's rate and of each step's own ratio (a
  // step and the probe right after it see the same machine).
  auto median_of = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  const double run_peak = median_of(probe_flops);
  const double run_mfu = median_of(step_mfu);
  auto alt_tps = [&](int v) {
    const double ms = median_of(alt_ms[size_t(v)]);
    return ms > 0 ? tokens / (ms / 1e3) : 0.0;
  };
  if (f.json) {
    json j = {{"model", f.model},
              {"micro_batch", o.micro_batch},
              {"seq", o.seq},
              {"precision", prec},
              {"techniques", plan::describe_exec(o.exec)},
              {"steps", f.steps},
              {"warmup", bf.warmup},
              {"threads", omp_get_max_threads()},
              {"tokens_per_s", tps},
              {"step_ms_median", med},
              {"step_ms", step_ms},
              {"flops_per_token", flops_per_token},
              {"model_flops_per_s", mflops},
              {"gemm_peak_flops_per_s", gemm_peak},
              {"mfu", mfu},
              {"peak_device_bytes", peak}};
    if (probe) {
      j["gemm_peak_in_run"] = probe->describe();
      j["gemm_peak_in_run_flops_per_s"] = run_peak;
      j["gemm_peak_in_run_samples"] = probe_flops;
      j["mfu_in_run"] = run_mfu;
    }
    if (*alt) {
      const Alternation& a = **alt;
      j["alternate"] = {{"variable", a.var},
                        {"values", {a.values[0], a.values[1]}},
                        {"step_ms", {alt_ms[0], alt_ms[1]}},
                        {"tokens_per_s", {alt_tps(0), alt_tps(1)}},
                        {"pair_ratios", alt_ratio},
                        {"pair_ratio_median", median_of(alt_ratio)}};
    }
    if (!o.exec.offload.empty()) {
      const double n = double(step_ms.size());
      j["offload_tier_bytes"] = r->offload_bytes_peak;
      j["offload_bytes_per_step"] = off_bytes / n;
      j["offload_copy_ms_per_step"] = off_copy_ms / n;
      j["offload_wait_ms_per_step"] = off_wait_ms / n;
      j["offload_copy_bandwidth"] = off_copy_ms > 0 ? off_bytes / (off_copy_ms / 1e3) : 0.0;
      // Waits also include time queued behind earlier copies: clamped to [0, 1].
      j["offload_hidden_fraction"] =
          off_copy_ms > 0 ? std::clamp(1.0 - off_wait_ms / off_copy_ms, 0.0, 1.0) : 1.0;
    }
    if (bf.breakdown) {
      json b = json::object(), c = json::object();
      const double n = double(step_ms.size());
      double step_cpu = 0;
      for (double ms : step_cpu_ms) step_cpu += ms / n;
      for (size_t i = 0; i < op_total.ms.size(); i++) {
        b[std::string(model::op_kind_name(model::OpKind(i)))] = op_total.ms[i] / n;
        c[std::string(model::op_kind_name(model::OpKind(i)))] = op_total.cpu_ms[i] / n;
      }
      b["optimizer"] = opt_total / n;
      b["data_wait"] = data_total / n;
      c["optimizer"] = opt_cpu_total / n;
      c["step"] = step_cpu;
      j["breakdown_ms_per_step"] = b;
      // Process CPU time (every thread's) of the same ops: what a busy host does not inflate.
      j["breakdown_cpu_ms_per_step"] = c;
    }
    std::printf("%s\n", dump_json(j, 2).c_str());
  } else {
    std::printf(
        "%s, micro-batch %d x seq %d, %s, %s, %d threads: median step %.1f ms over %zu steps\n"
        "  %.1f tokens/s, %.1f GFLOP/s of model FLOPs (6N + 12LTC = %.0f MFLOP/token), "
        "MFU %.1f%% of the measured %s GEMM peak (%.0f GFLOP/s)\n"
        "  peak device memory %s\n",
        f.model.c_str(), o.micro_batch, o.seq, prec.c_str(), plan::describe_exec(o.exec).c_str(),
        omp_get_max_threads(), med, step_ms.size(), tps, mflops / 1e9, flops_per_token / 1e6,
        100 * mfu, bf16 ? "bf16" : "fp32", gemm_peak / 1e9, format_bytes(peak).c_str());
    if (probe) {
      std::printf(
          "  MFU %.1f%% of the GEMM peak timed after each step (median %.0f GFLOP/s, the better "
          "of %s, %d calls each a step; the median of the steps' own ratios)\n",
          100 * run_mfu, run_peak / 1e9, probe->describe().c_str(), kProbeReps);
    }
    if (*alt) {
      const Alternation& a = **alt;
      auto shown = [](const std::string& v) { return v.empty() ? std::string("(unset)") : v; };
      std::vector<double> sorted = alt_ratio;
      std::sort(sorted.begin(), sorted.end());
      std::printf(
          "  alternated %s: %s %.1f tokens/s (%zu steps), %s %.1f tokens/s (%zu steps); step time "
          "%s / %s, median over %zu adjacent pairs: %.3f (range %.3f-%.3f)\n",
          a.var.c_str(), shown(a.values[0]).c_str(), alt_tps(0), alt_ms[0].size(),
          shown(a.values[1]).c_str(), alt_tps(1), alt_ms[1].size(), shown(a.values[1]).c_str(),
          shown(a.values[0]).c_str(), alt_ratio.size(), median_of(alt_ratio),
          sorted.empty() ? 0.0 : sorted.front(), sorted.empty() ? 0.0 : sorted.back());
    }
    if (!o.exec.offload.empty()) {
      const double n = double(step_ms.size());
      std::printf(
          "  activation offload: %s in the offload tier; %s copied per step in %.1f ms (%.2f "
          "GB/s), %.1f ms of it waited for (%.0f%% hidden behind compute)\n",
          format_bytes(r->offload_bytes_peak).c_str(),
          format_bytes(uint64_t(off_bytes / n)).c_str(), off_copy_ms / n,
          off_copy_ms > 0 ? off_bytes / (off_copy_ms / 1e3) / 1e9 : 0.0, off_wait_ms / n,
          off_copy_ms > 0 ? 100.0 * std::clamp(1.0 - off_wait_ms / off_copy_ms, 0.0, 1.0) : 100.0);
    }
    if (bf.breakdown) {
      const double n = double(step_ms.size());
      double sum = 0, cpu_sum = 0;
      double mean = 0, cpu_mean = 0;
      for (double ms : step_ms) mean += ms / n;
      for (double ms : step_cpu_ms) cpu_mean += ms / n;
      std::printf(
          "  time per step by kind of op (mean over timed steps; a step %.1f ms, %.1f ms of CPU "
          "time):\n"
          "    %-12s %9s %6s %12s\n",
          mean, cpu_mean, "", "wall", "", "CPU (all threads)");
      auto row = [&](std::string_view name, double ms, double cpu) {
        sum += ms;
        cpu_sum += cpu;
        std::printf("    %-12.*s %9.1f ms %5.1f%% %9.1f ms\n", int(name.size()), name.data(), ms,
                    100.0 * ms / mean, cpu);
      };
      for (size_t i = 0; i < op_total.ms.size(); i++) {
        row(model::op_kind_name(model::OpKind(i)), op_total.ms[i] / n, op_total.cpu_ms[i] / n);
      }
      row("optimizer", opt_total / n, opt_cpu_total / n);
      std::printf("    %-12s %9.1f ms %5.1f%%\n", "data wait", data_total / n,
                  100.0 * data_total / n / mean);
      sum += data_total / n;
      std::printf("    %-12s %9.1f ms %5.1f%% %9.1f ms\n", "other", mean - sum,
                  100.0 * (mean - sum) / mean, cpu_mean - cpu_sum);
    }
  }
  return 0;
}

// `headroom --version` and `headroom version [--json]`: the version, what it was built with and
// what this machine offers of it (the first lines of a bug report).
json version_json() {
  const cpu::BuildInfo b = cpu::build_info();
#ifdef HEADROOM_HAVE_MPI
  const bool mpi = true;
#else
  const bool mpi = false;
#endif
  return {{"version", HEADROOM_VERSION},
          {"compiler", b.compiler},
          {"build_type", HEADROOM_BUILD_TYPE},
          {"avx512_kernels_compiled", b.avx512_kernels_compiled},
          {"avx512_detected", b.avx512_detected},
          {"avx512_bf16_detected", b.avx512_bf16_detected},
          {"amx_kernels_compiled", b.amx_kernels_compiled},
          {"amx_detected", b.amx_detected},
          {"onednn_version", b.onednn_version},
          {"openmp_version", b.openmp_version},
          {"openmp_threads", b.openmp_threads},
          {"mpi", mpi},
          {"cuda", false}};
}

std::string version_text() {
  const json j = version_json();
  auto yes = [&](const char* key) { return j[key].get<bool>() ? "yes" : "no"; };
  return fmt::format(
      "headroom {}\n"
      "  built with {} ({} build)\n"
      "  AVX-512 kernels: compiled {}, this CPU {} (AVX512-BF16 {})\n"
      "  AMX kernels: compiled {}, usable on this CPU {}\n"
      "  oneDNN {}\n"
      "  OpenMP {}, {} threads\n"
      "  MPI: {}\n"
      "  CUDA: {}",
      j["version"].get<std::string>(), j["compiler"].get<std::string>(),
      j["build_type"].get<std::string>(), yes("avx512_kernels_compiled"), yes("avx512_detected"),
      yes("avx512_bf16_detected"), yes("amx_kernels_compiled"), yes("amx_detected"),
      j["onednn_version"].get<std::string>(), j["openmp_version"].get<std::string>(),
      j["openmp_threads"].get<int>(), yes("mpi"), yes("cuda"));
}

int run_version(bool as_json) {
  if (as_json) {
    std::printf("%s\n", dump_json(version_json(), 2).c_str());
  } else {
    std::printf("%s\n", version_text().c_str());
  }
  return 0;
}

// A fresh calibration's figure below this fraction of the cached one is warned about.
constexpr double kCalibrationDropWarning = 0.6;

int run_calibrate(bool as_json) {
  set_threads(0);
  Result<plan::Calibration> c = plan::run_calibration([&](const std::string& line) {
    if (!as_json) std::fprintf(stderr, "  %s\n", line.c_str());
  });
  if (!c.is_ok()) return fail(c.status());
  std::string path = plan::default_calibration_path();
  // Figures far below the previous ones on this machine usually mean other work shared the
  // cores: say so (they are saved all the same: they are what was measured).
  std::vector<std::string> drops;
  if (Result<plan::Calibration> prev = plan::load_calibration(path); prev.is_ok()) {
    drops = plan::calibration_drops(*prev, *c, kCalibrationDropWarning);
    for (const std::string& d : drops) {
      log_warn(
          "calibrate: {} (was the machine busy? MFU and plans use these figures: rerun "
          "`headroom calibrate` on an idle machine)",
          d);
    }
  }
  if (Status s = plan::save_calibration(*c, path); !s.is_ok()) return fail(s);
  if (as_json) {
    json j = {{"gemm_flops_fp32", c->gemm_flops_fp32},
              {"gemm_flops_bf16", c->gemm_flops_bf16},
              {"gemm_peak_fp32", c->gemm_peak_fp32},
              {"gemm_peak_bf16", c->gemm_peak_bf16},
              {"mem_bandwidth", c->mem_bandwidth},
              {"copy_bandwidth", c->copy_bandwidth},
              {"threads", c->threads},
              {"cpu_model", c->cpu_model},
              {"date", c->date},
              {"path", path},
              {"drops", drops}};
    std::printf("%s\n", dump_json(j, 2).c_str());
  } else {
    std::printf("%s\nsaved to %s\n", plan::describe_calibration(*c).c_str(), path.c_str());
  }
  return 0;
}
}  // namespace

int run(int argc, char** argv) {
  CLI::App app{"headroom: trains transformer language models in the memory you have"};
  app.set_version_flag("--version", version_text,
                       "print the version and what it was built with, and exit");
  app.require_subcommand(1);
  app.footer(
      "JSON output (--json, --log-json, --profile's files, plan files, checkpoints): text that is "
      "not valid UTF-8 (a path, a prompt, a completion ending inside a character) has U+FFFD for "
      "its bad bytes; token ids are exact (docs/notes/json-text.md).\n"
      "Integer flags take whole numbers; counts start at 1, and auto stands for the default where "
      "--help says so; sizes are e.g. 4GiB, 512MiB, 24GB (docs/notes/flags.md).");
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "more log output");

  TrainFlags tf;
  CLI::App* train_cmd = app.add_subcommand("train", "train a GPT-2 model on a token file");
  add_train_flags(train_cmd, tf);
  train_cmd->add_option("--out", tf.out, "directory for the trained model")->capture_default_str();
  train_cmd->add_option("--log-json", tf.log_json,
                        "write one JSON object per step to FILE (text as in --json: invalid "
                        "UTF-8 as U+FFFD)");
  train_cmd->add_flag("!--no-self-correct", tf.self_correct,
                      "do not correct the cost model by this run's measured op times (nor "
                      "re-plan by it, nor keep the correction for the next run)");
  train_cmd->add_option("--device-memory-file", tf.device_memory_file,
                        "read the device budget (e.g. 2GiB) from FILE before every step; "
                        "editing it re-plans micro-batch, accumulation and recomputation "
                        "with the same global batch (instead of --device-memory); with several "
                        "ranks, {rank} in FILE is replaced by each rank's number (no {rank}: "
                        "one file for all) and the ranks re-plan together under the smallest");
  add_int_flag(train_cmd, "--eval-every", tf.eval_every, {.min = 0, .what = "steps"},
               "steps between validation runs (default 0: only at the end)");
  train_cmd->add_option("--val-fraction", tf.val_fraction, "share of documents held out")
      ->capture_default_str();
  add_int_flag(train_cmd, "--sample-tokens", tf.sample_tokens,
               {.min = 0, .max = kMaxCount, .what = "tokens"},
               "tokens to sample at the end (0: none)", true);
  add_int_flag(train_cmd, "--save-every", tf.save_every, {.min = 0, .what = "steps"},
               "write a checkpoint to OUT/checkpoints/step-NNNNNN every N steps and at the end "
               "(0: none)",
               true);
  add_int_flag(train_cmd, "--keep-checkpoints", tf.keep_checkpoints,
               {.min = 0, .what = "checkpoints"}, "newest checkpoints kept (0: all)", true);
  train_cmd
      ->add_option("--zero", tf.zero,
                   "ZeRO stage with several ranks (mpirun -np N headroom train ...): 0 all-reduces "
                   "gradients, 1 shards the optimizer state, 2 also the gradients (per-layer "
                   "windows), 3 also the parameters (gathered per layer); auto: the planner's "
                   "choice")
      ->capture_default_str();
  train_cmd->add_option("--resume", tf.resume,
                        "continue exactly from a checkpoint directory, or from OUT (its newest "
                        "checkpoint); --steps is the run's total");
  train_cmd->add_option("--profile", tf.profile,
                        "write trace.json, memory.json and report.html of the run to DIR");
  train_cmd
      ->add_option("--loss-scale", tf.loss_scale,
                   "fp16: dynamic (start at 2^16, halve on an overflow and skip that step, double "
                   "after --loss-scale-window good steps) or a fixed scale >= 1")
      ->capture_default_str();
  add_int_flag(train_cmd, "--loss-scale-window", tf.loss_scale_window, {.what = "steps"},
               "fp16, dynamic loss scale: good steps in a row before the scale doubles", true);
  train_cmd
      ->add_option("--inject-overflow-at", tf.inject_overflow,
                   "tests: put an infinity into the gradients at these 1-based steps")
      ->group("");  // hidden
  train_cmd->add_flag("--json", tf.json,
                      "print the result as JSON instead of the progress bar (the sample's and "
                      "paths' bytes that are not UTF-8 as U+FFFD)");
  train_cmd->add_option("--batching", tf.batching,
                        "packed (default: T-token windows of the concatenated documents) or "
                        "bucketed (one document per row, rows of one length bucket per step, "
                        "padding masked out of the loss; docs/notes/batching.md)");
  tf.bucket_option = add_int_flag(
      train_cmd, "--bucket", tf.bucket, {.max = kMaxCount, .what = "tokens"},
      "--batching bucketed: bucket lengths are multiples of N tokens (default 32), up to --seq");

  GenerateFlags gf;
  CLI::App* gen_cmd = app.add_subcommand("generate", "sample text from a trained model");
  gen_cmd
      ->add_option("--model-dir", gf.model_dir, "directory with config.json and model.safetensors")
      ->required();
  gen_cmd->add_option("--prompt", gf.prompt, "text to continue (default: a new document)");
  add_int_flag(gen_cmd, "--max-new-tokens", gf.max_new_tokens, {.max = kMaxCount, .what = "tokens"},
               "tokens to generate", true);
  gen_cmd->add_option("--temperature", gf.temperature, "sampling temperature; 0 = greedy")
      ->capture_default_str();
  add_int_flag(gen_cmd, "--top-k", gf.top_k, {.min = 0, .what = "tokens"},
               "sample among the k most likely tokens; 0 = all", true);
  add_int_flag(gen_cmd, "--seed", gf.seed, kSeedRule, "sampling seed", true);
  gen_cmd->add_option("--vocab", gf.vocab, "directory with the GPT-2 vocabulary");
  add_int_flag(gen_cmd, "--threads", gf.threads, kThreadsRule,
               "OpenMP threads (default, or auto: the cores available)");
  gen_cmd->add_flag("--json", gf.json,
                    "print prompt, completion, the completion's token ids (tokens) and the "
                    "prompt's (prompt_tokens) as JSON; text that is not valid UTF-8 (a completion "
                    "ending inside a character) has U+FFFD for its bad bytes, the ids are exact");

  PrepareFlags pf;
  CLI::App* prep_cmd = app.add_subcommand(
      "prepare", "tokenise text files (GPT-2 BPE, or --tokenizer) into a token file");
  prep_cmd
      ->add_option("inputs", pf.inputs,
                   "text files, JSON Lines files (*.jsonl, *.ndjson: one object per line) or "
                   "directories (their files, recursively, sorted; hidden, *.dat and *.u8 "
                   "skipped)")
      ->required();
  prep_cmd->add_option("--out", pf.out, "the token file to write")->required();
  prep_cmd->add_option("--doc-separator", pf.separator,
                       "a line that separates documents inside a file (\"%\" for fortune files); "
                       "default: each file is one document");
  prep_cmd->add_option("--vocab", pf.vocab, "directory with the GPT-2 vocabulary");
  prep_cmd->add_option("--tokenizer", pf.tokenizer,
                       "directory with tokenizer.json, tokenizer.model or GPT-2's files "
                       "(default: GPT-2)");
  prep_cmd
      ->add_option("--field", pf.field,
                   "JSON Lines: the member of each line's object that holds the text")
      ->capture_default_str();
  prep_cmd->add_flag("--json", pf.json, "print the statistics as JSON");

  PlanFlags plf;
  CLI::App* plan_cmd = app.add_subcommand(
      "plan", "plan the memory of a training configuration and choose the fastest that fits");
  add_train_flags(plan_cmd, plf.t);
  add_int_flag(plan_cmd, "--devices", plf.devices, {.max = 1 << 16, .what = "devices"},
               "data-parallel devices", true);
  if (!plan_cmd->get_option_no_throw("--zero")) {
    plan_cmd
        ->add_option("--zero", plf.zero,
                     "ZeRO stage with --devices above 1: auto (the planner chooses), 0, 1, 2 or 3")
        ->capture_default_str();
  }
  plan_cmd->add_flag("--sweep", plf.sweep, "also print memory versus micro-batch");
  plan_cmd->add_flag("--json", plf.t.json, "print the plan as one JSON object");

  BenchFlags bnf;
  bnf.t.steps = 5;
  CLI::App* bench_cmd = app.add_subcommand(
      "bench", "time whole training steps on random tokens (median after warm-up)");
  bench_cmd->add_option("--model", bnf.t.model, "preset or config.json")->capture_default_str();
  add_int_flag(bench_cmd, "--batch", bnf.t.batch,
               {.max = kMaxCount, .what = "the micro-batch in sequences", .auto_means = "8"},
               "micro-batch in sequences (default, or auto: 8)");
  add_int_flag(bench_cmd, "--seq", bnf.t.seq,
               {.max = kMaxCount,
                .what = "the sequence length in tokens",
                .auto_means = "min(256, n_positions)"},
               "sequence length (default, or auto: min(256, n_positions))");
  bench_cmd->add_option("--precision", bnf.t.precision, "fp32, bf16 or fp16 (auto: fp32)")
      ->capture_default_str();
  add_int_flag(bench_cmd, "--steps", bnf.t.steps, {.what = "timed steps"}, "timed steps", true);
  add_int_flag(bench_cmd, "--warmup", bnf.warmup, {.min = 0, .what = "steps"},
               "untimed steps first (0: none)", true);
  add_size_flag(bench_cmd, "--device-memory", bnf.t.device_memory, true,
                "device memory budget (default, or auto: available memory less a margin)", true);
  add_int_flag(bench_cmd, "--threads", bnf.t.threads, kThreadsRule,
               "OpenMP threads (default, or auto: the cores available)");
  bench_cmd->add_option("--recompute", bnf.t.recompute, "none, selective or full (every block)")
      ->capture_default_str();
  bench_cmd
      ->add_option("--offload-activations", bnf.t.offload_activations,
                   "on: offload every block's saved activations to the offload tier; off (auto: "
                   "off)")
      ->capture_default_str();
  add_size_flag(bench_cmd, "--offload-memory", bnf.t.offload_memory, true,
                "offload tier budget (default, or auto: the host's available memory)");
  bench_cmd->add_option("--attention", bnf.attention, "tiled or plain")->capture_default_str();
  add_int_flag(bench_cmd, "--head-chunk", bnf.head_chunk, {.min = 0, .what = "tokens"},
               "tokens per chunk of the fused LM head; 0 = full logits", true);
  bench_cmd
      ->add_option("--bf16-weights", bnf.bf16_weights,
                   "bf16: keep a bf16 copy of the weights (copy) or cast each layer's before use "
                   "(cast)")
      ->capture_default_str();
  bench_cmd
      ->add_option("--pad-rows", bnf.pad_rows,
                   "pad the MLP activations' rows off 4 KiB multiples and the logits' rows to 64 "
                   "elements (true/false)")
      ->capture_default_str();
  bench_cmd->add_flag("--record", bnf.record,
                      "record every kernel, op and step span as --profile does (to measure "
                      "the recording's cost)");
  bench_cmd
      ->add_option("--peak-between-steps", bnf.peak_between_steps,
                   "time calibrate's peak GEMMs after every timed step and quote MFU against "
                   "them too (true/false)")
      ->capture_default_str();
  bench_cmd->add_option(
      "--alternate", bnf.alternate,
      "VAR=A,B: run successive steps with the knob VAR (HEADROOM_BF16_GEMM, "
      "HEADROOM_BF16_WGRAD_TRANSPOSE or HEADROOM_GELU_TABLE) set to A, B, A, ... (empty: unset) "
      "and report each value's "
      "tokens/s and the median ratio of adjacent steps: an A/B on the same state of the host");
  bench_cmd->add_flag("--breakdown", bnf.breakdown,
                      "time every kernel call by kind (gemm, attention, norm, ...), in wall and "
                      "process CPU time");
  bench_cmd->add_flag("--json", bnf.t.json,
                      "print tokens_per_s, step_ms_median, model_flops_per_s, mfu, mfu_in_run, "
                      "peak_device_bytes as JSON");

  bool calib_json = false;
  CLI::App* cal_cmd = app.add_subcommand(
      "calibrate", "measure this machine's GEMM speed and memory bandwidth for the cost model");
  cal_cmd->add_flag("--json", calib_json, "print the figures as JSON");

  bool version_json_flag = false;
  CLI::App* version_cmd = app.add_subcommand(
      "version",
      "print the version, the compiler, the kernels compiled and usable here, oneDNN, "
      "OpenMP, MPI and CUDA");
  version_cmd->add_flag("--json", version_json_flag, "print the same as one JSON object");

  try {
    app.parse(argc, argv);
  } catch (const FlagValueError& e) {
    return fail(Status::invalid_argument(e.what()));
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (verbose) set_log_level(LogLevel::kDebug);
  // Measurement knobs from the environment: a bad value is an error here, before any work.
  try {
    (void)cpu::attention_bf16_kernel();
    (void)cpu::bf16_wgrad_transposes(1, 1, 1);
    (void)cpu::amx_gemm_takes(32, DType::kF32);  // reads HEADROOM_BF16_GEMM first, on any CPU
    (void)cpu::gelu_by_table();
  } catch (const std::invalid_argument& e) {
    return fail(Status::invalid_argument(std::string(e.what()) + " (unset it for the default)"));
  }
  // JSON output never throws on text (dump_json: U+FFFD for invalid UTF-8); anything else a JSON
  // value throws is a bug, reported here rather than as an abort.
  try {
    if (train_cmd->parsed()) return run_train(tf);
    if (gen_cmd->parsed()) return run_generate(gf);
    if (prep_cmd->parsed()) return run_prepare(pf);
    if (plan_cmd->parsed()) return run_plan(plf);
    if (cal_cmd->parsed()) return run_calibrate(calib_json);
    if (bench_cmd->parsed()) return run_bench(bnf);
    if (version_cmd->parsed()) return run_version(version_json_flag);
  } catch (const nlohmann::json::exception& e) {
    return fail(Status::internal(fmt::format(
        "could not build the JSON output: {} (a bug in headroom: please report it with the "
        "command line)",
        e.what())));
  }
  return 2;
}

}  // namespace headroom::cli
