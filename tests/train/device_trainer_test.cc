// The trainer's device path (a backend the host cannot address, docs/notes/device-trainer.md)
// run on the fenced device (backend/fenced, docs/notes/fenced-device.md): the CPU's ops over
// memory that is PROT_NONE outside every op, so any host read or write of a planned region by the
// trainer, the model, the loader or the checkpoints dies with SIGSEGV. Each run is compared with
// the same run on the CPU: the same losses, validation losses, gradient norms and final weights
// bit for bit, the same files saved, a resume equal to the uninterrupted run, and the measured
// peak the planned one.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "backend/fenced/fenced_ops.h"
#include "core/units.h"
#include "fenced_test_util.h"
#include "plan/memory_plan.h"
#include "train_test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using train::test::RunOutput;

using train::test::read_tree;

struct Variant {
  const char* name;
  model::Precision precision;
  int head_chunk;  // 0: the full logits buffer
  model::Recompute recompute;
  bool bf16_weight_copy = true;
};

class DeviceTrainer : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = train::test::fresh_test_dir("headroom_fenced");
    data_ = (dir_ / "data.tok").string();
    train::test::write_random_tokens(data_, 11, 30000);
  }
  void TearDown() override { fs::remove_all(dir_); }

  train::TrainOptions options(const std::string& out, const Variant& v) {
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
    o.eval_every = 2;  // validation after steps 2 and 4
    o.eval_batches = 2;
    o.eval_at_start = true;
    o.exec.precision = v.precision;
    o.exec.head_chunk = v.head_chunk;
    o.exec.bf16_weight_copy = v.bf16_weight_copy;
    if (v.recompute != model::Recompute::kNone)
      o.exec.recompute.assign(size_t(o.config.n_layer), v.recompute);
    o.out_dir = (dir_ / out).string();
    return o;
  }

  // `o` on the fenced device, fenced from before the first allocation; every block is returned
  // by the end.
  RunOutput run_fenced(train::TrainOptions o,
                       std::function<bool(const train::StepStats&)> stop = nullptr) {
    return train::test::run_fenced(std::move(o), nullptr, std::move(stop));
  }

  // The two runs' every step alike, bit for bit, and the final weights.
  static void expect_same(const RunOutput& a, const RunOutput& b) {
    train::test::expect_same_bits(a, b);
  }

  fs::path dir_;
  std::string data_;
};

const Variant kVariants[] = {
    {"fp32", model::Precision::kFp32, 0, model::Recompute::kNone},
    {"fp32 fused head, selective recompute", model::Precision::kFp32, 8,
     model::Recompute::kSelective},
    {"bf16", model::Precision::kBf16, 0, model::Recompute::kNone},
    {"bf16 fused head, full recompute, weights cast per use", model::Precision::kBf16, 8,
     model::Recompute::kFull, false},
};

TEST_F(DeviceTrainer, MatchesTheCpuBitForBit) {
  int index = 0;
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name);
    const std::string tag = std::to_string(index++);
    train::TrainOptions o = options("cpu" + tag, v);
    o.save_every = 2;
    const RunOutput cpu = train::test::run_collecting(o);
    ASSERT_TRUE(cpu.result.is_ok()) << cpu.result.status().to_string();
    o.out_dir = (dir_ / ("fenced" + tag)).string();
    const RunOutput dev = run_fenced(o);
    ASSERT_TRUE(dev.result.is_ok()) << dev.result.status().to_string();
    ASSERT_EQ(dev.steps.size(), 4u);
    expect_same(dev, cpu);
    ASSERT_TRUE(dev.steps[1].val_loss.has_value());
    EXPECT_EQ(dev.result->initial_val_loss, cpu.result->initial_val_loss);
    EXPECT_TRUE(dev.result->initial_val_loss.has_value());
    EXPECT_EQ(dev.result->final_val_loss, cpu.result->final_val_loss);
    // The plan is the allocation on the device too: measured peak = planned peak, as on the CPU.
    EXPECT_EQ(dev.result->device_bytes_peak, dev.result->planned_peak_bytes);
    EXPECT_EQ(cpu.result->device_bytes_peak, cpu.result->planned_peak_bytes);
    EXPECT_EQ(dev.result->planned_peak_bytes, cpu.result->planned_peak_bytes);
    for (const train::StepStats& s : dev.steps)
      EXPECT_EQ(s.device_bytes_peak, s.planned_peak_bytes) << "step " << s.step;
    // The model and the checkpoints (after steps 2 and 4) are the CPU run's, byte for byte.
    const std::map<std::string, std::string> cpu_files = read_tree(dir_ / ("cpu" + tag));
    const std::map<std::string, std::string> dev_files = read_tree(dir_ / ("fenced" + tag));
    EXPECT_TRUE(cpu_files.count("model.safetensors"));
    EXPECT_TRUE(cpu_files.count("checkpoints/step-000002/trainer_state.json"));
    train::test::expect_same_files(cpu_files, dev_files);
  }
}

