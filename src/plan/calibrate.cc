// Measures GEMM, memory and copy rates of this CPU for the cost model, and keeps them in a JSON
// cache file. See calibrate.h for the contract and docs/calibration.md for measured figures.
#include "plan/calibrate.h"

#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <new>
#include <sstream>
#include <string_view>
#include <system_error>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>
#include <oneapi/dnnl/dnnl.hpp>

#include "backend/cpu/kernels.h"
#include "core/units.h"

namespace headroom::plan {
namespace {

constexpr int kFileVersion = 1;

using Clock = std::chrono::steady_clock;

void report(const CalibrationProgress& progress, const std::string& line) {
  if (progress) progress(line);
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Median rather than best: the cost model wants what a step sustains, and a median ignores
// both a stray slow repetition and a lucky fast one.
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Times `fn` `reps` times after `warmup` untimed calls; returns the median in seconds.
template <typename Fn>
double time_median(int warmup, int reps, Fn&& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> times;
  times.reserve(reps);
  for (int i = 0; i < reps; ++i) {
    Clock::time_point start = Clock::now();
    fn();
    times.push_back(seconds_since(start));
  }
  return median(std::move(times));
}

// 64-byte aligned, uninitialised: the measurement itself decides which thread touches each page
// first (so pages land where the triad threads run) and when (never inside a timed loop).
struct AlignedDelete {
  void operator()(void* p) const { ::operator delete[](p, std::align_val_t(64)); }
};
template <typename T>
using AlignedBuffer = std::unique_ptr<T[], AlignedDelete>;

template <typename T>
AlignedBuffer<T> try_allocate(size_t count) {
  void* p = ::operator new[](count * sizeof(T), std::align_val_t(64), std::nothrow);
  return AlignedBuffer<T>(static_cast<T*>(p));
}

// Deterministic values in [-0.5, 0.5): no denormals, no zeros for a kernel to shortcut.
void fill(float* x, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t h = (static_cast<uint32_t>(i) + seed) * 2654435761u;
    x[i] = static_cast<float>(h >> 8) / static_cast<float>(1u << 24) - 0.5f;
  }
}

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct GemmShape {
  int N, IC, OC;  // out[N,OC] = inp[N,IC] x weight[IC,OC]
  double flops() const { return 2.0 * N * IC * OC; }
};

struct Sizes {
  std::vector<GemmShape> gemms;
  int warmup, reps;
  size_t triad_bytes;  // per array
  size_t copy_bytes;   // per buffer
};

Sizes sizes_for(const CalibrationOptions& options) {
  if (options.quick) return {{{128, 64, 256}, {128, 256, 64}}, 1, 3, 1 * kMiB, 1 * kMiB};
  // GPT-2 small's MLP at 2048 tokens (e.g. 8 x 256): c_fc 768 -> 3072 and c_proj 3072 -> 768.
  // Three triad arrays of 256 MiB (768 MiB) stream well past any last-level cache we expect
  // (300 MiB on the machine in docs/calibration.md).
  // GPT-2 124M's forward GEMMs at 2048 tokens (the LM head at 512 tokens, to keep calibration
  // short), weighted by their FLOPs as a step weights them.
  return {{{2048, 768, 2304},
           {2048, 768, 768},
           {2048, 768, 3072},
           {2048, 3072, 768},
           {512, 768, 50257}},
          1,
          5,
          256 * kMiB,
          256 * kMiB};
}

std::string shape_text(const GemmShape& s) { return fmt::format("{}x{}->{}", s.N, s.IC, s.OC); }

Result<double> measure_gemm_fp32(const Sizes& sz, const CalibrationProgress& progress) {
  double total_flops = 0, total_seconds = 0;
  for (const GemmShape& s : sz.gemms) {
    std::vector<float> inp(size_t(s.N) * s.IC), weight(size_t(s.IC) * s.OC), bias(s.OC),
        out(size_t(s.N) * s.OC);
    fill(inp.data(), inp.size(), 1);
    fill(weight.data(), weight.size(), 2);
    fill(bias.data(), bias.size(), 3);
    double t = time_median(sz.warmup, sz.reps, [&] {
      cpu::matmul_forward(out.data(), inp.data(), weight.data(), bias.data(), s.N, s.IC, s.OC,
                          cpu::WeightLayout::kInOut);
    });
    if (!(t > 0)) return Status::internal("fp32 GEMM " + shape_text(s) + " timed at 0 s");
    report(progress, fmt::format("fp32 GEMM {}: {:.1f} GFLOP/s (median of {}, {:.1f} ms)",
                                 shape_text(s), s.flops() / t / 1e9, sz.reps, t * 1e3));
    total_flops += s.flops();
    total_seconds += t;
  }
  return total_flops / total_seconds;  // the shapes weighted by their FLOPs, as in a step
}

// oneDNN's bf16 matmul called directly: the backend has no bf16 GEMM yet, and this is the
// library and primitive its bf16 path will use. Weights in plain row-major layout (as the
// trainer keeps them: they change every step, so no reordering into a blocked layout is priced).
// Returns 0 when oneDNN only has its reference (scalar) implementation for bf16 here: that would
// take minutes and is not what a bf16 plan would run on.
double measure_gemm_bf16(const Sizes& sz, const CalibrationProgress& progress) {
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  try {
    dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    dnnl::stream stream(engine);
    double total_flops = 0, total_seconds = 0;
    for (const GemmShape& s : sz.gemms) {
      dnnl::memory::desc src_md(dims{s.N, s.IC}, dt::bf16, dims{s.IC, 1});
      dnnl::memory::desc wei_md(dims{s.IC, s.OC}, dt::bf16, dims{s.OC, 1});
      dnnl::memory::desc dst_md(dims{s.N, s.OC}, dt::bf16, dims{s.OC, 1});
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, wei_md, dst_md), engine);
      std::string impl = pd.impl_info_str();
      if (impl.rfind("ref", 0) == 0) {
        report(progress, "bf16 GEMM: oneDNN has only its reference kernel (" + impl +
                             ") on this CPU; bf16 left at 0 (unsupported)");
        return 0;
      }
      dnnl::matmul prim(pd);
      dnnl::memory src(src_md, engine), wei(wei_md, engine), dst(dst_md, engine);
      std::vector<float> tmp(std::max(size_t(s.N) * s.IC, size_t(s.IC) * s.OC));
      for (auto [mem, count, seed] :
           {std::tuple{&src, size_t(s.N) * s.IC, 1u}, std::tuple{&wei, size_t(s.IC) * s.OC, 2u}}) {
        fill(tmp.data(), count, seed);
        auto* p = static_cast<uint16_t*>(mem->get_data_handle());
        for (size_t i = 0; i < count; ++i) p[i] = to_bf16(tmp[i]);
      }
      std::unordered_map<int, dnnl::memory> args = {
          {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}};
      double t = time_median(sz.warmup, sz.reps, [&] {
        prim.execute(stream, args);
        stream.wait();
      });
      if (!(t > 0)) return 0;
      report(progress, fmt::format("bf16 GEMM {}: {:.1f} GFLOP/s (oneDNN {}, median of {})",
                                   shape_text(s), s.flops() / t / 1e9, impl, sz.reps));
      total_flops += s.flops();
      total_seconds += t;
    }
    return total_flops / total_seconds;
  } catch (const dnnl::error& e) {
    report(progress, std::string("bf16 GEMM: oneDNN has no bf16 matmul here (") + e.what() +
                         "); bf16 left at 0 (unsupported)");
    return 0;
  }
}

