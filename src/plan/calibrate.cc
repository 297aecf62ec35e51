// Measures GEMM, memory and copy rates of this CPU for the cost model, and keeps them in a JSON
// cache file. See calibrate.h for the contract and docs/calibration.md for measured figures.
#include "plan/calibrate.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <omp.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>

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
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/cpu/fused_kernels.h"
#include "backend/cpu/gemm.h"
#include "backend/cpu/kernels.h"
#include "core/check.h"
#include "core/dtype.h"
#include "core/units.h"
#include "core/utf8.h"
#include "memory/host_resource.h"

namespace headroom::plan {
namespace {

// Operands in memory like the arenas' (huge pages): the LM head's output on 4 KiB pages ran
// 1.5-2x slower than in a step (docs/notes/lm-head-rows.md).
template <typename T>
using HostVec = std::vector<T, memory::HostAllocator<T>>;

// 2: the step's matmuls forward and backward with the model's strides, and the square-GEMM peaks
// (version 1 files are measured again).
// 3: the cost model's measured terms (CostTerms).
// 4: attention's call is per (sequence, head); 5: the optimizer per precision, at 64M parameters,
// and each GEMM class's forward share.
constexpr int kFileVersion = 5;

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

// One of the step's matmuls: out[N,OC] = inp[N,IC] x weight, with the weight layout, the padded
// activation strides and (bf16) the output type the model uses, so calibration times exactly what
// a step runs (dense 3072-float rows, for one, run about 2x slower: activation_row_stride).
struct GemmShape {
  int N, IC, OC;
  cpu::WeightLayout layout = cpu::WeightLayout::kInOut;
  bool pad_inp = false, pad_out = false;  // strides from activation_row_stride
  bool bf16_out = true;                   // bf16: the output is bf16 (else fp32)
  bool backward = true;                   // also time dinp and dweight (the step's 2 of 3 GEMMs)
  // How many times a step of the other shapes' tokens runs this one (the head: measured at a
  // quarter of the tokens to keep calibration short, so it counts four times).
  double weight = 1;
  bool logits_rows = false;  // the output's rows padded to 64 elements, as the model's logits
  double flops() const { return 2.0 * N * IC * OC * (backward ? 3 : 1); }
};

struct Sizes {
  std::vector<GemmShape> gemms;
  int peak_n;  // the square bf16 GEMM for the peak (fp32: peak_n - 64, padded)
  int warmup, reps;
  size_t triad_bytes;  // per array
  size_t copy_bytes;   // per buffer
};

Sizes sizes_for(const CalibrationOptions& options) {
  using L = cpu::WeightLayout;
  if (options.quick) return {{{128, 64, 256}, {128, 256, 64}}, 128, 1, 3, 1 * kMiB, 1 * kMiB};
  // GPT-2 124M's matmuls at 2048 tokens (e.g. 8 x 256), forward and backward, as the model issues
  // them (gpt2.cc): c_attn, attention c_proj (fp32 out: the residual stream), c_fc (padded
  // 3072-wide output), MLP c_proj (padded input, fp32 out); the tied LM head (weight [V, C], fp32
  // logits in rows padded to 64 elements) at 512 tokens to keep calibration short, counted four
  // times. Weighted by their FLOPs as a step of 2048 tokens weights them. Three triad arrays of 256
  // MiB (768 MiB) stream well past any last-level cache we expect (300 MiB on the machine in
  // docs/calibration.md).
  return {{{2048, 768, 2304},
           {2048, 768, 768, L::kInOut, false, false, false},
           {2048, 768, 3072, L::kInOut, false, true, true},
           {2048, 3072, 768, L::kInOut, true, false, false},
           {512, 768, 50257, L::kOutIn, false, false, false, true, 4.0, true}},
          2112,
          1,
          5,
          256 * kMiB,
          256 * kMiB};
}

std::string shape_text(const GemmShape& s) { return fmt::format("{}x{}->{}", s.N, s.IC, s.OC); }

template <typename T>
HostVec<T> filled(size_t count, uint32_t seed) {
  HostVec<float> f(count);
  fill(f.data(), count, seed);
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    HostVec<T> out(count);
    for (size_t i = 0; i < count; ++i) out[i] = T{f32_to_bf16_bits(f[i])};
    return out;
  }
}

// The operands of ShapeTimer's and SquarePeak's GEMMs: each a buffer at least as large as the
// largest of the shapes it serves, filled once. GemmPeakProbe times five GEMMs one after another
// and shares one set (bench's RSS carries it: ~75 MB in bf16 instead of ~155 with a set per shape).
template <typename T>
struct GemmOperands {
  HostVec<T> inp, weight, dout, dinp, out16;
  HostVec<float> bias, dweight, out32;
};

// Element counts each operand of `s` needs with storage type T.
template <typename T>
struct ShapeSizes {
  explicit ShapeSizes(const GemmShape& s)
      : ldi(s.pad_inp ? cpu::activation_row_stride(s.IC, sizeof(T)) : s.IC),
        ldo(s.logits_rows ? cpu::logits_row_stride(s.OC)
            : s.pad_out   ? cpu::activation_row_stride(s.OC, sizeof(T))
                          : s.OC),
        fp32_out(std::is_same_v<T, float> || !s.bf16_out),
        inp(size_t(s.N) * ldi),
        weight(size_t(s.IC) * s.OC),
        out(size_t(s.N) * ldo),
        bias(size_t(s.OC)) {}
  int64_t ldi, ldo;
  bool fp32_out;
  size_t inp, weight, out, bias;
};

// Operands for all of `shapes` and (if square_n > 0) a square GEMM of n x n inputs with `square_ld`
// row strides and an fp32 result.
template <typename T>
std::shared_ptr<GemmOperands<T>> make_operands(const std::vector<GemmShape>& shapes, int square_n,
                                               int square_ld) {
  size_t inp = size_t(square_n) * square_ld, weight = size_t(square_n) * square_n, dout = 0,
         out16 = 0, bias = 0, dweight = 0, out32 = size_t(square_n) * square_ld;
  for (const GemmShape& s : shapes) {
    const ShapeSizes<T> z(s);
    inp = std::max(inp, z.inp);
    weight = std::max(weight, z.weight);
    dout = std::max(dout, z.out);
    (z.fp32_out ? out32 : out16) = std::max(z.fp32_out ? out32 : out16, z.out);
    bias = std::max(bias, z.bias);
    dweight = std::max(dweight, z.weight);
  }
  auto o = std::make_shared<GemmOperands<T>>();
  o->inp = filled<T>(inp, 1);
  o->weight = filled<T>(weight, 2);
  o->dout = filled<T>(dout, 4);
  o->dinp = HostVec<T>(inp);
  o->out16 = HostVec<T>(out16);
  o->bias = filled<float>(bias, 3);
  o->dweight = HostVec<float>(dweight);
  o->out32 = HostVec<float>(out32);
  return o;
}

// One forward (and backward) of `s` with storage type T (float or bf16_t), on operands allocated
// once (its own, or a set shared with other timers): time() can be called again (GemmPeakProbe
// does, between bench's steps).
template <typename T>
class ShapeTimer {
 public:
  explicit ShapeTimer(const GemmShape& s) : ShapeTimer(s, make_operands<T>({s}, 0, 0)) {}
  ShapeTimer(const GemmShape& s, std::shared_ptr<GemmOperands<T>> operands)
      : s_(s), z_(s), o_(std::move(operands)) {
    HR_CHECK(o_->inp.size() >= z_.inp && o_->weight.size() >= z_.weight &&
             o_->dout.size() >= z_.out && o_->dinp.size() >= z_.inp && o_->bias.size() >= z_.bias &&
             o_->dweight.size() >= z_.weight &&
             (z_.fp32_out ? o_->out32.size() : o_->out16.size()) >= z_.out);
  }

