// The device calibration (plan/device_calibration.h) on the fenced device: the CPU's ops over
// memory the host cannot touch outside an op, so the measurement reaches the device only through
// the table, as on a GPU. The rates are the CPU's (quick sizes); what is checked is that each is
// measured, cached, reloaded, refused when corrupt, and priced by the planner.
#include "plan/device_calibration.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "backend/fenced/fenced_ops.h"
#include "backend/fenced/fenced_resource.h"
#include "core/units.h"
#include "memory/adaptors.h"
#include "memory/host_resource.h"
#include "model/config.h"
#include "plan/cost_model.h"
#include "plan/memory_plan.h"

namespace headroom::plan {
namespace {

namespace fs = std::filesystem;

class DeviceCalibrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("headroom_devcal_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    const char* old = std::getenv("HEADROOM_CACHE_DIR");
    had_cache_ = old != nullptr;
    if (had_cache_) old_cache_ = old;
    ::setenv("HEADROOM_CACHE_DIR", dir_.c_str(), 1);
    device_.fence();
  }
  void TearDown() override {
    if (had_cache_) {
      ::setenv("HEADROOM_CACHE_DIR", old_cache_.c_str(), 1);
    } else {
      ::unsetenv("HEADROOM_CACHE_DIR");
    }
    fs::remove_all(dir_);
  }
  Result<DeviceCalibration> measure(std::vector<std::string>* lines = nullptr) {
    return run_device_calibration(ops_, &device_, &host_, "Fenced Test Device",
                                  [&](const std::string& l) {
                                    if (lines) lines->push_back(l);
                                  },
                                  {.quick = true});
  }

  fs::path dir_;
  bool had_cache_ = false;
  std::string old_cache_;
  backend::FencedResource device_;
  backend::FencedOps ops_{&device_};
  memory::HostResource host_;
};

void expect_rate(double r, const char* what) {
  EXPECT_TRUE(std::isfinite(r) && r > 0) << what << " = " << r;
}

// Every figure measured through the table, every buffer returned, one line per stage.
TEST_F(DeviceCalibrationTest, MeasuresEveryFigureThroughTheTable) {
  const uint64_t protects = device_.protect_calls();
  std::vector<std::string> lines;
  Result<DeviceCalibration> c = measure(&lines);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->device, "Fenced Test Device");
  EXPECT_EQ(c->date.size(), 10u);
  expect_rate(c->gemm_flops_fp32, "gemm_flops_fp32");
  expect_rate(c->gemm_flops_bf16, "gemm_flops_bf16");
  expect_rate(c->mem_bandwidth, "mem_bandwidth");
  expect_rate(c->h2d_bandwidth, "h2d_bandwidth");
  expect_rate(c->d2h_bandwidth, "d2h_bandwidth");
  EXPECT_GE(c->gemm_peak_fp32, c->gemm_flops_fp32);
  EXPECT_GE(c->gemm_peak_bf16, c->gemm_flops_bf16);
  EXPECT_GT(device_.protect_calls(), protects);  // the ops ran through the fence
  EXPECT_EQ(device_.live_blocks(), 0u);
  EXPECT_EQ(lines.size(), 5u);
  EXPECT_NE(describe_device_calibration(*c).find("Fenced Test Device: bf16 GEMM"),
            std::string::npos);
}

// A device too small for a buffer: OutOfMemory naming it, nothing left allocated.
TEST_F(DeviceCalibrationTest, TooLittleMemoryNamesTheBuffer) {
  memory::LimitResource small(&device_, 64 << 10);
  Result<DeviceCalibration> c =
      run_device_calibration(ops_, &small, &host_, "tiny", {}, {.quick = true});
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(c.status().message().find("GEMM"), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("calibrate"), std::string::npos);
  EXPECT_EQ(device_.live_blocks(), 0u);
}