Result<double> measure_triad(const Sizes& sz, const CalibrationProgress& progress) {
  const size_t n = sz.triad_bytes / sizeof(double);
  AlignedBuffer<double> a = try_allocate<double>(n), b = try_allocate<double>(n),
                        c = try_allocate<double>(n);
  if (!a || !b || !c) {
    return Status::out_of_memory(fmt::format(
        "calibration: cannot allocate 3 x {} for the memory-bandwidth triad; free memory or "
        "run `headroom calibrate` when the machine is less loaded",
        format_bytes(sz.triad_bytes)));
  }
  double* pa = a.get();
  double* pb = b.get();
  double* pc = c.get();
  const int64_t count = static_cast<int64_t>(n);
  // The one touch: same static schedule as the triad, so each thread owns its pages.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    pa[i] = 0.0;
    pb[i] = 1.0;
    pc[i] = 2.0;
  }
  const double scalar = 3.0;
  double t = time_median(sz.warmup, sz.reps, [&] {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; ++i) pa[i] = pb[i] + scalar * pc[i];
  });
  if (pa[count / 2] != 7.0) return Status::internal("calibration: triad computed a wrong value");
  if (!(t > 0)) return Status::internal("calibration: triad timed at 0 s");
  double bytes = 3.0 * sizeof(double) * static_cast<double>(n);
  report(progress, fmt::format("memory triad 3 x {} ({} threads): {:.1f} GB/s (median of {})",
                               format_bytes(sz.triad_bytes), omp_get_max_threads(), bytes / t / 1e9,
                               sz.reps));
  return bytes / t;
}