  // Median seconds of `reps` calls after `warmup` untimed ones (forward_only: without the
  // backward, whatever the shape says).
  double time(int warmup, int reps, bool forward_only = false) {
    const cpu::MatmulStrides st{.inp = z_.ldi, .out = z_.ldo};
    GemmOperands<T>& o = *o_;
    return time_median(warmup, reps, [&] {
      if (z_.fp32_out) {
        cpu::matmul_forward(o.out32.data(), o.inp.data(), o.weight.data(), o.bias.data(), s_.N,
                            s_.IC, s_.OC, s_.layout, st);
      } else if constexpr (!std::is_same_v<T, float>) {
        cpu::matmul_forward(o.out16.data(), o.inp.data(), o.weight.data(), o.bias.data(), s_.N,
                            s_.IC, s_.OC, s_.layout, st);
      }
      if (s_.backward && !forward_only) {
        cpu::matmul_backward(o.dinp.data(), o.dweight.data(), nullptr, o.dout.data(), o.inp.data(),
                             o.weight.data(), s_.N, s_.IC, s_.OC, s_.layout, st);
      }
    });
  }

 private:
  GemmShape s_;
  ShapeSizes<T> z_;
  std::shared_ptr<GemmOperands<T>> o_;
};

// Median seconds of one forward (and backward) of `s`.
template <typename T>
double time_shape(const GemmShape& s, const Sizes& sz) {
  return ShapeTimer<T>(s).time(sz.warmup, sz.reps);
}

// The step's matmuls in the backend's kernels (oneDNN through cpu::gemm / gemm_ex), their
// FLOPs over their median times. `name`: "fp32" or "bf16".
template <typename T>
// *best: the fastest single shape's rate.
Result<double> measure_gemm_shapes(const Sizes& sz, const char* name,
                                   const CalibrationProgress& progress, double* best,
                                   std::array<std::vector<GemmSample>, 4>* samples) {
  double total_flops = 0, total_seconds = 0;
  *best = 0;
  for (const GemmShape& s : sz.gemms) {
    const double t = time_shape<T>(s, sz);
    if (t > 0 && samples) {
      const GemmClass cls = gemm_class(s.IC, s.OC);
      (*samples)[size_t(cls)].push_back({s.flops(), double(s.N), t});
    }
    if (!(t > 0))
      return Status::internal(fmt::format("{} GEMM {} timed at 0 s", name, shape_text(s)));
    report(progress, fmt::format("{} GEMM {} forward{}: {:.1f} GFLOP/s (median of {}, {:.1f} ms)",
                                 name, shape_text(s), s.backward ? " + backward" : "",
                                 s.flops() / t / 1e9, sz.reps, t * 1e3));
    total_flops += s.weight * s.flops();
    total_seconds += s.weight * t;
    *best = std::max(*best, s.flops() / t);
  }
  return total_flops / total_seconds;  // the shapes weighted by their FLOPs in a step
}

// The peak: one square GEMM through the backend. bf16: n = 2112, dense (oneDNN 2.6 runs its AMX
// kernel only on dense bf16 rows, and rows of 2048 bf16 values, 4 KiB, alias in the cache and
// ran at half the rate of 2112's here; where the CPU has AMX, our own kernel takes it: the
// backend's bf16 GEMM, whichever runs). fp32: n = 2048 with A and C rows padded as the model pads
// its activations (activation_row_stride: gemm:jit), about twice the rate oneDNN's brgemm reached
// on dense 2112 rows here (docs/gemm.md).
template <typename T>
class SquarePeak final : public GemmPeakProbe {
 public:
  static constexpr bool fp32 = std::is_same_v<T, float>;
  static int n_for(int peak_n) { return fp32 ? peak_n - 64 : peak_n; }
  static int ld_for(int n) { return fp32 ? int(cpu::activation_row_stride(n, sizeof(float))) : n; }
  explicit SquarePeak(int peak_n)
      : SquarePeak(peak_n, make_operands<T>({}, n_for(peak_n), ld_for(n_for(peak_n)))) {}
  // A: operands.inp, B: operands.weight, C: operands.out32 (make_operands sized for this n).
  SquarePeak(int peak_n, std::shared_ptr<GemmOperands<T>> operands)
      : n_(n_for(peak_n)), ld_(ld_for(n_)), o_(std::move(operands)) {
    HR_CHECK(o_->inp.size() >= size_t(n_) * ld_ && o_->weight.size() >= size_t(n_) * n_ &&
             o_->out32.size() >= size_t(n_) * ld_);
  }

