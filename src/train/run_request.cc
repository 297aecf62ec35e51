// A training run's choices, as `headroom train`'s flags give them, resolved into the trainer's
// options: the planner's plan (or a plan file's), the schedule, loss scaling, the data.
#include "train/run_request.h"
#include "train/time_budget.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include "backend/cpu/device.h"
#if defined(HEADROOM_HAVE_CUDA)
#include "backend/cuda/build_info.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/device_memory.h"
#endif
#include "core/log.h"
#include "core/units.h"
#include "core/utf8.h"
#include "data/byte_tokenizer.h"
#include "data/prepare.h"
#include "model/safetensors.h"
#include "plan/calibrate.h"
#include "plan/cost_model.h"
#include "plan/device_calibration.h"
#include "train/checkpoint.h"
#include "train/elastic.h"

namespace headroom::train {

namespace fs = std::filesystem;

// --minutes without --steps: the bound on the count (the budget sets it well below).
constexpr int kMinutesMaxSteps = 100'000'000;
using nlohmann::json;

std::string cache_dir() {
  if (const char* d = std::getenv("HEADROOM_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/headroom";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/headroom";
  return ".headroom-cache";
}

// The tokenizer directory a model directory carries (tokenizer.json or tokenizer.model), "bytes"
// for a model trained with the byte tokenizer (its tokenizer_config.json says so:
// data::write_byte_tokenizer_config), or "".
std::string model_dir_tokenizer(const std::string& model) {
  std::error_code ec;
  if (!fs::is_directory(model, ec)) return "";
  for (const char* f : {"tokenizer.json", "tokenizer.model"}) {
    if (fs::exists(fs::path(model) / f, ec)) return model;
  }
  if (data::is_byte_tokenizer_config(model)) return data::kByteTokenizerName;
  return "";
}

// The default corpus: Debian's fortunes, tokenised once into the cache (per tokenizer: GPT-2's
// into fortunes.tokens, the byte tokenizer's into fortunes.bytes.tokens, another's into
// fortunes.<name>-<hash of its directory>.tokens).
Result<std::string> default_corpus(const std::string& vocab_dir, const std::string& tokenizer_dir) {
  std::string path = cache_dir() + "/fortunes.tokens";
  std::error_code ec;
  if (tokenizer_dir == data::kByteTokenizerName && !fs::is_directory(tokenizer_dir, ec)) {
    path = cache_dir() + "/fortunes.bytes.tokens";
  } else if (!tokenizer_dir.empty()) {
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

uint64_t device_budget(std::optional<uint64_t> bytes) {
  return bytes ? *bytes : cpu::default_device_budget(cpu::query_cpu_device());
}

uint64_t offload_budget(std::optional<uint64_t> bytes, bool this_host) {
  if (bytes) return *bytes;
  return this_host ? cpu::query_cpu_device().available_bytes : uint64_t(0);
}

#if defined(HEADROOM_HAVE_CUDA)
constexpr bool kCudaBuilt = true;
#else
constexpr bool kCudaBuilt = false;
#endif

Result<GpuRun> open_gpu(std::optional<uint64_t> device_memory, bool managed,
                        GpuCalibration calibration, const plan::CalibrationProgress& progress) {
#if defined(HEADROOM_HAVE_CUDA)
  std::string why;
  GpuRun g;
  g.ops = backend::cuda::cuda_ops(&why);
  if (g.ops == nullptr) {
    return Status::unsupported(fmt::format(
        "--device cuda: no CUDA device can be used by this process ({}); use --device cpu", why));
  }
  HR_ASSIGN_OR_RETURN(const int device, backend::cuda::process_device());
  if (managed) {
    HR_ASSIGN_OR_RETURN(std::unique_ptr<backend::cuda::ManagedResource> leaf,
                        backend::cuda::ManagedResource::create(device));
    g.leaf = std::move(leaf);
  } else {
    HR_ASSIGN_OR_RETURN(std::unique_ptr<backend::cuda::CudaDeviceResource> leaf,
                        backend::cuda::CudaDeviceResource::create(device));
    g.leaf = std::move(leaf);
  }
  // The offload tier in page-locked memory: the copies on the d2h / h2d streams run behind
  // their calls (pageable memory is staged by the runtime, the call waiting for it).
  HR_ASSIGN_OR_RETURN(std::unique_ptr<backend::cuda::PinnedHostResource> pinned,
                      backend::cuda::PinnedHostResource::create());
  g.offload_leaf = std::move(pinned);
  // "NVIDIA H200" -> the table's "H200"; "NVIDIA H100 80GB HBM3" -> "H100-80GB".
  const std::string name = backend::cuda::build_info().device_name;
  std::optional<plan::DeviceSpec> spec;
  for (const std::string& known : plan::named_device_names()) {
    const std::string stem = known.substr(0, known.find('-'));
    if (name.find(stem) != std::string::npos) {
      HR_ASSIGN_OR_RETURN(plan::DeviceSpec s, plan::named_device(known));
      spec = s;
      if (name.find(known.substr(known.find('-') + 1)) != std::string::npos) break;
    }
  }
  if (!spec) {
    log_warn(
        "--device cuda: {} is not in the planner's table of GPUs; its time estimates use "
        "the H100's figures (memory is measured)",
        name);
    HR_ASSIGN_OR_RETURN(spec, plan::named_device("H100-80GB"));
  }
  g.device_name = name;
  // Priced with this GPU's measured figures (`headroom calibrate --device cuda`; measured here
  // once and cached when there are none), before the budget is read: the measurement's buffers
  // are freed by then.
  {
    const std::string path = plan::device_calibration_path(name);
    Result<plan::DeviceCalibration> cal =
        calibration == GpuCalibration::kMeasureAgain
            ? plan::run_device_calibration(*g.ops, g.leaf.get(), g.offload_leaf.get(), name,
                                           progress)
            : plan::load_or_calibrate_device(path, *g.ops, g.leaf.get(), g.offload_leaf.get(), name,
                                             progress);
    if (cal.is_ok()) {
      g.calibration = *cal;
      spec = plan::apply_device_calibration(*spec, *cal, path);
    } else if (calibration == GpuCalibration::kMeasureAgain) {
      return cal.status();  // `calibrate --device cuda`: the measurement is the command
    } else {
      log_warn("--device cuda: {} -- pricing plans with {}'s datasheet figures instead",
               cal.status().to_string(), spec->name);
    }
  }
  // The budget: free device memory less 1 GiB for what the driver and cuBLAS may still take.
  constexpr uint64_t kMargin = uint64_t(1) << 30;
  HR_ASSIGN_OR_RETURN(const uint64_t free_less_margin,
                      backend::cuda::device_budget_bytes(kMargin, device));
  spec->memory_bytes =
      device_memory ? std::min(*device_memory, free_less_margin) : free_less_margin;
  g.spec = *spec;
  const uint64_t cap = device_memory ? *device_memory : UINT64_MAX;
  g.budget_probe = [device, cap](uint64_t held) -> Result<uint64_t> {
    HR_ASSIGN_OR_RETURN(const uint64_t free, backend::cuda::device_budget_bytes(kMargin, device));
    return std::min(cap, held + free);
  };
  return g;
#else
  (void)device_memory;
  (void)managed;
  (void)calibration;
  (void)progress;
  return Status::unsupported(
      "--device cuda: this headroom was built without CUDA; build it with `make build-cuda` "
      "(-DHEADROOM_CUDA=ON, nvcc from /usr/local/cuda) and run build/cuda/headroom");
#endif
}

Result<plan::DeviceSpec> cpu_device(uint64_t budget, bool quiet) {
  auto progress = [quiet](const std::string& line) {
    if (!quiet) log_info("calibrate: {}", line);
  };
  HR_ASSIGN_OR_RETURN(plan::Calibration cal,
                      plan::load_or_calibrate(plan::default_calibration_path(), progress));
  return plan::cpu_device_spec(cal, budget);
}

StoredCorrections stored_corrections(const model::Gpt2Config& config) {
  StoredCorrections out;
  const std::string path = plan::corrections_path(plan::default_calibration_path());
  const std::string machine =
      plan::correction_machine_key(plan::current_cpu_model(), plan::calibration_threads());
  for (const char* precision : {"fp32", "bf16", "fp16"}) {
    Result<plan::CostCorrection> c =
        plan::load_correction(path, machine, plan::correction_model_key(config, precision));
    if (c.is_ok()) {
      out.by_precision[precision] = *c;
    } else if (c.status().code() != StatusCode::kNotFound && out.note.empty()) {
      out.note = "cost model: " + c.status().message() + " -- not used";
    }
  }
  if (out.note.empty() && !out.by_precision.empty()) {
    std::string which;
    for (const auto& [precision, c] : out.by_precision) {
      which += fmt::format("{}{} ({} steps)", which.empty() ? "" : ", ", precision, c.steps);
    }
    out.note = fmt::format(
        "cost model: candidates priced with the corrections earlier runs measured on this "
        "machine: {} (--no-self-correct: without)",
        which);
  }
  return out;
}

// --offload-optimizer, --offload-activations (`name`): auto (unset: the planner chooses), on, off.
Result<std::optional<bool>> parse_offload(const std::string& flag, const char* name) {
  if (flag == "auto") return std::optional<bool>();
  if (flag == "on") return std::optional<bool>(true);
  if (flag == "off") return std::optional<bool>(false);
  return Status::invalid_argument(fmt::format("{} {}: use auto, on or off", name, flag));
}

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

Result<ResolvedRun> resolve_run(const RunRequest& request) {
  RunRequest f = request;  // a --resume fills what is unset from the checkpoint
  ResolvedRun run;
  TrainOptions* o = &run.options;
  // 0 (and -1 for warmup) stand for unset below; a resume fills them from the checkpoint.
  int seq = f.seq.value_or(0);
  int batch = f.micro_batch.value_or(0);
  int global_batch = f.global_batch.value_or(0);
  int warmup = f.warmup.value_or(-1);
  float lr = f.lr.value_or(0);
  const bool bucket_given = f.bucket.has_value();
  // A preset's own defaults (model::preset_run_defaults) for what neither the flags nor a
  // checkpoint set.
  const model::RunDefaults preset = model::preset_run_defaults(f.resume.empty() ? f.model : "");
  // --minutes without --steps: the budget alone sets the count (the cap is only a bound).
  // Neither: the preset's steps, bounded by its time budget if it has one (bytes-tiny's first
  // run ends in minutes on a slow host too).
  if (f.steps == 0 && f.minutes > 0) f.steps = kMinutesMaxSteps;
  if (f.steps == 0) {
    f.steps = preset.steps;
    f.minutes = preset.minutes;
  }
  if (lr == 0 && f.resume.empty()) lr = preset.lr;
  if (global_batch == 0 && batch == 0 && f.resume.empty()) global_batch = preset.global_batch;
  int bucket = f.bucket.value_or(32);
  if (!f.resume.empty()) {
    // Continue with the checkpoint's model, data and batch shape unless flags say otherwise
    // (the trainer refuses another global batch or seq; another micro-batch continues it within
    // rounding).
    HR_ASSIGN_OR_RETURN(LoadedCheckpoint ck, find_checkpoint(f.resume));
    if (!f.model_given) f.model = ck.dir;  // its config
    if (f.data.empty()) f.data = ck.state.data;
    if (seq == 0) seq = ck.state.seq;
    if (batch == 0) batch = ck.state.micro_batch;
    if (global_batch == 0) global_batch = ck.state.micro_batch * ck.state.accumulation;
    // The schedule too: its defaults depend on --steps, which a resume may raise.
    if (lr == 0) lr = ck.state.lr;
    if (warmup < 0) warmup = ck.state.warmup_steps;
    if (f.batching.empty()) f.batching = ck.state.batching;
    if (!bucket_given && ck.state.bucket > 0) bucket = ck.state.bucket;
  }
  HR_ASSIGN_OR_RETURN(o->batching,
                      data::parse_batching(f.batching.empty() ? "packed" : f.batching));
  if (bucket_given && o->batching == data::Batching::kPacked) {
    return Status::invalid_argument(fmt::format(
        "--bucket {} applies to --batching bucketed only (packed rows are all --seq long)",
        bucket));
  }
  if (bucket <= 0) {
    return Status::invalid_argument(fmt::format(
        "--bucket {} must be positive: bucket lengths are its multiples (e.g. 32), up to --seq",
        bucket));
  }
  o->bucket = bucket;
  HR_ASSIGN_OR_RETURN(o->config, model::resolve_model(f.model));
  o->model_name = f.model;
  // --model DIR holding weights: the run starts from them (a fine-tune), as from_pretrained does;
  // a config.json file alone, or a preset, starts from the seed. A resume's checkpoint wins.
  {
    std::error_code ec;
    const fs::path d(f.model);
    if (f.resume.empty() && fs::is_directory(d, ec) &&
        (fs::exists(d / "model.safetensors", ec) ||
         fs::exists(d / "model.safetensors.index.json", ec))) {
      o->init_from = f.model;
    }
  }
  if (f.tokenizer.empty()) f.tokenizer = model_dir_tokenizer(f.model);
  if (f.tokenizer.empty()) f.tokenizer = model::preset_tokenizer(f.model);
  if (f.device != "cpu" && f.device != "cuda") {
    return Status::invalid_argument(
        fmt::format("--device {}: use cpu{}", f.device, kCudaBuilt ? " or cuda" : ""));
  }
  const bool on_gpu = f.device == "cuda";
  if (f.managed_memory && !on_gpu) {
    return Status::invalid_argument(
        fmt::format("--managed-memory: managed (unified) memory is a GPU's; use it with --device "
                    "cuda, or leave it out with --device {}",
                    f.device));
  }
  std::optional<plan::DeviceSpec> gpu_spec;
  if (on_gpu) {
    HR_ASSIGN_OR_RETURN(GpuRun gpu,
                        open_gpu(f.device_memory, f.managed_memory, GpuCalibration::kCached,
                                 [&f](const std::string& line) {
                                   if (!f.quiet) log_info("calibrate: {}", line);
                                 }));
    o->ops = gpu.ops;
    o->device_leaf = gpu.leaf.get();
    run.device_leaf = std::move(gpu.leaf);
    o->offload_leaf = gpu.offload_leaf.get();
    o->slot_leaf = gpu.offload_leaf.get();  // the loader's slots, pinned too
    run.offload_leaf = std::move(gpu.offload_leaf);
    gpu_spec = gpu.spec;
    // The budget follows the GPU's free memory before each step, unless a budget file sets it.
    if (f.device_memory_file.empty()) o->device_budget_probe = std::move(gpu.budget_probe);
  }
  if (seq < 0) return Status::invalid_argument(fmt::format("--seq {} must be positive", seq));
  if (batch < 0) return Status::invalid_argument(fmt::format("--batch {} must be positive", batch));
  if (global_batch < 0) {
    return Status::invalid_argument(
        fmt::format("--global-batch {} must be positive", global_batch));
  }
  o->seq = seq > 0 ? seq : std::min(128, o->config.n_positions);
  o->device_memory = gpu_spec ? gpu_spec->memory_bytes : device_budget(f.device_memory);
  if (!f.device_memory_file.empty()) {
    if (f.device_memory) {
      return Status::invalid_argument(fmt::format(
          "--device-memory {} and --device-memory-file {}: give one (the file holds the budget "
          "and may change while training runs)",
          format_bytes(*f.device_memory), f.device_memory_file));
    }
    // With several ranks, each reads its own file ({rank} in the path) or the one shared file.
    HR_ASSIGN_OR_RETURN(o->device_memory, read_budget_file(budget_file_for_rank(
                                              f.device_memory_file, dist::launcher_rank())));
    o->device_memory_file = f.device_memory_file;
  }
  o->offload_memory = offload_budget(f.offload_memory, true);
  HR_ASSIGN_OR_RETURN(const std::optional<bool> offload_flag,
                      parse_offload(f.offload_activations, "--offload-activations"));
  const int global = global_batch > 0 ? global_batch : (batch > 0 ? batch * f.ranks : 8);
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
  HR_ASSIGN_OR_RETURN(const std::optional<model::Distill> distill,
                      resolve_distill(f.teacher, f.distill_alpha, f.distill_temperature,
                                      f.teacher_dtype, o->config, f.model));
  if (distill && f.ranks > 1) {
    return Status::unsupported(
        fmt::format("--teacher {} with {} ranks: distillation runs on one process for now",
                    f.teacher, f.ranks));
  }
  if (f.plan_file.empty()) {
    plan::SearchRequest req;
    req.config = o->config;
    req.distill = distill;
    if (gpu_spec) {
      req.device = *gpu_spec;
      req.ops = o->ops;
    } else {
      HR_ASSIGN_OR_RETURN(req.device, cpu_device(device_budget(f.device_memory), f.quiet));
    }
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
    if (batch > 0) req.micro_batch = batch;
    HR_ASSIGN_OR_RETURN(req.recompute, parse_recompute(f.recompute));
    HR_ASSIGN_OR_RETURN(req.offload_optimizer,
                        parse_offload(f.offload_optimizer, "--offload-optimizer"));
    req.offload_activations = offload_flag;
    req.offload_memory = o->offload_memory;
    req.sweep = f.sweep;  // the report shows memory versus micro-batch
    std::string correction_note;
    if (!gpu_spec && f.self_correct && req.device.terms.fitted) {
      StoredCorrections stored = stored_corrections(o->config);
      req.corrections = std::move(stored.by_precision);
      correction_note = std::move(stored.note);
    }
    HR_ASSIGN_OR_RETURN(plan::SearchResult res, plan::search_plan(req));
    if (!res.chosen) {
      return Status::out_of_memory(
          fmt::format("no plan for {} at seq {} and global batch {} fits the {} device budget.\n{}",
                      f.model, o->seq, global, format_bytes(o->device_memory), res.advice));
    }
    run.search = res;
    o->micro_batch = res.chosen->policy.micro_batch;
    o->exec = res.chosen->policy.exec;
    o->accumulation = res.chosen->policy.accumulation;
    if (f.ranks > 1) o->zero_stage = res.chosen->policy.zero_stage;
    o->offload_optimizer = res.chosen->policy.offload_optimizer;
    o->plan_note = fmt::format(
        "chosen by the planner: fastest of {} that fit, {} rejected; the "
        "largest micro-batch that fits is {}",
        res.candidates.size(), res.rejected.size(), res.max_micro_batch);
    if (!correction_note.empty()) o->plan_note += "; " + correction_note;
  } else {
    std::ifstream in(f.plan_file);
    if (!in) return Status::not_found(fmt::format("cannot open --plan '{}'", f.plan_file));
    json j;
    try {
      j = json::parse(in);
    } catch (const json::exception& e) {
      return Status::invalid_argument(
          fmt::format("--plan {}: not valid JSON: {}", f.plan_file, e.what()));
    }
    auto get_int = [&](const char* key, int* out) -> Status {
      if (!j.contains("chosen") || !j["chosen"].is_object() || !j["chosen"].contains(key) ||
          !j["chosen"][key].is_number_integer() || j["chosen"][key].get<int64_t>() <= 0) {
        return Status::invalid_argument(fmt::format(
            "--plan {}: field 'chosen.{}' is missing or not a positive integer (write the file "
            "with `headroom plan --json`)",
            f.plan_file, key));
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
                        f.plan_file, dump_json(ch["precision"])));
      }
      o->exec.precision = precision_of(ch["precision"].get<std::string>());
      if (f.precision != "auto" && f.precision != ch["precision"].get<std::string>()) {
        return Status::invalid_argument(
            fmt::format("--precision {} contradicts the plan's {} in {}", f.precision,
                        dump_json(ch["precision"]), f.plan_file));
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
                        f.plan_file, dump_json(ch["offload"])));
      }
      o->offload_optimizer = ch["offload"] == "optimizer" || ch["offload"] == "all";
    }
    if (offload && *offload != o->offload_optimizer) {
      return Status::invalid_argument(fmt::format(
          "--offload-optimizer {} contradicts the plan's offload {} in {}", f.offload_optimizer,
          ch.contains("offload") ? dump_json(ch["offload"]) : std::string("\"none\""),
          f.plan_file));
    }
    if (ch.contains("bf16_weights")) {
      if (ch["bf16_weights"] != "copy" && ch["bf16_weights"] != "cast per layer") {
        return Status::invalid_argument(fmt::format(
            "--plan {}: field 'chosen.bf16_weights' is {}; expected \"copy\" or \"cast per "
            "layer\"",
            f.plan_file, dump_json(ch["bf16_weights"])));
      }
      o->exec.bf16_weight_copy = ch["bf16_weights"] == "copy";
    }
    if (ch.contains("head_chunk")) {
      if (!ch["head_chunk"].is_number_integer() || ch["head_chunk"].get<int64_t>() < 0) {
        return Status::invalid_argument(fmt::format(
            "--plan {}: field 'chosen.head_chunk' must be a non-negative integer", f.plan_file));
      }
      o->exec.head_chunk = ch["head_chunk"].get<int>();
    }
    if (ch.contains("recompute_per_block")) {
      const json& rp = ch["recompute_per_block"];
      if (!rp.is_array() || (!rp.empty() && int(rp.size()) != o->config.n_layer)) {
        return Status::invalid_argument(fmt::format(
            "--plan {}: field 'chosen.recompute_per_block' must list one choice per block ({})",
            f.plan_file, o->config.n_layer));
      }
      for (const json& v : rp) {
        std::optional<model::Recompute> r;
        if (v.is_string()) {
          Result<std::optional<model::Recompute>> pr = parse_recompute(v.get<std::string>());
          if (pr.is_ok()) r = *pr;
        }
        if (!r) {
          return Status::invalid_argument(fmt::format(
              "--plan {}: 'chosen.recompute_per_block' has {}; use none, selective or full",
              f.plan_file, dump_json(v)));
        }
        o->exec.recompute.push_back(*r);
      }
    }
    if (ch.contains("offload_per_block")) {
      const json& op = ch["offload_per_block"];
      if (!op.is_array() || (!op.empty() && int(op.size()) != o->config.n_layer)) {
        return Status::invalid_argument(fmt::format(
            "--plan {}: field 'chosen.offload_per_block' must list one true/false per block ({})",
            f.plan_file, o->config.n_layer));
      }
      for (const json& v : op) {
        if (!v.is_boolean()) {
          return Status::invalid_argument(
              fmt::format("--plan {}: 'chosen.offload_per_block' has {}; use true or false",
                          f.plan_file, dump_json(v)));
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
                      f.offload_activations, f.plan_file, plan::offloaded_blocks(o->exec)));
    }
    int plan_seq = 0;
    HR_RETURN_IF_ERROR(get_int("seq", &plan_seq));
    if (seq > 0 && seq != plan_seq) {
      return Status::invalid_argument(
          fmt::format("--seq {} contradicts the plan's seq {} in {}", seq, plan_seq, f.plan_file));
    }
    o->seq = plan_seq;
    if (batch > 0 && batch != o->micro_batch) {
      return Status::invalid_argument(
          fmt::format("--batch {} contradicts the plan's micro-batch {} in {}", batch,
                      o->micro_batch, f.plan_file));
    }
    o->plan_note = "from " + f.plan_file;
    // The calibrated speeds price re-plans and the expected step time (nominal ones otherwise).
    Result<plan::DeviceSpec> dev = cpu_device(device_budget(f.device_memory), f.quiet);
    if (dev.is_ok()) o->device = *dev;
  }
  if (distill) {
    // (The search planned every candidate with the teacher; a plan file is this run's schedule
    // with the teacher's bytes added.)
    if (!f.plan_file.empty() && o->exec.head_chunk <= 0) {
      return Status::invalid_argument(fmt::format(
          "--teacher {} with --plan {}: the plan keeps full logits, and distillation needs the "
          "fused LM head (plan again with --teacher, or a plan with chosen.head_chunk > 0)",
          f.teacher, f.plan_file));
    }
    o->exec.distill = distill;
    o->teacher_dir = f.teacher;
  }
  // Note [Self-correction]: with this machine's measured terms, the run corrects the model by its
  // own op times (the correction kept next to the calibration), and with the micro-batch and
  // recomputation left to the planner re-plans by the corrected model.
  if (f.self_correct && o->device.terms.fitted) {
    o->self_correct.enabled = true;
    o->self_correct.cache_path = plan::corrections_path(plan::default_calibration_path());
    o->self_correct.machine_key =
        plan::correction_machine_key(plan::current_cpu_model(), plan::calibration_threads());
    o->self_correct.replan = f.plan_file.empty() && !f.micro_batch && f.recompute == "auto" &&
                             f.ranks == 1 && f.device_memory_file.empty();
  }
  o->steps = f.steps;
  o->minutes = f.minutes;
  o->seed = f.seed;
  const int64_t nparams = model::gpt2_param_table(o->config).num_parameters;
  o->adamw.lr = lr > 0 ? lr : (nparams < 50'000'000 ? 1e-3f : 6e-4f);
  if (lr < 0 || !std::isfinite(lr)) {
    return Status::invalid_argument(fmt::format("--lr {} must be positive", lr));
  }
  // (--minutes fixes the count after step kMinutesDecisionStep, inside the warmup.)
  o->warmup_steps =
      warmup >= 0 ? warmup
                  : std::min(100, std::max(f.minutes > 0 ? kMinutesDecisionStep : 1, f.steps / 10));
  o->val_fraction = f.val_fraction;
  if (!(f.val_fraction >= 0 && f.val_fraction < 0.5)) {
    return Status::invalid_argument(
        fmt::format("--val-fraction {} must be in [0, 0.5)", f.val_fraction));
  }
  o->eval_every = f.eval_every;
  // Loss scaling (fp16 only; Note [Loss scaling]).
  HR_ASSIGN_OR_RETURN(o->loss_scale, parse_loss_scale(f.loss_scale));
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
  run.model = f.model;
  run.tokenizer = f.tokenizer;
  return run;
}

Result<std::optional<model::Distill>> resolve_distill(const std::string& teacher_dir,
                                                      std::optional<float> alpha,
                                                      std::optional<float> temperature,
                                                      const std::string& teacher_dtype,
                                                      const model::Gpt2Config& student,
                                                      const std::string& student_name) {
  if (teacher_dir.empty()) {
    if (alpha || temperature || teacher_dtype != "auto") {
      return Status::invalid_argument(
          "--distill-alpha, --distill-temperature and --teacher-dtype apply to distillation: "
          "give the teacher's model directory with --teacher DIR");
    }
    return std::optional<model::Distill>();
  }
  model::Distill d;
  d.loss.alpha = alpha.value_or(0.5f);
  d.loss.temperature = temperature.value_or(2.0f);
  if (!(d.loss.alpha >= 0.0f && d.loss.alpha <= 1.0f)) {
    return Status::invalid_argument(fmt::format(
        "--distill-alpha {}: the KD share of the loss must be in [0, 1] (0: plain cross-entropy, "
        "1: KD only; default 0.5)",
        d.loss.alpha));
  }
  if (!(d.loss.temperature > 0.0f) || !std::isfinite(d.loss.temperature)) {
    return Status::invalid_argument(fmt::format(
        "--distill-temperature {}: the softmax temperature must be a positive number (default "
        "2)",
        d.loss.temperature));
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string cfg_path = (fs::path(teacher_dir) / "config.json").string();
  if (!fs::is_directory(teacher_dir, ec) || !fs::exists(cfg_path, ec)) {
    return Status::not_found(fmt::format(
        "--teacher {}: {}; the teacher is a model directory (config.json and "
        "model.safetensors, as `headroom train --out` or `headroom prune` write)",
        teacher_dir,
        fs::is_directory(teacher_dir, ec) ? "no config.json there" : "no such directory"));
  }
  HR_ASSIGN_OR_RETURN(d.teacher, model::load_config_file(cfg_path));
  if (d.teacher.vocab_size != student.vocab_size) {
    return Status::invalid_argument(fmt::format(
        "--teacher {} has vocab_size {} but the student ({}) has {}: teacher and student must "
        "share the tokenizer and vocabulary (distil from a teacher of the same tokenizer, or "
        "give --model a config with vocab_size {})",
        teacher_dir, d.teacher.vocab_size, student_name, student.vocab_size, d.teacher.vocab_size));
  }
  if (teacher_dtype == "fp32") {
    d.teacher_precision = model::Precision::kFp32;
  } else if (teacher_dtype == "bf16") {
    d.teacher_precision = model::Precision::kBf16;
  } else if (teacher_dtype == "auto") {
    // Its own precision: bf16 where its weights are stored so (a file's first tensor tells).
    d.teacher_precision = model::Precision::kFp32;
    Result<model::SafetensorsFile> w =
        model::SafetensorsFile::open((fs::path(teacher_dir) / "model.safetensors").string());
    if (w.is_ok() && !w->tensors().empty() && w->tensors().front().dtype == DType::kBF16) {
      d.teacher_precision = model::Precision::kBf16;
    }
  } else {
    return Status::invalid_argument(
        fmt::format("--teacher-dtype {}: use auto, fp32 or bf16", teacher_dtype));
  }
  return std::optional<model::Distill>(std::move(d));
}

}  // namespace headroom::train
