// `headroom calibrate --device cuda`: what a GPU sustains, measured through its op table (the
// GEMMs the model runs, device memory bandwidth, pinned copies each way), so that plans on that
// GPU are priced with its figures instead of the datasheet's; cached per device name next to the
// CPU's calibration. The measurement is written against backend::Ops and memory resources only:
// the fenced device (CPU memory behind the op table) runs it in tests, a GPU in production.
// See docs/notes/cuda.md, "Calibration on the GPU".
#pragma once

#include <string>
#include <string_view>

#include "backend/ops.h"
#include "core/status.h"
#include "memory/resource.h"
#include "plan/calibrate.h"
#include "plan/device_spec.h"

namespace headroom::plan {

// Measured figures of one device. Rates are sustained (medians of timed repetitions).
struct DeviceCalibration {
  std::string device;          // the device's name as the runtime reports it ("NVIDIA H200")
  double gemm_flops_fp32 = 0;  // FLOP/s, GPT-2 124M's four per-layer GEMMs forward and backward
  double gemm_flops_bf16 = 0;  // (the model's layouts; bf16: bf16 operands, fp32 accumulation)
  double gemm_peak_fp32 = 0;   // FLOP/s, the best of a square GEMM and the shapes above
  double gemm_peak_bf16 = 0;
  double mem_bandwidth = 0;  // bytes/s, out = a + b over arrays far beyond the caches, 12 bytes
                             // counted per fp32 element (STREAM's "add")
  double h2d_bandwidth = 0;  // bytes/s, host (pinned) -> device, one large copy
  double d2h_bandwidth = 0;  // bytes/s, device -> host (pinned)
  std::string date;          // UTC "YYYY-MM-DD"
};

struct DeviceCalibrationOptions {
  // Small sizes (a few MiB, 256-wide GEMMs): for tests. The figures then measure caches and
  // launch overheads; never save them where a real run would load them.
  bool quick = false;
};

// Measures the device behind `ops`: buffers from `device` (its memory: about 800 MiB at the
// peak, freed before returning), copies to and from `host` (page-locked memory on a GPU, so that
// the copies run at the link's rate). A few seconds on a GPU. OutOfMemory (naming the buffer) if
// a buffer cannot be allocated. Thread safety: one thread; the op table's stream is its own.
Result<DeviceCalibration> run_device_calibration(const backend::Ops& ops,
                                                 memory::MemoryResource* device,
                                                 memory::MemoryResource* host,
                                                 std::string device_name,
                                                 const CalibrationProgress& progress = {},
                                                 const DeviceCalibrationOptions& options = {});

// JSON (one object: "version" and the fields above), written atomically.
Status save_device_calibration(const DeviceCalibration& c, const std::string& path);
// NotFound if `path` does not exist; Corrupt, naming the file and the field, if it is not valid
// JSON or a field is missing, mistyped or out of range (rates finite and > 0, a device name).
Result<DeviceCalibration> load_device_calibration(const std::string& path);

// The cache file of the device named `device_name`, next to default_calibration_path():
// "<dir>/gpu-nvidia-h200.json" (lower case; every run of other characters one '-').
std::string device_calibration_path(std::string_view device_name);

// The file at `path` if it loads and names `device_name`, else a fresh measurement (through
// `ops`, `device`, `host`, as run_device_calibration) saved there; a stale, corrupt or unsaved
// file is reported through `progress`. Guarded by CalibrationLock on `path`: the ranks of one
// machine measure once.
Result<DeviceCalibration> load_or_calibrate_device(const std::string& path, const backend::Ops& ops,
                                                   memory::MemoryResource* device,
                                                   memory::MemoryResource* host,
                                                   const std::string& device_name,
                                                   const CalibrationProgress& progress = {},
                                                   const DeviceCalibrationOptions& options = {});

// `spec` (a named GPU's datasheet figures) priced with the measured ones: the GEMM rates as
// sustained figures (gemm_efficiency 1; fp16 at the measured bf16 rate times the datasheet's
// fp16/bf16 ratio), the measured memory bandwidth, the host link and the offload copies at the
// slower of the two pinned directions. MFU stays quoted against the datasheet peaks (peak_flops_*
// set to them), as for any GPU. source "measured YYYY-MM-DD on <device> (<path>)".
DeviceSpec apply_device_calibration(DeviceSpec spec, const DeviceCalibration& c,
                                    std::string_view path);

// "NVIDIA H200: bf16 GEMM 612.3 TFLOP/s (peak 701.2), fp32 GEMM ..., memory 3.91 TB/s, ..."
std::string describe_device_calibration(const DeviceCalibration& c);

}  // namespace headroom::plan