// 4 steps straight, and 2 + checkpoint + resume + 2, on the fenced device: the same every step
// and the same final weights. And a checkpoint the CPU wrote continues on the device exactly.
TEST_F(DeviceTrainer, ResumeEqualsTheUninterruptedRun) {
  for (const Variant& v : {kVariants[0], kVariants[2]}) {
    SCOPED_TRACE(v.name);
    const std::string tag = v.precision == model::Precision::kBf16 ? "bf16" : "fp32";
    const RunOutput straight = run_fenced(options("straight-" + tag, v));
    ASSERT_TRUE(straight.result.is_ok()) << straight.result.status().to_string();

    train::TrainOptions a = options("cut-" + tag, v);
    a.save_every = 2;
    const RunOutput first = run_fenced(a, [](const train::StepStats& s) { return s.step == 2; });
    ASSERT_TRUE(first.result.is_ok()) << first.result.status().to_string();
    EXPECT_TRUE(first.result->stopped);
    train::TrainOptions b = options("cut-" + tag, v);
    b.save_every = 2;
    b.eval_at_start = false;
    b.resume = (dir_ / ("cut-" + tag)).string();
    RunOutput second = run_fenced(b);
    ASSERT_TRUE(second.result.is_ok()) << second.result.status().to_string();
    ASSERT_EQ(first.steps.size(), 2u);
    ASSERT_EQ(second.steps.size(), 2u);
    RunOutput joined = second;
    joined.steps.insert(joined.steps.begin(), first.steps.begin(), first.steps.end());
    expect_same(joined, straight);

    // The CPU's checkpoint of step 2, continued on the device.
    train::TrainOptions c = options("cpu-cut-" + tag, v);
    c.save_every = 2;
    const RunOutput cpu_first = train::test::run_collecting(
        c, nullptr, [](const train::StepStats& s) { return s.step == 2; });
    ASSERT_TRUE(cpu_first.result.is_ok()) << cpu_first.result.status().to_string();
    train::TrainOptions d = b;
    d.resume = (dir_ / ("cpu-cut-" + tag)).string();
    d.out_dir = (dir_ / ("cpu-then-fenced-" + tag)).string();
    RunOutput continued = run_fenced(d);
    ASSERT_TRUE(continued.result.is_ok()) << continued.result.status().to_string();
    expect_same(continued, second);
  }
}

