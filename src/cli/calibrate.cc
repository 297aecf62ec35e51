// `headroom calibrate`: measures this machine (or, with --device cuda, its GPU) for the cost
// model and warns about figures far below the previous ones.
#include "cli/common.h"

#include <cstdio>

#include <fmt/format.h>

#include "core/check.h"
#include "core/log.h"
#include "core/utf8.h"
#include "plan/calibrate.h"
#include "plan/device_calibration.h"
#include "train/run_request.h"

namespace headroom::cli {

// A fresh calibration's figure below this fraction of the cached one is warned about.
constexpr double kCalibrationDropWarning = 0.6;

namespace {

// `calibrate --device cuda`: the GPU through its op table, saved where `train --device cuda`
// looks for it (plan::device_calibration_path).
int run_calibrate_gpu(bool as_json) {
  Result<train::GpuRun> gpu =
      train::open_gpu(std::nullopt, /*managed=*/false, train::GpuCalibration::kMeasureAgain,
                      [&](const std::string& line) {
                        if (!as_json) std::fprintf(stderr, "  %s\n", line.c_str());
                      });
  if (!gpu.is_ok()) return fail(gpu.status());
  HR_CHECK(gpu->calibration.has_value());  // kMeasureAgain returns the measurement's error
  const plan::DeviceCalibration& c = *gpu->calibration;
  const std::string path = plan::device_calibration_path(c.device);
  if (Status s = plan::save_device_calibration(c, path); !s.is_ok()) return fail(s);
  if (as_json) {
    json j = {{"device", c.device},
              {"gemm_flops_fp32", c.gemm_flops_fp32},
              {"gemm_flops_bf16", c.gemm_flops_bf16},
              {"gemm_peak_fp32", c.gemm_peak_fp32},
              {"gemm_peak_bf16", c.gemm_peak_bf16},
              {"mem_bandwidth", c.mem_bandwidth},
              {"h2d_bandwidth", c.h2d_bandwidth},
              {"d2h_bandwidth", c.d2h_bandwidth},
              {"date", c.date},
              {"path", path},
              {"datasheet", gpu->spec.name}};
    std::printf("%s\n", dump_json(j, 2).c_str());
  } else {
    std::printf("%s\nsaved to %s\n", plan::describe_device_calibration(c).c_str(), path.c_str());
  }
  return 0;
}

}  // namespace

int run_calibrate(bool as_json, const std::string& device) {
  if (device == "cuda") return run_calibrate_gpu(as_json);
  if (device != "cpu") {
    return fail(Status::invalid_argument(
        fmt::format("calibrate --device {}: use cpu (this machine) or cuda (its GPU)", device)));
  }
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

}  // namespace headroom::cli