  double measure(int warmup, int reps) override {
    const DType ab = fp32 ? DType::kF32 : DType::kBF16;
    const double t = time_median(warmup, std::max(1, reps), [&] {
      cpu::gemm_ex(false, false, n_, n_, n_, ab, o_->inp.data(), ld_, o_->weight.data(), n_,
                   DType::kF32, o_->out32.data(), ld_, nullptr, false);
    });
    return t > 0 ? 2.0 * n_ * n_ * double(n_) / t : 0.0;
  }

  std::string describe() const override {
    return fmt::format("{} GEMM {}^3", fp32 ? "fp32" : "bf16", n_);
  }

  const char* impl() const {
    return cpu::gemm_impl_name(false, false, n_, n_, n_, ld_, n_, ld_, false, false,
                               fp32 ? DType::kF32 : DType::kBF16, DType::kF32);
  }
  int n() const { return n_; }

 private:
  int n_, ld_;
  std::shared_ptr<GemmOperands<T>> o_;
};

// The peak: one square GEMM through the backend. bf16: n = 2112, dense (oneDNN 2.6 runs its AMX
// kernel only on dense bf16 rows, and rows of 2048 bf16 values, 4 KiB, alias in the cache and
// ran at half the rate of 2112's here). fp32: n = 2048 with A and C rows padded as the model pads
// its activations (activation_row_stride: gemm:jit), about twice the rate oneDNN's brgemm reached
// on dense 2112 rows here (docs/gemm.md).
template <typename T>
Result<double> measure_gemm_peak(const Sizes& sz, const char* name,
                                 const CalibrationProgress& progress) {
  SquarePeak<T> probe(sz.peak_n);
  const double rate = probe.measure(sz.warmup, sz.reps);
  if (!(rate > 0)) return Status::internal(fmt::format("{} GEMM peak timed at 0 s", name));
  report(progress, fmt::format("{} GEMM peak {}^3: {:.1f} GFLOP/s ({}, median of {})", name,
                               probe.n(), rate / 1e9, probe.impl(), sz.reps));
  return rate;
}

// bf16 needs a native oneDNN kernel: 0 (unsupported) when oneDNN only has its reference
// implementation here (minutes of scalar code, and not what a bf16 plan would run on).
bool native_bf16(const CalibrationProgress& progress) {
  const char* impl = cpu::gemm_impl_name(false, false, 64, 64, 64, 64, 64, 64, false, false,
                                         DType::kBF16, DType::kF32);
  if (std::string_view(impl).rfind("ref", 0) == 0) {
    report(progress, std::string("bf16 GEMM: oneDNN has only its reference kernel (") + impl +
                         ") on this CPU; bf16 left at 0 (unsupported)");
    return false;
  }
  return true;
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

// ---- the cost model's terms (Note [Measured terms] in docs/notes/cost-model.md) -------------

// The GEMM shapes a step of gpt2-tiny / llama-tiny (C = 128) and GPT-2 124M (C = 768) runs, by
// class, each at two row counts (the class's fit needs two): the model's layouts and strides.
std::vector<std::pair<GemmClass, GemmShape>> term_gemm_shapes(bool quick) {
  using L = cpu::WeightLayout;
  std::vector<std::pair<GemmClass, GemmShape>> v;
  auto block = [&](GemmClass cls, int n, int c, int fc) {
    v.push_back({cls, {n, c, 3 * c}});
    v.push_back({cls, {n, c, c, L::kInOut, false, false, false}});
    v.push_back({cls, {n, c, fc, L::kInOut, false, true, true}});
    v.push_back({cls, {n, fc, c, L::kInOut, true, false, false}});
  };
  auto head = [&](GemmClass cls, int n, int c, int vocab) {
    v.push_back({cls, {n, c, vocab, L::kOutIn, false, false, false, true, 1.0, true}});
  };
  if (quick) {
    for (int n : {32, 128}) {
      block(GemmClass::kSmall, n, 64, 256);
      block(GemmClass::kLarge, n, 320, 1280);
      head(GemmClass::kHeadSmall, n, 64, 8192);
      head(GemmClass::kHead, n, 320, 8192);
    }
    return v;
  }
  for (int n : {256, 2048}) block(GemmClass::kSmall, n, 128, 512);
  // GPT-2's classes also at 32 rows (one sequence of 32 tokens): below ~128 rows the weight
  // gradient's GEMM (reducing over the rows) runs further below the rate than the 1/rows line
  // through 256 and 2048 rows says (measured: 0.6x its prediction at 32 rows, bf16).
  for (int n : {32, 256}) block(GemmClass::kLarge, n, 768, 3072);  // + calibrate's, at 2048
  for (int n : {64, 512, 2048}) head(GemmClass::kHeadSmall, n, 128, 50257);
  for (int n : {32, 128}) head(GemmClass::kHead, n, 768, 50257);  // + calibrate's, at 512
  return v;
}

// Samples of one class: (FLOPs, rows, median seconds).
template <typename T>
void time_gemm_terms(const std::vector<std::pair<GemmClass, GemmShape>>& shapes, int reps,
                     std::array<std::vector<GemmSample>, 4>* samples) {
  for (const auto& [cls, shape] : shapes) {
    ShapeTimer<T> timer(shape);
    const double t = timer.time(1, reps);
    // The forward alone, on the same operands: its share of the pair (what recomputation re-runs).
    const double f = shape.backward ? timer.time(1, reps, true) : 0.0;
    if (t > 0) (*samples)[size_t(cls)].push_back({shape.flops(), double(shape.N), t, f});
  }
}

template <typename T>
HostVec<T> zeros(size_t n) {
  return HostVec<T>(n);
}

// A memory-bound kernel pair at two sizes: (units, median seconds) per size.
// Small sizes run several calls per timed repetition (at least ~4M units: a few milliseconds),
// so that one scheduling hiccup of a shared machine is not a whole sample.
template <typename Fn>
std::pair<double, double> timed_pair(double units, int reps, Fn&& fn) {
  const int inner = std::clamp(int(4e6 / std::max(units, 1.0)), 1, 64);
  const double t = time_median(1, reps, [&] {
    for (int i = 0; i < inner; i++) fn();
  });
  return {units, t / inner};
}

struct KernelSizes {
  int norm_n[2], norm_c[2];
  int gelu_elems[2];
  int loss_n[2], vocab;
  int emb_b[2], emb_t, emb_c[2];
  int64_t adam[2];
};

// The attention term's shapes: GPT-2's and gpt2-tiny's widths, each at a long sequence (FLOPs
// dominate) and at a short one of many sequences (the per-(sequence, head) cost dominates).
struct AttentionShape {
  int B, T, C, NH;
};
std::vector<AttentionShape> attention_shapes(bool quick) {
  if (quick) return {{1, 64, 64, 2}, {1, 64, 128, 4}, {8, 16, 64, 2}, {4, 16, 128, 4}};
  return {{2, 256, 128, 4}, {2, 256, 768, 12}, {64, 32, 128, 4}, {8, 32, 768, 12}};
}

KernelSizes kernel_sizes(bool quick) {
  if (quick) {
    return {{64, 128}, {64, 128}, {4096, 32768}, {16, 64},          8192,
            {1, 2},    32,        {64, 128},     {1 << 14, 1 << 17}};
  }
  return {{512, 4096}, {128, 768}, {512 * 512, 2048 * 3072}, {64, 512}, 50257, {2, 8},
          256,         {128, 768}, {1 << 24, 1 << 26}};
}

// Every memory-bound term, fp32 kernels of the backend (docs/notes/cost-model.md).
Status time_kernel_terms(bool quick, int reps, CostTerms* terms,
                         const CalibrationProgress& progress) {
  const KernelSizes z = kernel_sizes(quick);
  std::vector<std::pair<double, double>> norm, gelu, residual, loss, emb;
  std::array<std::vector<std::pair<double, double>>, 2> adam;  // without, with the bf16 copy
  try {
    for (int i = 0; i < 2; i++) {
      const int N = z.norm_n[i], C = z.norm_c[i];
      HostVec<float> x = filled<float>(size_t(N) * C, 5), y = zeros<float>(size_t(N) * C),
                     dx = zeros<float>(size_t(N) * C), w = filled<float>(size_t(C), 6),
                     bias = filled<float>(size_t(C), 7), dw = zeros<float>(size_t(C)),
                     db = zeros<float>(size_t(C)), mean = zeros<float>(size_t(N)),
                     rstd = zeros<float>(size_t(N));
      norm.push_back(timed_pair(double(N) * C, reps, [&] {
        cpu::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), bias.data(),
                               N, C);
        cpu::layernorm_backward(dx.data(), dw.data(), db.data(), y.data(), x.data(), w.data(),
                                mean.data(), rstd.data(), N, C);
      }));
      residual.push_back(timed_pair(double(N) * C, reps, [&] {
        cpu::residual_forward(y.data(), x.data(), dx.data(), int64_t(N) * C);
        cpu::residual_backward(dx.data(), nullptr, y.data(), int64_t(N) * C);
      }));
    }
    for (int i = 0; i < 2; i++) {
      const int64_t n = z.gelu_elems[i];
      HostVec<float> x = filled<float>(size_t(n), 8), y = zeros<float>(size_t(n)),
                     d = filled<float>(size_t(n), 9);
      gelu.push_back(timed_pair(double(n), reps, [&] {
        cpu::gelu_forward(y.data(), x.data(), n);
        cpu::gelu_backward(d.data(), x.data(), d.data(), n);
      }));
    }
    for (int i = 0; i < 2; i++) {
      const int N = z.loss_n[i], V = z.vocab;
      HostVec<float> logits = filled<float>(size_t(N) * V, 10), losses = zeros<float>(size_t(N)),
                     lse = zeros<float>(size_t(N));
      std::vector<int32_t> targets(static_cast<size_t>(N));
      for (int r = 0; r < N; r++) targets[size_t(r)] = int32_t((r * 7919) % V);
      loss.push_back(timed_pair(double(N) * V, reps, [&] {
        cpu::cross_entropy_forward_backward_inplace(losses.data(), lse.data(), logits.data(),
                                                    targets.data(), N, V, 1e-3f, DType::kF32);
      }));
    }
    for (int i = 0; i < 2; i++) {
      const int B = z.emb_b[i], T = z.emb_t, C = z.emb_c[i], V = z.vocab;
      HostVec<float> wte = filled<float>(size_t(V) * C, 11), wpe = filled<float>(size_t(T) * C, 12),
                     out = zeros<float>(size_t(B) * T * C), dwte = zeros<float>(size_t(V) * C),
                     dwpe = zeros<float>(size_t(T) * C);
      std::vector<int32_t> tokens(static_cast<size_t>(B) * T);
      for (size_t r = 0; r < tokens.size(); r++) tokens[r] = int32_t((r * 7919) % size_t(V));
      emb.push_back(timed_pair(double(B) * T * C, reps, [&] {
        cpu::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
        cpu::embedding_backward(dwte.data(), dwpe.data(), out.data(), tokens.data(), B, T, C);
      }));
    }
    for (int i = 0; i < 2; i++) {
      const int64_t n = z.adam[i];
      HostVec<float> p = filled<float>(size_t(n), 13), g = filled<float>(size_t(n), 14),
                     m = zeros<float>(size_t(n)), v = zeros<float>(size_t(n));
      HostVec<bf16_t> copy = zeros<bf16_t>(size_t(n));
      const cpu::AdamWParams ap{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 1.0f};
      for (size_t b = 0; b < 2; b++) {
        adam[b].push_back(timed_pair(double(n), reps, [&] {
          volatile double norm = cpu::sum_squares(g.data(), n);
          (void)norm;
          cpu::adamw_update_and_zero(p.data(), g.data(), m.data(), v.data(), n, ap,
                                     b ? copy.data() : nullptr);
        }));
      }
    }
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory("calibration: cannot allocate the memory-bound kernels' operands");
  }
  terms->norm = fit_kernel(norm);
  terms->residual = fit_kernel(residual);
  terms->gelu = fit_kernel(gelu);
  terms->loss = fit_kernel(loss);
  terms->embedding = fit_kernel(emb);
  for (size_t b = 0; b < 2; b++) terms->optimizer[b] = fit_kernel(adam[b]);
  auto line = [&](const char* name, const KernelTerm& t, const char* unit) {
    report(progress, fmt::format("term {}: {:.1f} us a call + {:.3f} ns per {}", name,
                                 t.call_seconds * 1e6, t.unit_seconds * 1e9, unit));
  };
  line("norm (layernorm forward + backward)", terms->norm, "row x C");
  line("gelu (forward + backward)", terms->gelu, "element");
  line("residual (forward + backward)", terms->residual, "element");
  line("loss (one-pass cross-entropy)", terms->loss, "row x V");
  line("embedding (forward + backward)", terms->embedding, "row x C");
  line("optimizer (AdamW + zeroing + norm)", terms->optimizer[0], "parameter");
  line("optimizer (the same + the bf16 copy)", terms->optimizer[1], "parameter");
  return Status::ok();
}