// The rest of what the device path runs, each on the CPU and on the fenced device with the same
// options and compared bit for bit: fp16 with loss scaling and an overflowed (skipped) step, a
// Llama-family model (RMSNorm, RoPE tables, SwiGLU), plain attention in file order, out-of-memory
// recoveries that re-plan the step region, a budget file that lowers the budget mid-run (the new
// micro-batch validating in pieces), and the profiled, timed run.
TEST_F(DeviceTrainer, TheRestOfThePathMatchesTheCpu) {
  const std::string budget = (dir_ / "budget").string();
  auto write_budget = [&](uint64_t bytes) {
    std::ofstream f(budget, std::ios::trunc);
    f << bytes << "\n";
  };
  train::TrainOptions base = options("", kVariants[0]);
  base.out_dir.clear();
  base.steps = 4;
  base.eval_every = 2;
  // The budget case runs 3 x 2 and lowers the budget to between the step regions of micro-
  // batches 2 and 3: the re-plan takes 2 x 3, which does not divide the validation batch of 3,
  // so validation runs in pieces of their own shapes' plans.
  auto plan_of = [&](int b, int k) {
    return plan::plan_training_memory(base.config, plan::Policy{b, k, base.seq, "fp32", base.exec});
  };
  Result<plan::MemoryPlan> mp3 = plan_of(3, 2), mp2 = plan_of(2, 3);
  ASSERT_TRUE(mp3.is_ok() && mp2.is_ok());
  ASSERT_LT(mp2->step_bytes, mp3->step_bytes);
  const uint64_t full3 = mp3->peak_bytes + 64 * kKiB;
  const uint64_t lowered = mp3->persistent_bytes + (mp2->step_bytes + mp3->step_bytes) / 2;
  struct Case {
    const char* name;
    std::function<void(train::TrainOptions*)> edit;
    std::function<void(int)> after_step = nullptr;  // e.g. edits the budget file
  };
  const Case cases[] = {
      {"fp16, an overflow at step 2",
       [](train::TrainOptions* o) {
         o->exec.precision = model::Precision::kFp16;
         o->exec.head_chunk = 8;
         o->loss_scale.initial = 1024.0f;
         o->inject_overflow_steps = {1};
       }},
      {"llama",
       [](train::TrainOptions* o) {
         o->config = train::test::llama_config(2, 64, 4, 2, 211, 32, false);
         o->exec.precision = model::Precision::kBf16;
       }},
      {"plain attention, file order",
       [](train::TrainOptions* o) {
         o->exec.tiled_attention = false;
         o->shuffle = false;
       }},
      {"out-of-memory recoveries",
       [](train::TrainOptions* o) {
         o->fail_step_allocations = {1, 3};
       }},
      {"budget lowered after step 1",
       [&](train::TrainOptions* o) {
         o->micro_batch = 3;
         o->accumulation = 2;
         o->device_memory = full3;
         o->device_memory_file = budget;
       },
       [&](int step) {
         if (step == 1) write_budget(lowered);
       }},
      {"profile and breakdown",
       [](train::TrainOptions* o) {
         o->profile = true;
         o->breakdown = true;
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    train::TrainOptions o = base;
    c.edit(&o);
    std::vector<RunOutput> runs;
    for (bool fenced : {false, true}) {
      write_budget(o.device_memory);
      backend::FencedResource device;
      device.fence();
      backend::FencedOps ops(&device);
      if (fenced) {
        o.ops = &ops;
        o.device_leaf = &device;
      }
      runs.push_back(train::test::run_collecting(o, [&](const train::StepStats& s) {
        if (c.after_step) c.after_step(s.step);
      }));
      o.ops = nullptr;
      o.device_leaf = nullptr;
      ASSERT_TRUE(runs.back().result.is_ok()) << runs.back().result.status().to_string();
      EXPECT_EQ(device.live_blocks(), 0u);
    }
    expect_same(runs[1], runs[0]);
    const train::TrainResult& cpu = *runs[0].result;
    const train::TrainResult& dev = *runs[1].result;
    EXPECT_EQ(dev.oom_recoveries, cpu.oom_recoveries);
    EXPECT_EQ(dev.replans, cpu.replans);
    EXPECT_EQ(dev.device_bytes_peak, dev.planned_peak_bytes);
    for (size_t i = 0; i < runs[1].steps.size(); i++) {
      EXPECT_EQ(runs[1].steps[i].micro_batch, runs[0].steps[i].micro_batch);
      EXPECT_EQ(runs[1].steps[i].skipped, runs[0].steps[i].skipped);
      EXPECT_EQ(runs[1].steps[i].loss_scale, runs[0].steps[i].loss_scale);
    }
    if (!o.fail_step_allocations.empty()) {
      EXPECT_EQ(dev.oom_recoveries, 2);
    }
    if (!o.inject_overflow_steps.empty()) {
      EXPECT_TRUE(runs[1].steps[1].skipped);
    }
    if (!o.device_memory_file.empty()) {
      EXPECT_EQ(dev.replans, 1);
      EXPECT_EQ(runs[1].steps[1].micro_batch, 2);  // and validation after step 2 in pieces
      EXPECT_TRUE(runs[1].steps[1].val_loss.has_value());
    }
    if (o.profile) {
      EXPECT_TRUE(dev.profile.has_value());
    }
  }
}

// A device that says what it has free (a GPU's cudaMemGetInfo, here a script): before each step
// the budget is the probe's; a move under 5% that the plan still fits changes nothing, a budget
// the plan no longer fits re-plans the step region (3 x 2 -> 2 x 3), a probe that fails keeps the
// budget with a warning event, and the run is the CPU run with the same budget file bit for bit.
TEST_F(DeviceTrainer, FollowsTheDevicesFreeMemory) {
  train::TrainOptions o = options("", kVariants[0]);
  o.out_dir.clear();
  o.micro_batch = 3;
  o.accumulation = 2;
  auto plan_of = [&](int b, int k) {
    return plan::plan_training_memory(o.config, plan::Policy{b, k, o.seq, "fp32", o.exec});
  };
  Result<plan::MemoryPlan> mp3 = plan_of(3, 2), mp2 = plan_of(2, 3);
  ASSERT_TRUE(mp3.is_ok() && mp2.is_ok());
  const uint64_t full3 = mp3->peak_bytes + 64 * kKiB;
  const uint64_t lowered = mp3->persistent_bytes + (mp2->step_bytes + mp3->step_bytes) / 2;
  o.device_memory = full3;
  // Before steps 1..4: 1% more (ignored), the lowered budget (re-plan), 1% above it (ignored),
  // an error (kept).
  int calls = 0;
  std::vector<uint64_t> held_seen;
  o.device_budget_probe = [&](uint64_t held) -> Result<uint64_t> {
    held_seen.push_back(held);
    switch (calls++) {
      case 0:
        return full3 + full3 / 100;
      case 1:
        return lowered;
      case 2:
        return lowered + lowered / 100;
      default:
        return Status::io_error("the device could not be asked");
    }
  };
  backend::FencedResource device;
  device.fence();
  backend::FencedOps ops(&device);
  train::TrainOptions f = o;
  f.ops = &ops;
  f.device_leaf = &device;
  const RunOutput dev = train::test::run_collecting(f);
  ASSERT_TRUE(dev.result.is_ok()) << dev.result.status().to_string();
  EXPECT_EQ(calls, 4);
  for (uint64_t h : held_seen) EXPECT_GT(h, 0u);  // the run's own bytes count
  EXPECT_EQ(dev.result->replans, 1);
  ASSERT_EQ(dev.steps.size(), 4u);
  EXPECT_EQ(dev.steps[0].micro_batch, 3);
  EXPECT_EQ(dev.steps[1].micro_batch, 2);
  EXPECT_EQ(dev.steps[3].micro_batch, 2);
  // Only the drop acted: the 1% moves left no budget event (a re-plan, even one that keeps the
  // plan, says so).
  auto budget_events = [&](size_t i) {
    int n = 0;
    for (const std::string& e : dev.steps[i].events) n += e.find("free memory") != e.npos;
    return n;
  };
  EXPECT_EQ(budget_events(0), 0);
  EXPECT_EQ(budget_events(1), 1);
  EXPECT_EQ(budget_events(2), 0);
  bool warned = false;
  for (const std::string& e : dev.steps[3].events) {
    warned = warned || e.find("the device could not be asked") != std::string::npos;
  }
  EXPECT_TRUE(warned);
  for (const train::StepStats& s : dev.steps) {
    EXPECT_LE(s.planned_peak_bytes, s.step == 1 ? full3 : lowered) << "step " << s.step;
  }

  // The same budgets from a budget file on the CPU: the same run.
  const std::string budget = (dir_ / "budget").string();
  auto write_budget = [&](uint64_t bytes) {
    std::ofstream out(budget, std::ios::trunc);
    out << bytes << "\n";
  };
  write_budget(full3);
  train::TrainOptions c = o;
  c.device_budget_probe = nullptr;
  c.device_memory_file = budget;
  const RunOutput cpu = train::test::run_collecting(c, [&](const train::StepStats& s) {
    if (s.step == 1) write_budget(lowered);
  });
  ASSERT_TRUE(cpu.result.is_ok()) << cpu.result.status().to_string();
  expect_same(dev, cpu);
  EXPECT_EQ(device.live_blocks(), 0u);
}

// The device path runs every option the CPU runs (device_features_test.cc, device_offload_test.cc,
// tests/dist/device_ranks_test.cc); a device backend without its memory leaf is a caller's error,
// refused before anything is allocated, naming the backend.
TEST_F(DeviceTrainer, RefusesADeviceTableWithoutItsLeaf) {
  backend::FencedResource device;
  device.fence();
  backend::FencedOps ops(&device);
  train::TrainOptions o = options("refused", kVariants[0]);
  o.ops = &ops;
  o.device_leaf = nullptr;
  Result<train::TrainResult> r = train::run_training(o, {});
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
  EXPECT_NE(r.status().message().find("device_leaf"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("fenced"), std::string::npos) << r.status().message();
  EXPECT_EQ(device.live_blocks(), 0u);  // nothing was allocated
}

}  // namespace
}  // namespace headroom
