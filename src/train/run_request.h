// A training run as a user chooses it (what `headroom train`'s flags say, "auto" unset), resolved
// into the trainer's options: the library call the CLI and an embedding program share.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/config.h"
#include "plan/device_calibration.h"
#include "plan/device_spec.h"
#include "plan/search.h"
#include "train/trainer.h"

namespace headroom::train {

// The user's choices. Unset optionals and "auto" strings are the engine's to choose. Errors name
// the choices by their `headroom train` flags (--seq, --plan, ...), as the CLI is their main user.
struct RunRequest {
  std::string model = "bytes-tiny";  // preset, config.json, or a directory holding one
  bool model_given = false;          // with `resume`: the checkpoint's model unless given
  std::string data;                  // token file; empty: the default corpus (Debian's fortunes)
  std::string tokenizer;   // directory or "bytes"; empty: the model directory's own, else the
                           // preset's (bytes-tiny: "bytes"), else GPT-2's
  std::string vocab;       // GPT-2 vocabulary directory; empty: core/data_dir.h's
  std::string resume;      // a checkpoint directory or a run's out directory
  std::optional<int> seq;  // unset: min(128, n_positions)
  std::optional<int> micro_batch;   // unset: the planner's choice
  std::optional<int> global_batch;  // unset: micro_batch times the ranks, or 8
  int steps = 0;  // 0: the model's default (model::preset_run_defaults: 200 but for bytes-tiny)
  // A time budget in minutes (0: none; TrainOptions::minutes): with it, unset steps mean no cap
  // but the budget's.
  double minutes = 0;
  uint64_t seed = 1337;
  std::string precision = "auto";            // auto, fp32, bf16, fp16
  std::string recompute = "auto";            // auto, none, selective, full
  std::string offload_activations = "auto";  // auto, on, off
  std::string offload_optimizer = "auto";    // auto, on, off
  std::optional<uint64_t> device_memory;     // bytes; unset: available memory less a margin
  std::string device_memory_file;            // the budget, read again before every step
  std::optional<uint64_t> offload_memory;    // bytes; unset: the host's available memory
  std::string device = "cpu";                // cpu, or cuda in a CUDA build (the process's GPU)
  bool managed_memory = false;               // cuda: the arenas in managed (unified) memory
  std::string plan_file;                     // `headroom plan --json`'s file; empty: plan here
  std::string zero = "auto";                 // auto, 0, 1, 2, 3
  std::string batching;                      // packed or bucketed; empty: packed or the resume's
  std::optional<int> bucket;                 // bucketed: lengths are multiples of it (32)
  std::optional<float> lr;                   // unset: 1e-3 below 50M parameters, else 6e-4
  std::optional<int> warmup;                 // unset: 10% of the steps, at most 100
  double val_fraction = 0.05;
  int eval_every = 0;
  std::string loss_scale = "dynamic";  // fp16: dynamic or a fixed scale
  int loss_scale_window = 2000;
  std::vector<int> inject_overflow;  // tests: 1-based steps whose gradients get an infinity
  int ranks = 1;                     // the processes of the job (data parallel)
  bool sweep = false;                // also plan memory versus micro-batch (for the report)
  bool quiet = false;                // no calibration progress lines
  bool self_correct = true;          // correct the cost model by the run's op times (cost-model.md)
  // Knowledge distillation (docs/notes/distillation.md): the teacher's model directory (empty:
  // none), the loss's alpha and temperature (unset: 0.5 and 2), its precision (auto: bf16 where
  // its weights are stored in bf16, else fp32).
  std::string teacher;
  std::optional<float> distill_alpha;
  std::optional<float> distill_temperature;
  std::string teacher_dtype = "auto";
};

// --device cuda: the process's GPU (its op table, a device memory leaf) and its spec for the
// planner: the datasheet figures of the named GPU it is (or its measured ones, `calibration`
// below), the budget its free memory less a margin
// (or `device_memory`). Unsupported in a build without CUDA (saying how to build one), or where
// the runtime finds no usable device (saying why).
struct GpuRun {
  const backend::Ops* ops = nullptr;
  std::shared_ptr<memory::MemoryResource> leaf;
  std::shared_ptr<memory::MemoryResource> offload_leaf;  // pinned host memory: the tier, slots
  plan::DeviceSpec spec;
  // The budget before each step (TrainOptions::device_budget_probe): what the run holds plus the
  // device's free memory less the margin, at most --device-memory.
  std::function<Result<uint64_t>(uint64_t held)> budget_probe;
  std::string device_name;  // as the runtime names it ("NVIDIA H200")
  // The measured figures the spec is priced with (plan/device_calibration.h); none when the
  // datasheet's are used.
  std::optional<plan::DeviceCalibration> calibration;
};
// How open_gpu prices the GPU: its cached measured figures (measuring them once when there are
// none: `train`, `bench`; a failed measurement warns and prices with the datasheet), or a fresh
// measurement not saved (`calibrate --device cuda`, which saves it itself; a failure is the
// error open_gpu returns).
enum class GpuCalibration { kCached, kMeasureAgain };
// `managed`: the leaf is managed (unified) memory (backend::cuda::ManagedResource: never beyond
// the device's free memory at its creation), else cudaMalloc's.
Result<GpuRun> open_gpu(std::optional<uint64_t> device_memory, bool managed = false,
                        GpuCalibration calibration = GpuCalibration::kCached,
                        const plan::CalibrationProgress& progress = {});

struct ResolvedRun {
  TrainOptions options;  // comm, out_dir, checkpoints and profile are the caller's to set
  // --device cuda: the device memory leaf that options.device_leaf points to (kept alive with
  // the run; options.ops is the process's CUDA op table). Null on the CPU.
  std::shared_ptr<memory::MemoryResource> device_leaf;
  std::shared_ptr<memory::MemoryResource> offload_leaf;  // options.offload_/slot_leaf's (GPU)
  std::optional<plan::SearchResult> search;              // the planner's search, when it planned
  std::string model;      // the model (a resume's checkpoint directory)
  std::string tokenizer;  // the tokenizer directory used, or "" for GPT-2's
};

// Resolves a request: a resume's checkpoint fills what is unset; the plan is searched here
// (plan::search_plan over the ranks, ZeRO stages, precisions and techniques the request leaves
// open) or read from plan_file and checked against the request; the schedule, loss scaling and
// the data (the default corpus is tokenised into the cache once). Errors: InvalidArgument naming
// the flag and value; OutOfMemory when nothing fits, with the planner's advice; NotFound for
// missing files.
Result<ResolvedRun> resolve_run(const RunRequest& request);

// Distillation's flags for the student `student` (named `student_name` in messages): the teacher
// directory's config.json (NotFound naming the directory when it is not a model directory), the
// vocabularies (InvalidArgument naming both directories and both sizes when they differ), alpha in
// [0, 1], a temperature > 0, and the teacher's precision (auto, fp32 or bf16). An empty
// teacher_dir with no alpha or temperature is no distillation (nullopt); alpha or temperature
// without a teacher is an error.
Result<std::optional<model::Distill>> resolve_distill(const std::string& teacher_dir,
                                                      std::optional<float> alpha,
                                                      std::optional<float> temperature,
                                                      const std::string& teacher_dtype,
                                                      const model::Gpt2Config& student,
                                                      const std::string& student_name);

// HEADROOM_CACHE_DIR, else $XDG_CACHE_HOME/headroom, else ~/.cache/headroom.
std::string cache_dir();

// The tokenizer directory a model directory carries (tokenizer.json or tokenizer.model), "bytes"
// when its tokenizer_config.json names the byte tokenizer, or "".
std::string model_dir_tokenizer(const std::string& model);

// The default corpus: Debian's fortunes, tokenised once into the cache (per tokenizer: GPT-2's
// into fortunes.tokens, another's into fortunes.<name>-<hash of its directory>.tokens).
Result<std::string> default_corpus(const std::string& vocab_dir,
                                   const std::string& tokenizer_dir = "");

// The device budget: `bytes`, or this machine's available memory less a margin (cgroup limits
// respected).
uint64_t device_budget(std::optional<uint64_t> bytes);

// The offload tier's budget: `bytes`, or the host's available memory when the tier is this
// host's, or 0 (not limited) for a named GPU's host.
uint64_t offload_budget(std::optional<uint64_t> bytes, bool this_host);

// This CPU as the planner sees it: its calibrated speeds (measured once and cached;
// `quiet`: without progress lines) and `budget` bytes.
Result<plan::DeviceSpec> cpu_device(uint64_t budget, bool quiet);

// Note [Self-correction]: the corrections that earlier runs of `config` measured on this machine
// (the cache next to the calibration), by precision, for plan::SearchRequest::corrections, and a
// line saying which were used (or why a damaged cache was not: it is a cache, never an error).
struct StoredCorrections {
  std::map<std::string, plan::CostCorrection> by_precision;
  std::string note;  // empty: none stored
};
StoredCorrections stored_corrections(const model::Gpt2Config& config);

// auto (unset: the planner chooses), on, off; `name` is the flag for the error message.
Result<std::optional<bool>> parse_offload(const std::string& flag, const char* name);

// auto (unset: the planner chooses), none, selective or full.
Result<std::optional<model::Recompute>> parse_recompute(const std::string& flag);

// auto, fp32, bf16 or fp16; bf16 only where `dev` has bf16 GEMM kernels.
Status check_precision(const std::string& precision, const plan::DeviceSpec& dev);

// "bf16" and "fp16" to their precision; anything else is fp32.
model::Precision precision_of(const std::string& name);

}  // namespace headroom::train