// Tiled attention forward + backward at attention_shapes (units: 12 T C FLOPs per token).
template <typename T>
KernelTerm time_attention_term(bool quick, int reps) {
  const DType storage = std::is_same_v<T, float> ? DType::kF32 : DType::kBF16;
  std::vector<AttentionSample> samples;
  for (const auto& shape : attention_shapes(quick)) {
    // Plain locals: clang before 16 cannot capture structured bindings in the lambda below.
    const int B = shape.B, Tn = shape.T, C = shape.C, NH = shape.NH;
    const size_t n = size_t(B) * Tn * C;
    HostVec<T> qkv = filled<T>(3 * n, 15), out = zeros<T>(n), dout = filled<T>(n, 16),
               dqkv = zeros<T>(3 * n);
    HostVec<float> lse = zeros<float>(size_t(B) * NH * Tn),
                   fs = zeros<float>(cpu::attention_tiled_scratch_floats(B, Tn, C, NH, storage)),
                   bs = zeros<float>(
                       cpu::attention_tiled_backward_scratch_floats(B, Tn, C, NH, storage));
    const auto [units, seconds] = timed_pair(12.0 * Tn * C * double(B) * Tn, reps, [&] {
      cpu::attention_tiled_forward(out.data(), lse.data(), qkv.data(), B, Tn, C, NH, fs.data());
      cpu::attention_tiled_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B,
                                    Tn, C, NH, bs.data());
    });
    samples.push_back({double(B) * NH, units, seconds});
  }
  return fit_attention(samples);
}