Result<double> measure_copy(const Sizes& sz, const CalibrationProgress& progress) {
  AlignedBuffer<char> src = try_allocate<char>(sz.copy_bytes),
                      dst = try_allocate<char>(sz.copy_bytes);
  if (!src || !dst) {
    return Status::out_of_memory(fmt::format(
        "calibration: cannot allocate 2 x {} for the copy bandwidth; free memory or run "
        "`headroom calibrate` when the machine is less loaded",
        format_bytes(sz.copy_bytes)));
  }
  std::memset(src.get(), 1, sz.copy_bytes);
  std::memset(dst.get(), 0, sz.copy_bytes);
  double t =
      time_median(sz.warmup, sz.reps, [&] { std::memcpy(dst.get(), src.get(), sz.copy_bytes); });
  if (dst[sz.copy_bytes - 1] != 1) return Status::internal("calibration: memcpy copied nothing");
  if (!(t > 0)) return Status::internal("calibration: copy timed at 0 s");
  double bytes = static_cast<double>(sz.copy_bytes);
  report(progress, fmt::format("memcpy {} (1 thread): {:.1f} GB/s (median of {})",
                               format_bytes(sz.copy_bytes), bytes / t / 1e9, sz.reps));
  return bytes / t;
}

std::string today_utc() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", &tm);
  return buf;
}

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

// ---- JSON validation -------------------------------------------------------------------------

Status field_error(const std::string& path, const char* field, const std::string& what) {
  return Status::corrupt("calibration file '" + path + "': field '" + field + "' " + what +
                         "; delete the file or run `headroom calibrate` to measure again");
}

Result<double> get_rate(const nlohmann::json& j, const std::string& path, const char* field,
                        bool allow_zero) {
  auto it = j.find(field);
  if (it == j.end()) return field_error(path, field, "is missing");
  if (!it->is_number()) return field_error(path, field, "is not a number: " + it->dump());
  double v = it->get<double>();
  if (!std::isfinite(v) || v < 0 || (v == 0 && !allow_zero)) {
    return field_error(path, field,
                       "must be a finite number " + std::string(allow_zero ? ">= 0" : "> 0") +
                           ", got " + it->dump());
  }
  return v;
}

Result<std::string> get_string(const nlohmann::json& j, const std::string& path,
                               const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return field_error(path, field, "is missing");
  if (!it->is_string()) return field_error(path, field, "is not a string: " + it->dump());
  return it->get<std::string>();
}

Result<int64_t> get_int(const nlohmann::json& j, const std::string& path, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return field_error(path, field, "is missing");
  if (!it->is_number_integer()) return field_error(path, field, "is not an integer: " + it->dump());
  return it->get<int64_t>();
}

// Other runnable work shares the cores and the memory bus with the measurement and lowers every
// figure (OpenMP barriers suffer most): say so, so that a low figure is not taken at face value.
void warn_if_busy(const CalibrationProgress& progress) {
  std::ifstream in("/proc/loadavg");
  double load1 = 0;
  if (!(in >> load1)) return;
  int cores = omp_get_num_procs();
  if (load1 > 0.5 * cores) {
    report(progress, fmt::format("warning: load average {:.1f} on {} cores before measuring; "
                                 "other work lowers these figures -- calibrate on an idle "
                                 "machine",
                                 load1, cores));
  }
}

}  // namespace