TEST_F(DeviceCalibrationTest, SavesLoadsAndRefusesCorruptFiles) {
  Result<DeviceCalibration> c = measure();
  ASSERT_TRUE(c.is_ok());
  const std::string path = (dir_ / "gpu.json").string();
  ASSERT_TRUE(save_device_calibration(*c, path).is_ok());
  Result<DeviceCalibration> back = load_device_calibration(path);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->device, c->device);
  EXPECT_EQ(back->gemm_flops_bf16, c->gemm_flops_bf16);
  EXPECT_EQ(back->d2h_bandwidth, c->d2h_bandwidth);
  EXPECT_EQ(back->date, c->date);

  EXPECT_EQ(load_device_calibration((dir_ / "none.json").string()).status().code(),
            StatusCode::kNotFound);
  // A path that cannot be read as a file (a directory): an error naming it, not a calibration.
  Result<DeviceCalibration> unreadable = load_device_calibration(dir_.string());
  ASSERT_FALSE(unreadable.is_ok());
  EXPECT_NE(unreadable.status().message().find(dir_.string()), std::string::npos)
      << unreadable.status().message();
  auto write = [&](const std::string& text) { std::ofstream(path, std::ios::trunc) << text; };
  write("{\"version\": 1, \"device\": \"x\"");  // truncated
  Result<DeviceCalibration> bad = load_device_calibration(path);
  EXPECT_EQ(bad.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(bad.status().message().find(path), std::string::npos);
  // A field out of range names the field and the value.
  DeviceCalibration z = *c;
  z.mem_bandwidth = -1;
  ASSERT_TRUE(save_device_calibration(z, path).is_ok());
  bad = load_device_calibration(path);
  EXPECT_EQ(bad.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(bad.status().message().find("\"mem_bandwidth\" is -1"), std::string::npos)
      << bad.status().message();
  write("{\"version\": 7}");
  bad = load_device_calibration(path);
  EXPECT_NE(bad.status().message().find("\"version\""), std::string::npos);
}

TEST_F(DeviceCalibrationTest, ThePathIsTheDevicesNameNextToTheCpus) {
  EXPECT_EQ(device_calibration_path("NVIDIA H100 80GB HBM3"),
            (dir_ / "gpu-nvidia-h100-80gb-hbm3.json").string());
  EXPECT_EQ(device_calibration_path("NVIDIA H200"), (dir_ / "gpu-nvidia-h200.json").string());
  EXPECT_EQ(device_calibration_path("  ../x//"), (dir_ / "gpu-x.json").string());
  EXPECT_EQ(device_calibration_path(""), (dir_ / "gpu-unnamed.json").string());
}

// Measured once and cached; the next run loads it (no op runs); another device's file, or a
// corrupt one, is measured again and overwritten.
TEST_F(DeviceCalibrationTest, LoadOrCalibrateMeasuresOnceThenLoads) {
  const std::string path = device_calibration_path("Fenced Test Device");
  std::vector<std::string> lines;
  auto progress = [&](const std::string& l) { lines.push_back(l); };
  Result<DeviceCalibration> first = load_or_calibrate_device(
      path, ops_, &device_, &host_, "Fenced Test Device", progress, {.quick = true});
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  ASSERT_TRUE(fs::exists(path));
  EXPECT_NE(lines.front().find("measuring the device (once)"), std::string::npos);
  const uint64_t protects = device_.protect_calls();
  lines.clear();
  Result<DeviceCalibration> second = load_or_calibrate_device(
      path, ops_, &device_, &host_, "Fenced Test Device", progress, {.quick = true});
  ASSERT_TRUE(second.is_ok());
  EXPECT_EQ(second->gemm_flops_fp32, first->gemm_flops_fp32);
  EXPECT_EQ(device_.protect_calls(), protects);  // loaded: nothing ran on the device
  EXPECT_TRUE(lines.empty());
  Result<DeviceCalibration> other = load_or_calibrate_device(
      path, ops_, &device_, &host_, "Another Device", progress, {.quick = true});
  ASSERT_TRUE(other.is_ok());
  EXPECT_EQ(other->device, "Another Device");
  EXPECT_NE(lines.front().find("measured on Fenced Test Device"), std::string::npos);
  EXPECT_EQ(load_device_calibration(path)->device, "Another Device");
  std::ofstream(path, std::ios::trunc) << "not json";
  lines.clear();
  ASSERT_TRUE(load_or_calibrate_device(path, ops_, &device_, &host_, "Another Device", progress,
                                       {.quick = true})
                  .is_ok());
  EXPECT_NE(lines.front().find("not valid JSON"), std::string::npos);
  EXPECT_TRUE(load_device_calibration(path).is_ok());
}

// The planner prices with the measured figures: a GPU measured at half its datasheet's
// sustained GEMM rate predicts a slower step; MFU stays quoted against the datasheet's peak; the
// offload copies move at the measured pinned rate.
TEST_F(DeviceCalibrationTest, TheSpecIsPricedWithTheMeasuredFigures) {
  Result<DeviceSpec> h200 = named_device("H200");
  ASSERT_TRUE(h200.is_ok());
  DeviceCalibration c;
  c.device = "NVIDIA H200";
  c.date = "2026-12-06";
  c.gemm_flops_bf16 = 0.5 * h200->flops_bf16 * h200->gemm_efficiency;
  c.gemm_flops_fp32 = 0.5 * h200->flops_fp32 * h200->gemm_efficiency;
  c.gemm_peak_bf16 = h200->flops_bf16;
  c.gemm_peak_fp32 = h200->flops_fp32;
  c.mem_bandwidth = 0.5 * h200->mem_bandwidth;
  c.h2d_bandwidth = 50e9;
  c.d2h_bandwidth = 40e9;
  const DeviceSpec m = apply_device_calibration(*h200, c, "/x/gpu-nvidia-h200.json");
  EXPECT_EQ(m.flops_bf16, c.gemm_flops_bf16);
  EXPECT_EQ(m.flops_fp32, c.gemm_flops_fp32);
  EXPECT_EQ(m.gemm_efficiency, 1.0);
  EXPECT_EQ(m.peak_flops_bf16, h200->flops_bf16);  // MFU's denominator: the datasheet
  EXPECT_EQ(m.peak_flops_fp32, h200->flops_fp32);
  EXPECT_EQ(m.flops_fp16, c.gemm_flops_bf16 * h200->flops_fp16 / h200->flops_bf16);
  EXPECT_EQ(m.mem_bandwidth, c.mem_bandwidth);
  EXPECT_EQ(offload_link_bandwidth(m), 40e9);
  EXPECT_EQ(m.memory_bytes, h200->memory_bytes);
  EXPECT_EQ(m.backend_fixed.total(), h200->backend_fixed.total());
  EXPECT_NE(m.source.find("measured 2026-12-06 on NVIDIA H200"), std::string::npos);

  const model::Gpt2Config gpt2 = *model::preset_config("gpt2");  // GPT-2 124M
  Policy p;
  p.micro_batch = 8;
  p.seq = 1024;
  p.precision = "bf16";
  Result<MemoryPlan> mp = plan_training_memory(gpt2, p);
  ASSERT_TRUE(mp.is_ok()) << mp.status().to_string();
  const double datasheet = estimate_step(gpt2, *mp, *h200).step_seconds;
  const double measured = estimate_step(gpt2, *mp, m).step_seconds;
  EXPECT_GT(measured, 1.5 * datasheet);  // GEMMs and memory-bound kernels at half the rate
  EXPECT_LT(measured, 2.5 * datasheet);
}

}  // namespace
}  // namespace headroom::plan