// Fits every class of `samples` into `out` (one precision), reporting each.
void fit_gemm_terms(const std::array<std::vector<GemmSample>, 4>& samples, const char* name,
                    CostTerms* terms, size_t p, const CalibrationProgress& progress) {
  static constexpr const char* kNames[] = {"small", "large", "narrow head", "head"};
  std::array<GemmTerm, 2>* dst[] = {&terms->gemm_small, &terms->gemm_large, &terms->gemm_head_small,
                                    &terms->gemm_head};
  for (size_t c = 0; c < 4; c++) {
    if (samples[c].empty()) continue;
    (*dst[c])[p] = fit_gemm(samples[c]);
    report(progress, fmt::format("term {} GEMMs ({}): {:.1f} GFLOP/s at many rows, half of it at "
                                 "{:.0f} rows, forward {:.0f}% of the pair ({} samples)",
                                 name, kNames[c], (*dst[c])[p].rate / 1e9, (*dst[c])[p].half_rows,
                                 100 * (*dst[c])[p].forward_share, samples[c].size()));
  }
}

// ---- the terms in the calibration file -------------------------------------------------------

nlohmann::json terms_json(const CostTerms& t) {
  auto gemm = [](const std::array<GemmTerm, 2>& g) {
    nlohmann::json a = nlohmann::json::array();
    for (const GemmTerm& x : g)
      a.push_back(
          {{"rate", x.rate}, {"half_rows", x.half_rows}, {"forward_share", x.forward_share}});
    return a;
  };
  auto kernel = [](const KernelTerm& k) {
    return nlohmann::json{{"call_seconds", k.call_seconds}, {"unit_seconds", k.unit_seconds}};
  };
  return {{"gemm_small", gemm(t.gemm_small)},
          {"gemm_large", gemm(t.gemm_large)},
          {"gemm_head_small", gemm(t.gemm_head_small)},
          {"gemm_head", gemm(t.gemm_head)},
          {"attention", {kernel(t.attention[0]), kernel(t.attention[1])}},
          {"norm", kernel(t.norm)},
          {"gelu", kernel(t.gelu)},
          {"residual", kernel(t.residual)},
          {"loss", kernel(t.loss)},
          {"embedding", kernel(t.embedding)},
          {"optimizer", {kernel(t.optimizer[0]), kernel(t.optimizer[1])}}};
}