int calibration_threads() { return omp_get_max_threads(); }

std::string current_cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    size_t begin = line.find_first_not_of(" \t", colon + 1);
    size_t end = line.find_last_not_of(" \t\r");
    if (begin != std::string::npos && end >= begin) return line.substr(begin, end - begin + 1);
  }
  return "unknown";
}

Result<Calibration> run_calibration(const CalibrationProgress& progress,
                                    const CalibrationOptions& options) {
  const Sizes sz = sizes_for(options);
  Calibration cal;
  cal.threads = calibration_threads();
  cal.cpu_model = current_cpu_model();
  cal.date = today_utc();
  report(progress, fmt::format("calibrating {} with {} OpenMP threads{}", cal.cpu_model,
                               cal.threads, options.quick ? " (quick sizes)" : ""));
  if (!options.quick) warn_if_busy(progress);
  HR_ASSIGN_OR_RETURN(cal.gemm_flops_fp32, measure_gemm_fp32(sz, progress));
  cal.gemm_flops_bf16 = measure_gemm_bf16(sz, progress);
  HR_ASSIGN_OR_RETURN(cal.mem_bandwidth, measure_triad(sz, progress));
  HR_ASSIGN_OR_RETURN(cal.copy_bandwidth, measure_copy(sz, progress));
  return cal;
}

Status save_calibration(const Calibration& cal, const std::string& path) {
  nlohmann::json j = {
      {"version", kFileVersion},
      {"gemm_flops_fp32", cal.gemm_flops_fp32},
      {"gemm_flops_bf16", cal.gemm_flops_bf16},
      {"mem_bandwidth", cal.mem_bandwidth},
      {"copy_bandwidth", cal.copy_bandwidth},
      {"threads", cal.threads},
      {"cpu_model", cal.cpu_model},
      {"date", cal.date},
  };
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path target(path);
  if (target.has_parent_path()) {
    fs::create_directories(target.parent_path(), ec);
    if (ec) {
      return Status::io_error("cannot create directory '" + target.parent_path().string() +
                              "' for the calibration file: " + ec.message() +
                              "; set HEADROOM_CACHE_DIR to a writable directory");
    }
  }
  // Write then rename: a reader never sees half a file, and a crash leaves the old one.
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << j.dump(2) << "\n";
    out.close();
    if (!out) {
      fs::remove(tmp, ec);
      return Status::io_error("cannot write calibration file '" + tmp +
                              "'; set HEADROOM_CACHE_DIR to a writable directory");
    }
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    return Status::io_error("cannot rename '" + tmp + "' to '" + path + "': " + ec.message());
  }
  return Status::ok();
}

Result<Calibration> load_calibration(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return Status::not_found("no calibration file '" + path +
                             "'; run `headroom calibrate` to measure this machine");
  }
  std::ifstream in(path);
  if (!in) return Status::io_error("cannot open calibration file '" + path + "'");
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::io_error("cannot read calibration file '" + path + "'");

  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    return Status::corrupt("calibration file '" + path + "' is not valid JSON (" + e.what() +
                           "); delete it or run `headroom calibrate` to measure again");
  }
  if (!j.is_object()) {
    return Status::corrupt("calibration file '" + path +
                           "' does not hold a JSON object; delete it or run `headroom "
                           "calibrate` to measure again");
  }
  HR_ASSIGN_OR_RETURN(int64_t version, get_int(j, path, "version"));
  if (version != kFileVersion) {
    return field_error(path, "version",
                       fmt::format("is {}, this build reads version {}", version, kFileVersion));
  }
  Calibration cal;
  HR_ASSIGN_OR_RETURN(cal.gemm_flops_fp32, get_rate(j, path, "gemm_flops_fp32", false));
  HR_ASSIGN_OR_RETURN(cal.gemm_flops_bf16, get_rate(j, path, "gemm_flops_bf16", true));
  HR_ASSIGN_OR_RETURN(cal.mem_bandwidth, get_rate(j, path, "mem_bandwidth", false));
  HR_ASSIGN_OR_RETURN(cal.copy_bandwidth, get_rate(j, path, "copy_bandwidth", false));
  HR_ASSIGN_OR_RETURN(int64_t threads, get_int(j, path, "threads"));
  if (threads < 1 || threads > 1 << 20) {
    return field_error(path, "threads",
                       "must be between 1 and 1048576, got " + j["threads"].dump());
  }
  cal.threads = static_cast<int>(threads);
  HR_ASSIGN_OR_RETURN(cal.cpu_model, get_string(j, path, "cpu_model"));
  HR_ASSIGN_OR_RETURN(cal.date, get_string(j, path, "date"));
  return cal;
}

