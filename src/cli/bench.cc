// `headroom bench`: whole training steps on random tokens, median after warm-up, MFU, and
// --alternate A/B runs of a knob.
#include "cli/common.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>

#include <fmt/format.h>

#include "backend/cpu/amx_gemm.h"
#include "backend/cpu/fused_kernels.h"
#include "backend/cpu/kernels.h"
#include "cli/flag_rules.h"
#include "core/units.h"
#include "core/utf8.h"
#include "data/token_file.h"
#include "plan/calibrate.h"
#include "report/progress.h"
#include "train/run_request.h"

namespace headroom::cli {

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
  // --device cuda: the trainer on the process's GPU (docs/notes/device-trainer.md); the budget
  // and the MFU's peak from its spec, and no CPU GEMM probe between steps.
  std::shared_ptr<memory::MemoryResource> gpu_leaf, gpu_offload_leaf;
  Result<plan::DeviceSpec> dev = Status::internal("no device");
  if (f.device == "cuda") {
    Result<std::optional<uint64_t>> bytes =
        parse_size_flag("--device-memory", f.device_memory, true);
    if (!bytes.is_ok()) return fail(bytes.status());
    Result<train::GpuRun> gpu = train::open_gpu(
        *bytes, f.managed_memory, train::GpuCalibration::kCached, [&](const std::string& line) {
          if (!f.json) std::fprintf(stderr, "calibrate: %s\n", line.c_str());
        });
    if (!gpu.is_ok()) return fail(gpu.status());
    o.ops = gpu->ops;
    gpu_leaf = gpu->leaf;
    o.device_leaf = gpu_leaf.get();
    gpu_offload_leaf = gpu->offload_leaf;  // the offload tier in pinned host memory
    o.offload_leaf = gpu_offload_leaf.get();
    o.slot_leaf = gpu_offload_leaf.get();  // the loader's slots, pinned too
    o.device_memory = gpu->spec.memory_bytes;
    dev = gpu->spec;
    bf.peak_between_steps = false;
  } else if (f.device == "cpu") {
    if (f.managed_memory) {
      return fail(Status::invalid_argument(
          "--managed-memory: managed (unified) memory is a GPU's; use it with --device cuda"));
    }
    Result<uint64_t> budget = device_budget(f.device_memory);
    if (!budget.is_ok()) return fail(budget.status());
    o.device_memory = *budget;
    dev = resolve_device("cpu", f.device_memory, f.json);
    if (!dev.is_ok()) return fail(dev.status());
  } else {
    return fail(Status::invalid_argument(
        fmt::format("--device {}: use cpu, or cuda in a CUDA build", f.device)));
  }
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
  const double n_no_pos = double(table.num_parameters) - double(cfg->lookup_parameters());
  const double flops_per_token =
      6.0 * n_no_pos + 12.0 * cfg->n_layer * o.seq * double(cfg->attn_width());
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
              {"peak_device_bytes", peak},
              {"planned_peak_bytes", r->planned_peak_bytes},
              {"device", o.ops ? std::string(o.ops->name()) : std::string("cpu")},
              {"device_figures", dev->source}};
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

}  // namespace headroom::cli
