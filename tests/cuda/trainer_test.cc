// The trainer on the GPU (docs/notes/device-trainer.md): run_training through the CUDA op table,
// every planned region on cudaMalloc'd memory (CudaDeviceResource), against the same run on the
// CPU. The fenced device proves bit for bit on the CPU that the path touches device memory only
// through the table; here the device's own arithmetic runs, so the runs agree within rounding
// (fp32 without TF32: the GEMMs' summation order; bf16: its rounding), and the rest exactly: the
// steps, the tokens, the re-plans, out-of-memory recoveries, the measured peak = the planned one.
// Two GPU runs are the same bits (the CUDA kernels reduce in a fixed order). Skips, saying why,
// without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "../train/train_test_util.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/device_memory.h"
#include "core/units.h"
#include "cuda_test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using train::test::RunOutput;

class CudaTrainer : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    ops_ = cudatest::ops_and_leaf(&leaf_, &why);
    if (ops_ == nullptr) GTEST_SKIP() << "no CUDA device: " << why;
    dir_ = train::test::fresh_test_dir("headroom_cuda_trainer");
    data_ = (dir_ / "data.tok").string();
    train::test::write_random_tokens(data_, 11, 30000);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  train::TrainOptions options(model::Precision precision) const {
    train::TrainOptions o;
    o.config = train::test::tiny_config();
    o.model_name = "tiny";
    o.data = data_;
    o.seq = 16;
    o.micro_batch = 2;
    o.accumulation = 2;
    o.steps = 4;
    o.warmup_steps = 2;
    o.device_memory = uint64_t(1) << 30;
    o.eval_every = 2;
    o.eval_batches = 2;
    o.eval_at_start = true;
    o.exec.precision = precision;
    return o;
  }

  RunOutput run_gpu(train::TrainOptions o,
                    std::function<void(const train::StepStats&)> on_step = nullptr) {
    o.ops = ops_;
    o.device_leaf = leaf_.get();
    return train::test::run_collecting(o, std::move(on_step));
  }

  // Every step within `rel` of the CPU's (losses, validation, norms), the same tokens and
  // micro-batches, and the final weights within `atol` (AdamW moves a weight whose gradient is
  // at rounding level by up to lr a step, either way, so the weights' bound is a fraction of lr
  // times the steps).
  static void expect_close(const RunOutput& gpu, const RunOutput& cpu, double rel, double atol) {
    ASSERT_EQ(gpu.steps.size(), cpu.steps.size());
    for (size_t i = 0; i < gpu.steps.size(); i++) {
      SCOPED_TRACE(::testing::Message() << "step " << cpu.steps[i].step);
      const train::StepStats &g = gpu.steps[i], &c = cpu.steps[i];
      EXPECT_NEAR(g.loss, c.loss, rel * std::fabs(c.loss));
      EXPECT_NEAR(g.grad_norm, c.grad_norm, rel * std::fabs(c.grad_norm) + 1e-6);
      ASSERT_EQ(g.val_loss.has_value(), c.val_loss.has_value());
      if (c.val_loss) {
        EXPECT_NEAR(*g.val_loss, *c.val_loss, rel * std::fabs(*c.val_loss));
      }
      EXPECT_EQ(g.tokens, c.tokens);
      EXPECT_EQ(g.micro_batch, c.micro_batch);
      EXPECT_EQ(g.skipped, c.skipped);
    }
    ASSERT_EQ(gpu.params.size(), cpu.params.size());
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < cpu.params.size(); i++) {
      const double d = std::fabs(double(gpu.params[i]) - double(cpu.params[i]));
      if (!(d <= worst)) {
        worst = std::isnan(d) ? INFINITY : d;
        at = i;
      }
    }
    EXPECT_LE(worst, atol) << "final weight " << at << ": " << gpu.params[at] << " on the GPU, "
                           << cpu.params[at] << " on the CPU";
  }

  const backend::Ops* ops_ = nullptr;
  std::unique_ptr<backend::cuda::CudaDeviceResource> leaf_;
  fs::path dir_;
  std::string data_;
};

