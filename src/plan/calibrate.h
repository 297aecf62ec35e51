// `headroom calibrate`: measure what this CPU sustains (GEMM FLOP/s, memory and copy bytes/s) so
// that the cost model prices plans with this machine's figures, and cache them on disk so the
// few seconds of measuring are paid once per machine and thread count.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/status.h"
#include "plan/device_spec.h"

namespace headroom::plan {

// Measured figures of this machine. Rates are sustained (median of repetitions), not peaks.
struct Calibration {
  double gemm_flops_fp32 = 0;  // FLOP/s of the backend's fp32 matmuls, forward and backward, on
                               // GPT-2 small's shapes with the model's strides and layouts
  double gemm_flops_bf16 = 0;  // the same with bf16 operands (fp32 accumulate, the model's output
                               // types); 0 when oneDNN has no native bf16 kernel here
  double gemm_peak_fp32 = 0;   // FLOP/s of the best of a square 2112^3 GEMM and the shapes above:
  double gemm_peak_bf16 = 0;   // the peak MFU is quoted against (bf16: 0 when unsupported)
  double mem_bandwidth = 0;    // bytes/s, STREAM triad a = b + s*c over arrays far larger than
                               // the last-level cache, counted as STREAM does (3 x 8 bytes per
                               // element; the write-allocate read is not counted)
  double copy_bandwidth = 0;   // bytes/s, one-thread memcpy between two buffers, each byte counted
                               // once (as cudaMemcpy bandwidth is): the host<->offload-pool rate
  // The cost model's measured terms: each kind of op's kernels timed at the shapes GPT-2 124M and
  // the tiny presets run, fitted (plan/cost_terms.h; docs/notes/cost-model.md, "Measured terms").
  CostTerms terms;
  int threads = 0;        // OpenMP threads the figures were measured with
  std::string cpu_model;  // /proc/cpuinfo "model name", or "unknown"
  std::string date;       // UTC "YYYY-MM-DD"
};

struct CalibrationOptions {
  // Small sizes (1 MiB arrays, small GEMMs), well under a second: for tests only. The figures
  // then measure caches, not memory: never save them where a real run would load them.
  bool quick = false;
};

// Called with one human-readable line per stage ("fp32 GEMM 2048x768x3072: ...").
using CalibrationProgress = std::function<void(const std::string&)>;

// Measures this machine with the current OpenMP thread count (omp_get_max_threads()); a few
// seconds in total, ~1 GiB of memory at the peak (768 MiB triad arrays, freed before the 2 x 256
// MiB copy buffers). Returns OutOfMemory if the buffers cannot be allocated.
// Thread safety: call from one thread; it uses every OpenMP thread and the shared GEMM cache.
Result<Calibration> run_calibration(const CalibrationProgress& progress = {},
                                    const CalibrationOptions& options = {});

// What calibrate's peak is the best of, kept in this process to be timed again later: the square
// GEMM (bf16 2112^3 dense, fp32 2048^3 with the model's padded rows) and the step's four per-layer
// shapes forward and backward (2048 tokens: c_attn, attention c_proj, c_fc, MLP c_proj), the best
// of them (calibrate's LM-head shape, never the best here, is left out). `headroom bench` times it
// between its steps so that MFU can be quoted against the machine's speed at that moment (on a
// shared host it moves by 1.4-2x within minutes, the cached calibration's with it;
// docs/calibration.md). Operands are allocated (and touched) once, ~120 MiB bf16 / ~200 MiB fp32,
// outside any device plan. Thread safety: one thread, as run_calibration.
class GemmPeakProbe {
 public:
  // bf16: the bf16 GEMM (needs a native oneDNN kernel: Unsupported otherwise), else fp32.
  // OutOfMemory if the operands cannot be allocated.
  static Result<std::unique_ptr<GemmPeakProbe>> create(bool bf16);
  virtual ~GemmPeakProbe() = default;
  // FLOP/s of the median of `reps` timed calls after `warmup` untimed ones (reps >= 1).
  virtual double measure(int warmup, int reps) = 0;
  // "bf16 GEMM 2112^3 and the step's four per-layer GEMMs forward and backward" (fp32: 2048^3)
  virtual std::string describe() const = 0;
};

// JSON file (one object, keys as the fields above plus "version": 1), written atomically
// (temporary file + rename), creating the parent directories. IoError if it cannot be written.
Status save_calibration(const Calibration& calibration, const std::string& path);

// NotFound if `path` does not exist; IoError if it cannot be read; Corrupt, naming the file and
// the field, if it is not valid JSON or a field is missing, of the wrong type or out of range
// (rates must be finite and > 0, bf16 >= 0, threads >= 1).
Result<Calibration> load_calibration(const std::string& path);

// What a fresh calibration lost against the one it replaces on the same machine (same thread
// count and CPU model; nothing otherwise): one line per figure below `ratio` (e.g. 0.6) times the
// old one, naming it with both values, e.g. "bf16 GEMM peak 344.1 GFLOP/s, 0.22x the previous
// 1588.6". A machine busy with other work measures low, and MFU and plans priced on those figures
// would be wrong; the caller warns (the figures are still what was measured, and are saved).
std::vector<std::string> calibration_drops(const Calibration& previous, const Calibration& now,
                                           double ratio);

// $HEADROOM_CACHE_DIR/calibration.json, else $XDG_CACHE_HOME/headroom/calibration.json, else
// $HOME/.cache/headroom/calibration.json (empty variables count as unset).
std::string default_calibration_path();

// The calibration to price plans with: the file at `path` if it loads and matches this machine
// (same OpenMP thread count and CPU model), else a fresh measurement saved to `path`. A missing,
// stale or corrupt file is re-measured and overwritten (it is a cache); that, and a failure to
// save, are reported through `progress`, and the measurement is still returned.
// Only one process measures at a time: the file is guarded by an advisory lock on `path`.lock
// (flock), held while loading and, if needed, measuring and saving. Several ranks on one machine
// (`mpirun -np 2`) therefore calibrate once: the first measures, the others wait, then load its
// figures when their thread count matches (the cache's key is the per-rank thread count).
Result<Calibration> load_or_calibrate(const std::string& path,
                                      const CalibrationProgress& progress = {},
                                      const CalibrationOptions& options = {});

// This CPU as a device: the measured rates (gemm_efficiency 1: they are already sustained), no
// fp16 kernels (flops_fp16 0), memory_bytes = the device budget (--device-memory), name "cpu",
// source "measured YYYY-MM-DD"; peak_flops_* the square-GEMM peaks.
DeviceSpec cpu_device_spec(const Calibration& calibration, uint64_t memory_bytes);

// "<model>, <threads> threads: fp32 GEMM 123.4 GFLOP/s, bf16 GEMM ..., triad 12.3 GB/s, copy ..."
std::string describe_calibration(const Calibration& calibration);

// Writes `text` to `path` atomically (a temporary file renamed over it), creating the parent
// directories; IoError, naming the file and suggesting HEADROOM_CACHE_DIR, if it cannot.
Status write_calibration_file(const std::string& path, const std::string& text);

// The JSON of the calibration file at `path` (`what`: "calibration file", "device calibration
// file"; `remedy`: what to run, e.g. "headroom calibrate"). NotFound if it does not exist,
// IoError if it cannot be opened or read, Corrupt if it is not valid JSON; each names the file
// and says to run `remedy`.
Result<nlohmann::json> read_calibration_file(const std::string& path, std::string_view what,
                                             std::string_view remedy);

// An advisory lock on `path`.lock for this scope (flock: released when the descriptor closes,
// also when the process dies), so that one process of several measures and the others load its
// figures. Waiting is reported through `progress`. Without a lock file (an unwritable directory)
// nothing is locked: the calibration still runs, possibly twice.
class CalibrationLock {
 public:
  CalibrationLock(const std::string& path, const CalibrationProgress& progress);
  ~CalibrationLock();
  CalibrationLock(const CalibrationLock&) = delete;
  CalibrationLock& operator=(const CalibrationLock&) = delete;

 private:
  int fd_ = -1;
};

// The current OpenMP thread count and CPU model, as run_calibration() records them.
int calibration_threads();
std::string current_cpu_model();

}  // namespace headroom::plan