std::string default_calibration_path() {
  std::string dir = env_or_empty("HEADROOM_CACHE_DIR");
  if (dir.empty()) {
    std::string xdg = env_or_empty("XDG_CACHE_HOME");
    if (!xdg.empty()) {
      dir = xdg + "/headroom";
    } else {
      std::string home = env_or_empty("HOME");
      // No HOME (a bare container): the working directory is the only place we know exists.
      dir = (home.empty() ? std::string(".") : home) + "/.cache/headroom";
    }
  }
  return dir + "/calibration.json";
}

Result<Calibration> load_or_calibrate(const std::string& path, const CalibrationProgress& progress,
                                      const CalibrationOptions& options) {
  Result<Calibration> loaded = load_calibration(path);
  if (loaded.is_ok()) {
    const int threads = calibration_threads();
    const std::string model = current_cpu_model();
    if (loaded->threads == threads && loaded->cpu_model == model) return loaded;
    report(progress,
           fmt::format("calibration '{}' was measured with {} threads on {}; this run has "
                       "{} threads on {}: measuring again",
                       path, loaded->threads, loaded->cpu_model, threads, model));
  } else if (loaded.status().code() == StatusCode::kNotFound) {
    report(progress, "no calibration at '" + path + "': measuring this machine (once)");
  } else {
    report(progress, loaded.status().to_string() + " -- measuring again");
  }
  HR_ASSIGN_OR_RETURN(Calibration cal, run_calibration(progress, options));
  Status saved = save_calibration(cal, path);
  if (saved.is_ok()) {
    report(progress, "saved calibration to '" + path + "'");
  } else {
    report(progress, saved.to_string() + " -- using this measurement without saving it");
  }
  return cal;
}

DeviceSpec cpu_device_spec(const Calibration& cal, uint64_t memory_bytes) {
  DeviceSpec spec;
  spec.name = "cpu";
  spec.kind = "cpu";
  spec.memory_bytes = memory_bytes;
  spec.flops_fp32 = cal.gemm_flops_fp32;
  spec.flops_bf16 = cal.gemm_flops_bf16;
  spec.flops_fp16 = 0;  // the CPU backend has no fp16 kernels
  spec.mem_bandwidth = cal.mem_bandwidth;
  spec.host_link_bandwidth = cal.copy_bandwidth;
  spec.host_memory_bandwidth = cal.mem_bandwidth;  // the offload tier is this host's memory
  // Ranks on one host talk through Open MPI's shared-memory transport. Not calibrated yet: the
  // all-reduce bus bandwidth bench/dist_bench measured for 64 MiB on 2 ranks of this box
  // (docs/notes/zero.md, "Measured"), a conservative figure (a loaded machine).
  spec.interconnect_bandwidth = 0.4e9;
  spec.gemm_efficiency = 1.0;  // measured figures are already sustained rates
  spec.source = "measured " + cal.date;
  return spec;
}

std::string describe_calibration(const Calibration& cal) {
  std::string bf16 = cal.gemm_flops_bf16 > 0
                         ? fmt::format("{:.1f} GFLOP/s", cal.gemm_flops_bf16 / 1e9)
                         : std::string("unsupported");
  return fmt::format(
      "{}, {} threads (measured {}): fp32 GEMM {:.1f} GFLOP/s, bf16 GEMM {}, memory triad {:.1f} "
      "GB/s, copy {:.1f} GB/s",
      cal.cpu_model, cal.threads, cal.date, cal.gemm_flops_fp32 / 1e9, bf16,
      cal.mem_bandwidth / 1e9, cal.copy_bandwidth / 1e9);
}

}  // namespace headroom::plan