TEST_F(CudaTrainer, MatchesTheCpuWithinRounding) {
  struct Case {
    const char* name;
    model::Precision precision;
    int head_chunk;
    model::Recompute recompute;
    double rel, atol;
  };
  const Case cases[] = {
      {"fp32", model::Precision::kFp32, 0, model::Recompute::kNone, 1e-4, 2e-3},
      {"fp32, fused head, full recompute", model::Precision::kFp32, 8, model::Recompute::kFull,
       1e-4, 2e-3},
      {"bf16", model::Precision::kBf16, 0, model::Recompute::kNone, 2e-2, 2e-2},
      {"bf16, fused head, selective", model::Precision::kBf16, 8, model::Recompute::kSelective,
       2e-2, 2e-2},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    train::TrainOptions o = options(c.precision);
    o.exec.head_chunk = c.head_chunk;
    if (c.recompute != model::Recompute::kNone)
      o.exec.recompute.assign(size_t(o.config.n_layer), c.recompute);
    const RunOutput cpu = train::test::run_collecting(o);
    ASSERT_TRUE(cpu.result.is_ok()) << cpu.result.status().to_string();
    const RunOutput gpu = run_gpu(o);
    ASSERT_TRUE(gpu.result.is_ok()) << gpu.result.status().to_string();
    expect_close(gpu, cpu, c.rel, c.atol);
    // Every planned byte came from the device leaf, as planned.
    EXPECT_EQ(gpu.result->device_bytes_peak, gpu.result->planned_peak_bytes);
  }
}

TEST_F(CudaTrainer, TwoRunsAreTheSameBits) {
  train::TrainOptions o = options(model::Precision::kBf16);
  o.exec.head_chunk = 8;
  const RunOutput a = run_gpu(o), b = run_gpu(o);
  ASSERT_TRUE(a.result.is_ok() && b.result.is_ok());
  ASSERT_EQ(a.steps.size(), b.steps.size());
  for (size_t i = 0; i < a.steps.size(); i++) {
    EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(a.steps[i].grad_norm, b.steps[i].grad_norm) << "step " << i + 1;
  }
  ASSERT_EQ(a.params.size(), b.params.size());
  EXPECT_EQ(0, std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)));
}

// The elastic paths on real device memory: a failed step allocation re-plans and retries, and a
// budget file lowered mid-run re-plans the step region, as on the CPU (the same decisions).
TEST_F(CudaTrainer, OutOfMemoryAndBudgetReplansAsOnTheCpu) {
  train::TrainOptions base = options(model::Precision::kFp32);
  base.eval_every = 2;
  {
    SCOPED_TRACE("out-of-memory recoveries");
    train::TrainOptions o = base;
    o.fail_step_allocations = {1, 3};
    const RunOutput cpu = train::test::run_collecting(o);
    const RunOutput gpu = run_gpu(o);
    ASSERT_TRUE(cpu.result.is_ok() && gpu.result.is_ok()) << gpu.result.status().to_string();
    EXPECT_EQ(gpu.result->oom_recoveries, 2);
    EXPECT_EQ(gpu.result->oom_recoveries, cpu.result->oom_recoveries);
    expect_close(gpu, cpu, 1e-4, 2e-3);
    EXPECT_EQ(gpu.result->device_bytes_peak, gpu.result->planned_peak_bytes);
  }
  {
    SCOPED_TRACE("budget lowered after step 1");
    const std::string budget = (dir_ / "budget").string();
    auto write_budget = [&](uint64_t bytes) {
      std::ofstream f(budget, std::ios::trunc);
      f << bytes << "\n";
    };
    train::TrainOptions o = base;
    o.micro_batch = 3;
    o.accumulation = 2;
    plan::Policy p3{3, 2, o.seq, "fp32", o.exec}, p2{2, 3, o.seq, "fp32", o.exec};
    p3.ops = p2.ops = ops_;
    Result<plan::MemoryPlan> mp3 = plan::plan_training_memory(o.config, p3);
    Result<plan::MemoryPlan> mp2 = plan::plan_training_memory(o.config, p2);
    ASSERT_TRUE(mp3.is_ok() && mp2.is_ok());
    ASSERT_LT(mp2->step_bytes, mp3->step_bytes);
    o.device_memory = mp3->peak_bytes + 64 * kKiB;
    o.device_memory_file = budget;
    const uint64_t lowered = mp3->persistent_bytes + (mp2->step_bytes + mp3->step_bytes) / 2;
    write_budget(o.device_memory);
    const RunOutput gpu = run_gpu(o, [&](const train::StepStats& s) {
      if (s.step == 1) write_budget(lowered);
    });
    ASSERT_TRUE(gpu.result.is_ok()) << gpu.result.status().to_string();
    EXPECT_EQ(gpu.result->replans, 1);
    ASSERT_GE(gpu.steps.size(), 2u);
    EXPECT_EQ(gpu.steps[1].micro_batch, 2);
    EXPECT_EQ(gpu.result->device_bytes_peak, gpu.result->planned_peak_bytes);
  }
}

}  // namespace
}  // namespace headroom