Result<CostTerms> terms_from_json(const nlohmann::json& j, const std::string& path) {
  CostTerms t;
  auto num = [&](const nlohmann::json& o, const char* key,
                 const std::string& where) -> Result<double> {
    if (!o.is_object() || !o.contains(key) || !o[key].is_number())
      return field_error(path, ("terms." + where + "." + key).c_str(),
                         "is missing or not a number");
    const double v = o[key].get<double>();
    if (!std::isfinite(v) || v < 0)
      return field_error(path, ("terms." + where + "." + key).c_str(), "must be finite and >= 0");
    return v;
  };
  std::pair<const char*, std::array<GemmTerm, 2>*> gemms[] = {
      {"gemm_small", &t.gemm_small},
      {"gemm_large", &t.gemm_large},
      {"gemm_head_small", &t.gemm_head_small},
      {"gemm_head", &t.gemm_head}};
  for (auto [name, dst] : gemms) {
    if (!j.contains(name) || !j[name].is_array() || j[name].size() != 2)
      return field_error(path, (std::string("terms.") + name).c_str(), "must be a list of 2");
    for (size_t p = 0; p < 2; p++) {
      const std::string where = fmt::format("{}[{}]", name, p);
      HR_ASSIGN_OR_RETURN((*dst)[p].rate, num(j[name][p], "rate", where));
      HR_ASSIGN_OR_RETURN((*dst)[p].half_rows, num(j[name][p], "half_rows", where));
      HR_ASSIGN_OR_RETURN((*dst)[p].forward_share, num(j[name][p], "forward_share", where));
      if ((*dst)[p].forward_share > 1)
        return field_error(path, ("terms." + where + ".forward_share").c_str(), "must be <= 1");
    }
  }
  if (!j.contains("attention") || !j["attention"].is_array() || j["attention"].size() != 2)
    return field_error(path, "terms.attention", "must be a list of 2");
  auto kernel = [&](const nlohmann::json& o, const std::string& where) -> Result<KernelTerm> {
    KernelTerm k;
    HR_ASSIGN_OR_RETURN(k.call_seconds, num(o, "call_seconds", where));
    HR_ASSIGN_OR_RETURN(k.unit_seconds, num(o, "unit_seconds", where));
    return k;
  };
  if (!j.contains("optimizer") || !j["optimizer"].is_array() || j["optimizer"].size() != 2)
    return field_error(path, "terms.optimizer", "must be a list of 2");
  for (size_t p = 0; p < 2; p++) {
    HR_ASSIGN_OR_RETURN(t.attention[p], kernel(j["attention"][p], fmt::format("attention[{}]", p)));
    HR_ASSIGN_OR_RETURN(t.optimizer[p], kernel(j["optimizer"][p], fmt::format("optimizer[{}]", p)));
  }
  std::pair<const char*, KernelTerm*> kernels[] = {{"norm", &t.norm},
                                                   {"gelu", &t.gelu},
                                                   {"residual", &t.residual},
                                                   {"loss", &t.loss},
                                                   {"embedding", &t.embedding}};
  for (auto [name, dst] : kernels) {
    if (!j.contains(name))
      return field_error(path, (std::string("terms.") + name).c_str(), "is missing");
    HR_ASSIGN_OR_RETURN(*dst, kernel(j[name], name));
  }
  t.fitted = t.gemm_large[0].rate > 0 && t.gemm_small[0].rate > 0 && t.gemm_head[0].rate > 0 &&
             t.gemm_head_small[0].rate > 0 && t.norm.unit_seconds > 0;
  return t;
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

// What calibrate's peak is the best of: the square GEMM and the step's four per-layer shapes, each
// timed forward and backward as calibrate times it; the rate is the best of their medians. (The
// LM head's shape, timed at a quarter of the tokens, is left out: the slowest of calibrate's
// shapes in every calibration here, ~0.6-0.9x the others.)
template <typename T>
class Probe final : public GemmPeakProbe {
 public:
  // One set of operands, sized for the largest of the five GEMMs, serves them all.
  Probe(int peak_n, const std::vector<GemmShape>& shapes)
      : Probe(peak_n, shapes,
              make_operands<T>(shapes, SquarePeak<T>::n_for(peak_n),
                               SquarePeak<T>::ld_for(SquarePeak<T>::n_for(peak_n)))) {}
  Probe(int peak_n, const std::vector<GemmShape>& shapes,
        const std::shared_ptr<GemmOperands<T>>& operands)
      : square_(peak_n, operands) {
    for (const GemmShape& s : shapes) {
      shapes_.push_back(std::make_unique<ShapeTimer<T>>(s, operands));
      flops_.push_back(s.flops());
    }
  }

  double measure(int warmup, int reps) override {
    reps = std::max(1, reps);
    double best = square_.measure(warmup, reps);
    for (size_t i = 0; i < shapes_.size(); i++) {
      const double t = shapes_[i]->time(warmup, reps);
      if (t > 0) best = std::max(best, flops_[i] / t);
    }
    return best;
  }

  std::string describe() const override {
    return fmt::format("{} and the step's four per-layer GEMMs forward and backward",
                       square_.describe());
  }

 private:
  SquarePeak<T> square_;
  std::vector<std::unique_ptr<ShapeTimer<T>>> shapes_;
  std::vector<double> flops_;
};

Result<std::unique_ptr<GemmPeakProbe>> GemmPeakProbe::create(bool bf16) {
  const Sizes sz = sizes_for({});
  const int n = sz.peak_n;
  std::vector<GemmShape> shapes;
  for (const GemmShape& s : sz.gemms) {
    if (!s.logits_rows) shapes.push_back(s);  // the four per-layer shapes, not the head's
  }
  HR_CHECK(shapes.size() == 4);
  try {
    if (!bf16) return std::unique_ptr<GemmPeakProbe>(new Probe<float>(n, shapes));
    if (!native_bf16({})) {
      return Status::unsupported("bf16 GEMM peak: oneDNN has no native bf16 kernel on this CPU");
    }
    return std::unique_ptr<GemmPeakProbe>(new Probe<bf16_t>(n, shapes));
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory(
        fmt::format("{} GEMM peak: cannot allocate its {}^3 operands", bf16 ? "bf16" : "fp32", n));
  }
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
  // The peak is the best of the square GEMM and the step's shapes: one timing of either can be
  // low on a shared machine, and MFU should never be quoted against a rate below one the
  // machine was seen to run.
  double best_shape = 0;
  // The cost model's GEMM terms: calibrate's own shapes (at 2048 rows; the head at 512) and the
  // other classes' and row counts of term_gemm_shapes, fitted per class.
  const std::vector<std::pair<GemmClass, GemmShape>> term_shapes = term_gemm_shapes(options.quick);
  const int term_reps = options.quick ? 2 : 3;
  std::array<std::vector<GemmSample>, 4> samples;
  HR_ASSIGN_OR_RETURN(cal.gemm_flops_fp32,
                      measure_gemm_shapes<float>(sz, "fp32", progress, &best_shape,
                                                 options.quick ? nullptr : &samples));
  HR_ASSIGN_OR_RETURN(double square, measure_gemm_peak<float>(sz, "fp32", progress));
  cal.gemm_peak_fp32 = std::max(square, best_shape);
  time_gemm_terms<float>(term_shapes, term_reps, &samples);
  fit_gemm_terms(samples, "fp32", &cal.terms, 0, progress);
  cal.terms.attention[0] = time_attention_term<float>(options.quick, term_reps + 2);
  if (native_bf16(progress)) {
    samples = {};
    HR_ASSIGN_OR_RETURN(cal.gemm_flops_bf16,
                        measure_gemm_shapes<bf16_t>(sz, "bf16", progress, &best_shape,
                                                    options.quick ? nullptr : &samples));
    HR_ASSIGN_OR_RETURN(square, measure_gemm_peak<bf16_t>(sz, "bf16", progress));
    cal.gemm_peak_bf16 = std::max(square, best_shape);
    time_gemm_terms<bf16_t>(term_shapes, term_reps, &samples);
    fit_gemm_terms(samples, "bf16", &cal.terms, 1, progress);
    cal.terms.attention[1] = time_attention_term<bf16_t>(options.quick, term_reps + 2);
  }
  for (size_t p = 0; p < 2; p++) {
    if (cal.terms.attention[p].unit_seconds > 0) {
      report(progress, fmt::format("term {} attention (tiled, forward + backward): {:.2f} us a "
                                   "(sequence, head) + {:.1f} GFLOP/s of 12 T C per token",
                                   p ? "bf16" : "fp32", cal.terms.attention[p].call_seconds * 1e6,
                                   1e-9 / cal.terms.attention[p].unit_seconds));
    }
  }
  HR_RETURN_IF_ERROR(time_kernel_terms(options.quick, options.quick ? 3 : 5, &cal.terms, progress));
  cal.terms.fitted = true;
  HR_ASSIGN_OR_RETURN(cal.mem_bandwidth, measure_triad(sz, progress));
  HR_ASSIGN_OR_RETURN(cal.copy_bandwidth, measure_copy(sz, progress));
  return cal;
}

Status write_calibration_file(const std::string& path, const std::string& text) {
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
    out << text;
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

Status save_calibration(const Calibration& cal, const std::string& path) {
  nlohmann::json j = {
      {"version", kFileVersion},
      {"gemm_flops_fp32", cal.gemm_flops_fp32},
      {"gemm_flops_bf16", cal.gemm_flops_bf16},
      {"gemm_peak_fp32", cal.gemm_peak_fp32},
      {"gemm_peak_bf16", cal.gemm_peak_bf16},
      {"mem_bandwidth", cal.mem_bandwidth},
      {"copy_bandwidth", cal.copy_bandwidth},
      {"threads", cal.threads},
      {"cpu_model", cal.cpu_model},
      {"date", cal.date},
      {"terms", terms_json(cal.terms)},
  };
  HR_RETURN_IF_ERROR(write_calibration_file(path, dump_json(j, 2) + "\n"));
  namespace fs = std::filesystem;
  // The self-corrections next to it scaled the old calibration's predictions: with new terms they
  // would scale the wrong figures (Note [Self-correction]), so the next runs measure them again.
  std::error_code ignored;
  fs::remove(corrections_path(path), ignored);
  return Status::ok();
}

Result<nlohmann::json> read_calibration_file(const std::string& path, std::string_view what,
                                             std::string_view remedy) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return Status::not_found(
        fmt::format("no {} '{}'; run `{}` to measure this machine", what, path, remedy));
  }
  std::ifstream in(path);
  if (!in) return Status::io_error(fmt::format("cannot open {} '{}'", what, path));
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::io_error(fmt::format("cannot read {} '{}'", what, path));
  try {
    return nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    return Status::corrupt(
        fmt::format("{} '{}' is not valid JSON ({}); delete it or run `{}` to measure again", what,
                    path, e.what(), remedy));
  }
}

