// Measuring a device through its op table (device_calibration.h).
#include "plan/device_calibration.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/units.h"
#include "core/utf8.h"

namespace headroom::plan {
namespace {

constexpr int kDeviceFileVersion = 1;
constexpr size_t kAlign = 256;

void report(const CalibrationProgress& progress, const std::string& line) {
  if (progress) progress(line);
}

std::string today() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", &tm);
  return buf;
}

// A device (or host) buffer for this scope, filled with 0x3F bytes (0.75 in fp32 and bf16: no
// NaN, no denormal) through the table so that every page is touched before it is timed.
class Buffer {
 public:
  static Result<Buffer> create(memory::MemoryResource* r, size_t bytes, const char* what,
                               const backend::Ops* fill_with) {
    Result<void*> p = r->allocate(bytes, kAlign, memory::Category::kWorkspace);
    if (!p.is_ok()) {
      return Status::out_of_memory(fmt::format(
          "calibrate: cannot allocate the {} ({}): {}; free device memory (other processes) or "
          "calibrate on an idle device",
          what, format_bytes(bytes), p.status().message()));
    }
    Buffer b;
    b.r_ = r;
    b.p_ = *p;
    b.bytes_ = bytes;
    if (fill_with != nullptr) {
      fill_with->fill_bytes(b.p_, 0x3F, bytes);
    } else {
      std::fill_n(static_cast<unsigned char*>(b.p_), bytes, 0x3F);
    }
    return b;
  }
  Buffer() = default;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    release();
    r_ = std::exchange(o.r_, nullptr);
    p_ = std::exchange(o.p_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    return *this;
  }
  ~Buffer() { release(); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void release() {
    if (p_ != nullptr) r_->deallocate(p_, bytes_, kAlign, memory::Category::kWorkspace);
    p_ = nullptr;
  }
  memory::MemoryResource* r_ = nullptr;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Seconds of one call of `f`: the median of `reps` timed calls after `warmup` untimed ones,
// each between two synchronizations of the table (a GPU's queued work is finished).
template <typename F>
double median_seconds(const backend::Ops& ops, int warmup, int reps, F&& f) {
  for (int i = 0; i < warmup; i++) f();
  ops.synchronize();
  std::vector<double> t;
  t.reserve(size_t(reps));
  for (int i = 0; i < reps; i++) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ops.synchronize();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return std::max(t[t.size() / 2], 1e-9);
}

struct Shape {
  int IC, OC;
};
// GPT-2 124M's per-layer GEMMs: c_attn, the attention's c_proj, c_fc, the MLP's c_proj.
constexpr Shape kLayerShapes[] = {{768, 2304}, {768, 768}, {768, 3072}, {3072, 768}};

// FLOP/s of the four shapes forward and backward over `N` rows, storage T (float or bf16_t).
template <typename T>
Result<double> layer_gemms(const backend::Ops& ops, memory::MemoryResource* device, int N,
                           int reps) {
  size_t max_act = 0, max_w = 0;
  for (const Shape& s : kLayerShapes) {
    max_act = std::max(max_act, size_t(N) * size_t(std::max(s.IC, s.OC)));
    max_w = std::max(max_w, size_t(s.IC) * size_t(s.OC));
  }
  HR_ASSIGN_OR_RETURN(Buffer inp, Buffer::create(device, max_act * sizeof(T), "GEMM input", &ops));
  HR_ASSIGN_OR_RETURN(Buffer out, Buffer::create(device, max_act * sizeof(T), "GEMM output", &ops));
  HR_ASSIGN_OR_RETURN(Buffer dinp,
                      Buffer::create(device, max_act * sizeof(T), "GEMM input gradient", &ops));
  HR_ASSIGN_OR_RETURN(Buffer w, Buffer::create(device, max_w * sizeof(T), "GEMM weight", &ops));
  HR_ASSIGN_OR_RETURN(Buffer dw,
                      Buffer::create(device, max_w * sizeof(float), "GEMM weight gradient", &ops));
  const backend::MatmulStrides dense;
  double flops = 0;
  for (const Shape& s : kLayerShapes) flops += 6.0 * double(N) * s.IC * s.OC;
  const double secs = median_seconds(ops, 1, reps, [&] {
    for (const Shape& s : kLayerShapes) {
      if constexpr (std::is_same_v<T, float>) {
        ops.matmul_forward(out.as<float>(), inp.as<float>(), w.as<float>(), nullptr, N, s.IC, s.OC,
                           backend::WeightLayout::kInOut, dense);
        ops.matmul_backward(dinp.as<float>(), dw.as<float>(), nullptr, out.as<float>(),
                            inp.as<float>(), w.as<float>(), N, s.IC, s.OC,
                            backend::WeightLayout::kInOut, dense);
      } else {
        ops.matmul_forward(out.as<bf16_t>(), inp.as<bf16_t>(), w.as<bf16_t>(), nullptr, N, s.IC,
                           s.OC, backend::WeightLayout::kInOut, dense);
        ops.matmul_backward(dinp.as<bf16_t>(), dw.as<float>(), nullptr, out.as<bf16_t>(),
                            inp.as<bf16_t>(), w.as<bf16_t>(), N, s.IC, s.OC,
                            backend::WeightLayout::kInOut, dense, backend::WgradStaging{});
      }
    }
  });
  return flops / secs;
}

// FLOP/s of one square n^3 GEMM forward, storage T.
template <typename T>
Result<double> square_gemm(const backend::Ops& ops, memory::MemoryResource* device, int n,
                           int reps) {
  const size_t elems = size_t(n) * size_t(n);
  HR_ASSIGN_OR_RETURN(Buffer a, Buffer::create(device, elems * sizeof(T), "square GEMM A", &ops));
  HR_ASSIGN_OR_RETURN(Buffer b, Buffer::create(device, elems * sizeof(T), "square GEMM B", &ops));
  HR_ASSIGN_OR_RETURN(Buffer c, Buffer::create(device, elems * sizeof(T), "square GEMM C", &ops));
  const backend::MatmulStrides dense;
  const double secs = median_seconds(ops, 2, reps, [&] {
    ops.matmul_forward(c.as<T>(), a.as<T>(), b.as<T>(), nullptr, n, n, n,
                       backend::WeightLayout::kOutIn, dense);
  });
  return 2.0 * double(n) * n * n / secs;
}

}  // namespace

Result<DeviceCalibration> run_device_calibration(const backend::Ops& ops,
                                                 memory::MemoryResource* device,
                                                 memory::MemoryResource* host,
                                                 std::string device_name,
                                                 const CalibrationProgress& progress,
                                                 const DeviceCalibrationOptions& options) {
  HR_CHECK(device != nullptr && host != nullptr);
  DeviceCalibration c;
  c.device = std::move(device_name);
  c.date = today();
  const bool quick = options.quick;
  const int N = quick ? 64 : 8192;  // rows: 8 sequences of 1024 tokens
  const int square = quick ? 128 : 8192;
  const int reps = quick ? 3 : 10;

  HR_ASSIGN_OR_RETURN(c.gemm_flops_fp32, layer_gemms<float>(ops, device, N, reps));
  report(progress, fmt::format("fp32 GEMM, GPT-2's layer shapes x {} rows, fwd+bwd: {:.1f} TFLOP/s",
                               N, c.gemm_flops_fp32 / 1e12));
  HR_ASSIGN_OR_RETURN(c.gemm_flops_bf16, layer_gemms<bf16_t>(ops, device, N, reps));
  report(progress, fmt::format("bf16 GEMM, GPT-2's layer shapes x {} rows, fwd+bwd: {:.1f} TFLOP/s",
                               N, c.gemm_flops_bf16 / 1e12));
  HR_ASSIGN_OR_RETURN(const double sq32, square_gemm<float>(ops, device, square / 2, reps));
  HR_ASSIGN_OR_RETURN(const double sq16, square_gemm<bf16_t>(ops, device, square, reps));
  c.gemm_peak_fp32 = std::max(sq32, c.gemm_flops_fp32);
  c.gemm_peak_bf16 = std::max(sq16, c.gemm_flops_bf16);
  report(progress, fmt::format("square GEMMs: fp32 {}^3 {:.1f} TFLOP/s, bf16 {}^3 {:.1f} TFLOP/s",
                               square / 2, sq32 / 1e12, square, sq16 / 1e12));

  {  // device memory: out = a + b, 3 x 256 MiB
    const int64_t n = quick ? (int64_t(1) << 18) : (int64_t(64) << 20);
    HR_ASSIGN_OR_RETURN(Buffer a, Buffer::create(device, size_t(n) * 4, "bandwidth array a", &ops));
    HR_ASSIGN_OR_RETURN(Buffer b, Buffer::create(device, size_t(n) * 4, "bandwidth array b", &ops));
    HR_ASSIGN_OR_RETURN(Buffer o,
                        Buffer::create(device, size_t(n) * 4, "bandwidth array out", &ops));
    const double secs = median_seconds(ops, 2, reps, [&] {
      ops.residual_forward(o.as<float>(), a.as<float>(), b.as<float>(), n);
    });
    c.mem_bandwidth = 12.0 * double(n) / secs;
    report(progress, fmt::format("device memory, out = a + b over {} arrays: {:.1f} GB/s",
                                 format_bytes(uint64_t(n) * 4), c.mem_bandwidth / 1e9));
  }
  {  // the host link: one large copy each way between pinned host memory and the device
    const size_t bytes = quick ? (size_t(1) << 20) : (size_t(256) << 20);
    HR_ASSIGN_OR_RETURN(Buffer d, Buffer::create(device, bytes, "copy buffer (device)", &ops));
    HR_ASSIGN_OR_RETURN(Buffer h, Buffer::create(host, bytes, "copy buffer (host)", nullptr));
    c.h2d_bandwidth = double(bytes) / median_seconds(ops, 1, reps, [&] {
                        ops.copy_to_device(d.as<void>(), h.as<void>(), bytes);
                      });
    c.d2h_bandwidth = double(bytes) / median_seconds(ops, 1, reps, [&] {
                        ops.copy_to_host(h.as<void>(), d.as<void>(), bytes);
                      });
    report(progress,
           fmt::format("copies of {}: host -> device {:.1f} GB/s, device -> host {:.1f} "
                       "GB/s",
                       format_bytes(bytes), c.h2d_bandwidth / 1e9, c.d2h_bandwidth / 1e9));
  }
  return c;
}

Status save_device_calibration(const DeviceCalibration& c, const std::string& path) {
  const nlohmann::json j = {
      {"version", kDeviceFileVersion},        {"device", c.device},
      {"gemm_flops_fp32", c.gemm_flops_fp32}, {"gemm_flops_bf16", c.gemm_flops_bf16},
      {"gemm_peak_fp32", c.gemm_peak_fp32},   {"gemm_peak_bf16", c.gemm_peak_bf16},
      {"mem_bandwidth", c.mem_bandwidth},     {"h2d_bandwidth", c.h2d_bandwidth},
      {"d2h_bandwidth", c.d2h_bandwidth},     {"date", c.date}};
  return write_calibration_file(path, dump_json(j, 2) + "\n");
}

Result<DeviceCalibration> load_device_calibration(const std::string& path) {
  HR_ASSIGN_OR_RETURN(nlohmann::json j, read_calibration_file(path, "device calibration file",
                                                              "headroom calibrate --device cuda"));
  auto bad = [&](const char* field, const std::string& why) {
    return Status::corrupt(fmt::format(
        "device calibration file '{}': field \"{}\" {}; delete the file or run `headroom "
        "calibrate --device cuda` to measure again",
        path, field, why));
  };
  if (!j.is_object()) return bad("(top level)", "is not a JSON object");
  if (!j.contains("version") || !j["version"].is_number_integer() ||
      j["version"].get<int>() != kDeviceFileVersion) {
    return bad("version", fmt::format("is not {}", kDeviceFileVersion));
  }
  DeviceCalibration c;
  for (auto [field, out] :
       {std::pair<const char*, std::string*>{"device", &c.device}, {"date", &c.date}}) {
    if (!j.contains(field) || !j[field].is_string() || j[field].get<std::string>().empty()) {
      return bad(field, "is missing or not a non-empty string");
    }
    *out = j[field].get<std::string>();
  }
  const std::pair<const char*, double*> rates[] = {
      {"gemm_flops_fp32", &c.gemm_flops_fp32}, {"gemm_flops_bf16", &c.gemm_flops_bf16},
      {"gemm_peak_fp32", &c.gemm_peak_fp32},   {"gemm_peak_bf16", &c.gemm_peak_bf16},
      {"mem_bandwidth", &c.mem_bandwidth},     {"h2d_bandwidth", &c.h2d_bandwidth},
      {"d2h_bandwidth", &c.d2h_bandwidth}};
  for (const auto& [field, out] : rates) {
    if (!j.contains(field) || !j[field].is_number())
      return bad(field, "is missing or not a number");
    *out = j[field].get<double>();
    if (!std::isfinite(*out) || *out <= 0) {
      return bad(field, fmt::format("is {} (must be a finite rate > 0)", *out));
    }
  }
  return c;
}

std::string device_calibration_path(std::string_view device_name) {
  std::string slug;
  for (char ch : device_name) {
    const unsigned char u = static_cast<unsigned char>(ch);
    if (std::isalnum(u)) {
      slug += char(std::tolower(u));
    } else if (!slug.empty() && slug.back() != '-') {
      slug += '-';
    }
  }
  while (!slug.empty() && slug.back() == '-') slug.pop_back();
  if (slug.empty()) slug = "unnamed";
  const std::filesystem::path cpu(default_calibration_path());
  return (cpu.parent_path() / ("gpu-" + slug + ".json")).string();
}

Result<DeviceCalibration> load_or_calibrate_device(const std::string& path, const backend::Ops& ops,
                                                   memory::MemoryResource* device,
                                                   memory::MemoryResource* host,
                                                   const std::string& device_name,
                                                   const CalibrationProgress& progress,
                                                   const DeviceCalibrationOptions& options) {
  const CalibrationLock lock(path, progress);
  Result<DeviceCalibration> loaded = load_device_calibration(path);
  if (loaded.is_ok()) {
    if (loaded->device == device_name) return loaded;
    report(progress, fmt::format("device calibration '{}' was measured on {}; this is {}: "
                                 "measuring again",
                                 path, loaded->device, device_name));
  } else if (loaded.status().code() == StatusCode::kNotFound) {
    report(progress,
           "no calibration of " + device_name + " at '" + path + "': measuring the device (once)");
  } else {
    report(progress, loaded.status().to_string() + " -- measuring again");
  }
  HR_ASSIGN_OR_RETURN(DeviceCalibration c,
                      run_device_calibration(ops, device, host, device_name, progress, options));
  if (Status saved = save_device_calibration(c, path); saved.is_ok()) {
    report(progress, "saved the device calibration to '" + path + "'");
  } else {
    report(progress, saved.to_string() + " -- using this measurement without saving it");
  }
  return c;
}

DeviceSpec apply_device_calibration(DeviceSpec spec, const DeviceCalibration& c,
                                    std::string_view path) {
  // MFU against the datasheet (the convention for GPUs), whatever the rates below become.
  if (spec.peak_flops_fp32 <= 0) spec.peak_flops_fp32 = spec.flops_fp32;
  if (spec.peak_flops_bf16 <= 0) spec.peak_flops_bf16 = spec.flops_bf16;
  const double fp16_ratio = spec.flops_bf16 > 0 ? spec.flops_fp16 / spec.flops_bf16 : 0.0;
  spec.flops_fp32 = c.gemm_flops_fp32;
  spec.flops_bf16 = c.gemm_flops_bf16;
  spec.flops_fp16 = c.gemm_flops_bf16 * fp16_ratio;
  spec.gemm_efficiency = 1.0;  // measured rates are sustained
  spec.mem_bandwidth = c.mem_bandwidth;
  spec.host_link_bandwidth = std::min(c.h2d_bandwidth, c.d2h_bandwidth);
  spec.offload_bandwidth = spec.host_link_bandwidth;  // measured with pinned memory already
  spec.source = fmt::format("measured {} on {} ({})", c.date, c.device, path);
  return spec;
}

std::string describe_device_calibration(const DeviceCalibration& c) {
  return fmt::format(
      "{}: bf16 GEMM {:.1f} TFLOP/s (peak {:.1f}), fp32 GEMM {:.1f} TFLOP/s (peak {:.1f}), "
      "memory {:.1f} GB/s, host -> device {:.1f} GB/s, device -> host {:.1f} GB/s ({})",
      c.device, c.gemm_flops_bf16 / 1e12, c.gemm_peak_bf16 / 1e12, c.gemm_flops_fp32 / 1e12,
      c.gemm_peak_fp32 / 1e12, c.mem_bandwidth / 1e9, c.h2d_bandwidth / 1e9, c.d2h_bandwidth / 1e9,
      c.date);
}

}  // namespace headroom::plan