Result<Calibration> load_calibration(const std::string& path) {
  HR_ASSIGN_OR_RETURN(const nlohmann::json j,
                      read_calibration_file(path, "calibration file", "headroom calibrate"));
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
  HR_ASSIGN_OR_RETURN(cal.gemm_peak_fp32, get_rate(j, path, "gemm_peak_fp32", false));
  HR_ASSIGN_OR_RETURN(cal.gemm_peak_bf16, get_rate(j, path, "gemm_peak_bf16", true));
  HR_ASSIGN_OR_RETURN(cal.mem_bandwidth, get_rate(j, path, "mem_bandwidth", false));
  HR_ASSIGN_OR_RETURN(cal.copy_bandwidth, get_rate(j, path, "copy_bandwidth", false));
  HR_ASSIGN_OR_RETURN(int64_t threads, get_int(j, path, "threads"));
  if (threads < 1 || threads > 1 << 20) {
    return field_error(path, "threads",
                       "must be between 1 and 1048576, got " + dump_json(j["threads"]));
  }
  cal.threads = static_cast<int>(threads);
  HR_ASSIGN_OR_RETURN(cal.cpu_model, get_string(j, path, "cpu_model"));
  HR_ASSIGN_OR_RETURN(cal.date, get_string(j, path, "date"));
  auto terms = j.find("terms");
  if (terms == j.end() || !terms->is_object()) return field_error(path, "terms", "is missing");
  HR_ASSIGN_OR_RETURN(cal.terms, terms_from_json(*terms, path));
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

CalibrationLock::CalibrationLock(const std::string& path, const CalibrationProgress& progress) {
  std::error_code ec;
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  fd_ = ::open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) return;
  if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) return;
  report(progress, "waiting for another process to finish calibrating ('" + path + ".lock')");
  while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
  }
}

CalibrationLock::~CalibrationLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

Result<Calibration> load_or_calibrate(const std::string& path, const CalibrationProgress& progress,
                                      const CalibrationOptions& options) {
  const CalibrationLock lock(path, progress);
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
  spec.peak_flops_fp32 = cal.gemm_peak_fp32;
  spec.peak_flops_bf16 = cal.gemm_peak_bf16;
  spec.flops_fp16 = 0;  // the CPU backend has no fp16 kernels
  spec.mem_bandwidth = cal.mem_bandwidth;
  spec.host_link_bandwidth = cal.copy_bandwidth;
  spec.host_memory_bandwidth = cal.mem_bandwidth;  // the offload tier is this host's memory
  // Ranks on one host talk through Open MPI's shared-memory transport. Not calibrated yet: the
  // all-reduce bus bandwidth bench/dist_bench measured for 64 MiB on 2 ranks of this box
  // (docs/notes/zero.md, "Measured"), a conservative figure (a loaded machine).
  spec.interconnect_bandwidth = 0.4e9;
  spec.gemm_efficiency = 1.0;  // measured figures are already sustained rates
  spec.terms = cal.terms;
  spec.source = "measured " + cal.date;
  return spec;
}

std::vector<std::string> calibration_drops(const Calibration& previous, const Calibration& now,
                                           double ratio) {
  std::vector<std::string> lines;
  if (previous.threads != now.threads || previous.cpu_model != now.cpu_model) return lines;
  struct Figure {
    const char* name;
    double old_value, new_value, unit;
    const char* unit_name;
  };
  const Figure figures[] = {
      {"fp32 GEMM rate", previous.gemm_flops_fp32, now.gemm_flops_fp32, 1e9, "GFLOP/s"},
      {"fp32 GEMM peak", previous.gemm_peak_fp32, now.gemm_peak_fp32, 1e9, "GFLOP/s"},
      {"bf16 GEMM rate", previous.gemm_flops_bf16, now.gemm_flops_bf16, 1e9, "GFLOP/s"},
      {"bf16 GEMM peak", previous.gemm_peak_bf16, now.gemm_peak_bf16, 1e9, "GFLOP/s"},
      {"memory bandwidth", previous.mem_bandwidth, now.mem_bandwidth, 1e9, "GB/s"},
      {"copy bandwidth", previous.copy_bandwidth, now.copy_bandwidth, 1e9, "GB/s"},
  };
  for (const Figure& f : figures) {
    if (f.old_value > 0 && f.new_value < ratio * f.old_value) {
      lines.push_back(fmt::format("{} {:.1f} {}, {:.2f}x the previous {:.1f}", f.name,
                                  f.new_value / f.unit, f.unit_name, f.new_value / f.old_value,
                                  f.old_value / f.unit));
    }
  }
  return lines;
}

std::string describe_calibration(const Calibration& cal) {
  std::string bf16 = cal.gemm_flops_bf16 > 0
                         ? fmt::format("{:.1f} GFLOP/s (peak {:.1f})", cal.gemm_flops_bf16 / 1e9,
                                       cal.gemm_peak_bf16 / 1e9)
                         : std::string("unsupported");
  return fmt::format(
      "{}, {} threads (measured {}): fp32 GEMM {:.1f} GFLOP/s (peak {:.1f}), bf16 GEMM {}, memory "
      "triad {:.1f} GB/s, copy {:.1f} GB/s",
      cal.cpu_model, cal.threads, cal.date, cal.gemm_flops_fp32 / 1e9, cal.gemm_peak_fp32 / 1e9,
      bf16, cal.mem_bandwidth / 1e9, cal.copy_bandwidth / 1e9);
}

}  // namespace headroom::plan
