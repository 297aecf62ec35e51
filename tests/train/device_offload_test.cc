// Optimizer offload and activation offload on a device the host cannot address (docs/notes/
// device-trainer.md): the same run on the CPU and on the fenced device (backend/fenced, memory
// PROT_NONE outside every op), compared bit for bit. Every copy between the device's regions and
// the offload tier (gradients out, updated weights in, the master weights at load, saved
// activations out and back on the copy thread) goes through the op table's copies; a memcpy or a
// host loop that touched the device would die here with SIGSEGV, and a copy given the wrong side
// aborts naming the op.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "backend/fenced/fenced_ops.h"
#include "fenced_test_util.h"
#include "memory/adaptors.h"
#include "memory/host_resource.h"
#include "model/offload_copier.h"
#include "plan/memory_plan.h"
#include "train/checkpoint.h"
#include "train_test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using R = model::Recompute;
using train::test::RunOutput;

using train::test::read_tree;

struct Case {
  const char* name;
  model::Precision precision;
  bool offload_optimizer;
  std::vector<bool> offload;  // activation offload per block (empty: none)
  std::vector<R> recompute = {};
  int accumulation = 2;
  int head_chunk = 0;
  bool bf16_weight_copy = true;
};

class DeviceOffload : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = train::test::fresh_test_dir("headroom_fenced_offload");
    data_ = (dir_ / "data.tok").string();
    train::test::write_random_tokens(data_, 11, 30000);
  }
  void TearDown() override { fs::remove_all(dir_); }

  train::TrainOptions options(const std::string& out, const Case& c) {
    train::TrainOptions o;
    o.config = train::test::tiny_config();  // 2 blocks
    o.model_name = "tiny";
    o.data = data_;
    o.seq = 16;
    o.micro_batch = 2;
    o.accumulation = c.accumulation;
    o.steps = 4;
    o.warmup_steps = 2;
    o.adamw.lr = 3e-3f;
    o.adamw.grad_clip = 0.5f;  // clipping active: the norm's path on the tier is exercised
    o.device_memory = uint64_t(1) << 30;
    o.offload_memory = uint64_t(1) << 30;
    o.eval_every = 2;
    o.eval_batches = 2;
    o.exec.precision = c.precision;
    o.exec.head_chunk = c.head_chunk;
    o.exec.bf16_weight_copy = c.bf16_weight_copy;
    o.exec.recompute = c.recompute;
    o.exec.offload = c.offload;
    o.offload_optimizer = c.offload_optimizer;
    // The copy thread's hooks: every copy lands as late as the executor allows, after a delay,
    // and its device source is poisoned once copied (through the table's fill_bytes), so a
    // missing or misplaced wait reads NaN or stale bytes instead of passing by luck.
    o.offload_copier.delay = std::chrono::microseconds(200);
    o.offload_copier.poison_sources = true;
    o.offload_copier.run_at_wait = true;
    // The optimizer's update copied back in pieces of 8192 floats (a dozen a step), each queued
    // as it is computed and, on the fenced device, landing only at the step's wait.
    o.optimizer_upload_chunk = 8192;
    o.out_dir = (dir_ / out).string();
    o.save_every = 2;
    return o;
  }

  // `o` on the CPU (fenced false) or on the fenced device, fenced from before the first
  // allocation. Every step: the measured device and offload-tier peaks are the plan's.
  RunOutput run(train::TrainOptions o, bool fenced,
                std::function<bool(const train::StepStats&)> stop = nullptr) {
    backend::FencedResource device;
    device.fence();
    backend::FencedOps ops(&device);
    if (fenced) {
      o.ops = &ops;
      o.device_leaf = &device;
    }
    RunOutput r = train::test::run_collecting(
        o,
        [&](const train::StepStats& s) {
          // (A step that recovered from an out-of-memory error held the failed plan's region
          // first: its peak is compared with the CPU's instead, in check_case.)
          if (check_step_peaks_) {
            EXPECT_EQ(s.device_bytes_peak, s.planned_peak_bytes) << "step " << s.step;
          }
          EXPECT_EQ(s.offload_bytes_peak, s.planned_offload_bytes) << "step " << s.step;
        },
        std::move(stop));
    EXPECT_EQ(device.live_blocks(), 0u);
    if (fenced) {
      EXPECT_GT(device.protect_calls(), 0u);  // the run computed through the fence
    }
    return r;
  }

  // The two runs' every step alike, bit for bit, and the final weights.
  static void expect_same(const RunOutput& a, const RunOutput& b) {
    train::test::expect_same_bits(a, b);
  }

  // Every file of the two output directories (the model, the checkpoints' weights, m and v,
  // trainer state) byte for byte.
  void expect_same_files(const std::string& a, const std::string& b) {
    const std::map<std::string, std::string> fa = read_tree(dir_ / a), fb = read_tree(dir_ / b);
    EXPECT_TRUE(fa.count("model.safetensors"));
    EXPECT_TRUE(fa.count("checkpoints/step-000004/optimizer.safetensors"));
    train::test::expect_same_files(fa, fb);
  }

  // The CPU run and the fenced run of `c`, compared (steps, weights, files, plans and peaks).
  // Both results go to *results when it is not null (CPU first).
  void check_case(const Case& c, const std::string& tag,
                  const std::function<void(train::TrainOptions*)>& edit = nullptr,
                  std::vector<train::TrainResult>* results = nullptr) {
    SCOPED_TRACE(c.name);
    train::TrainOptions o = options("cpu-" + tag, c);
    if (edit) edit(&o);
    const RunOutput cpu = run(o, false);
    ASSERT_TRUE(cpu.result.is_ok()) << cpu.result.status().to_string();
    o.out_dir = (dir_ / ("fenced-" + tag)).string();
    const RunOutput dev = run(o, true);
    ASSERT_TRUE(dev.result.is_ok()) << dev.result.status().to_string();
    if (results) *results = {*cpu.result, *dev.result};
    ASSERT_EQ(dev.steps.size(), 4u);
    expect_same(dev, cpu);
    EXPECT_EQ(dev.result->final_val_loss, cpu.result->final_val_loss);
    ASSERT_TRUE(dev.result->final_val_loss.has_value());
    expect_same_files("cpu-" + tag, "fenced-" + tag);
    // The plan is the allocation on the device and in the offload tier: measured = planned, and
    // the device run's plans are the CPU run's.
    const train::TrainResult& d = *dev.result;
    EXPECT_EQ(d.device_bytes_peak, d.planned_peak_bytes);
    EXPECT_EQ(d.planned_peak_bytes, cpu.result->planned_peak_bytes);
    EXPECT_EQ(d.offload_bytes_peak, d.planned_offload_bytes);
    EXPECT_EQ(d.planned_offload_bytes, cpu.result->planned_offload_bytes);
    EXPECT_GT(d.planned_offload_bytes, 0u);
    const bool acts = std::count(c.offload.begin(), c.offload.end(), true) > 0;
    if (acts) {
      // The activations did move, as many bytes as on the CPU.
      EXPECT_GT(d.offload_copied_bytes, 0u);
      EXPECT_EQ(d.offload_copied_bytes, cpu.result->offload_copied_bytes);
    }
    for (size_t i = 0; i < dev.steps.size(); i++) {
      EXPECT_EQ(dev.steps[i].micro_batch, cpu.steps[i].micro_batch);
      EXPECT_EQ(dev.steps[i].device_bytes_peak, cpu.steps[i].device_bytes_peak);
      EXPECT_EQ(dev.steps[i].planned_peak_bytes, cpu.steps[i].planned_peak_bytes);
      // The optimizer's copies ran every step (each way, the whole buffer).
      if (c.offload_optimizer) {
        EXPECT_GT(dev.steps[i].offload_bytes, 0u) << "step " << i + 1;
      }
    }
  }

  fs::path dir_;
  std::string data_;
  bool check_step_peaks_ = true;  // every step's measured device peak = its planned one
};

// Optimizer offload: the gradients copied out of the device, AdamW on the tier (master, m, v),
// the updated weights copied back and the bf16 copy cast on the device. fp32 and bf16 (with the
// bf16 weight copy, and with per-use casts), accumulation 2 and 3, and fp16 with an overflowed
// (skipped) step, whose update must leave the device and the tier untouched.
TEST_F(DeviceOffload, OptimizerOffloadMatchesTheCpu) {
  const Case cases[] = {
      {"fp32", model::Precision::kFp32, true, {}},
      {"bf16, the weight copy, accumulation 3", model::Precision::kBf16, true, {}, {}, 3},
      {"bf16, fused head, weights cast per use",
       model::Precision::kBf16,
       true,
       {},
       {},
       2,
       8,
       false},
  };
  int i = 0;
  for (const Case& c : cases) check_case(c, "opt" + std::to_string(i++));
  check_case({"fp16, an overflow at step 2", model::Precision::kFp16, true, {}, {}, 2, 8}, "fp16",
             [](train::TrainOptions* o) {
               o->loss_scale.initial = 1024.0f;
               o->inject_overflow_steps = {1};
             });
}

// Activation offload: an offloaded block's saved activations go out to the tier on the copy
// thread after its forward and come back before its backward (copy_to_host / copy_to_device on
// that thread). Some blocks and all blocks, with selective recompute on one, fp32 and bf16.
TEST_F(DeviceOffload, ActivationOffloadMatchesTheCpu) {
  const Case cases[] = {
      {"fp32, block 0", model::Precision::kFp32, false, {true, false}},
      {"fp32, all blocks", model::Precision::kFp32, false, {true, true}},
      {"bf16, all blocks, selective recompute on block 1",
       model::Precision::kBf16,
       false,
       {true, true},
       {R::kNone, R::kSelective}},
      {"bf16, block 1, fused head, accumulation 3",
       model::Precision::kBf16,
       false,
       {false, true},
       {},
       3,
       8},
  };
  int i = 0;
  for (const Case& c : cases) check_case(c, "act" + std::to_string(i++));
}

// Both kinds in one offload tier, with accumulation > 1.
TEST_F(DeviceOffload, BothKindsTogetherMatchTheCpu) {
  const Case cases[] = {
      {"fp32, all blocks, accumulation 3", model::Precision::kFp32, true, {true, true}, {}, 3},
      {"bf16, block 0, selective recompute",
       model::Precision::kBf16,
       true,
       {true, false},
       {R::kSelective, R::kNone}},
  };
  int i = 0;
  for (const Case& c : cases) check_case(c, "both" + std::to_string(i++));
}

// With optimizer offload (and activation offload): 4 steps straight, and 2 + checkpoint + resume
// + 2, on the fenced device: the same every step, the same weights and the same last checkpoint
// (m and v read back into the tier, the master weights loaded from the resumed device weights).
// And a checkpoint the CPU wrote with optimizer offload continues on the device exactly.
TEST_F(DeviceOffload, ResumeWithOptimizerOffloadEqualsTheUninterruptedRun) {
  for (const Case& c :
       {Case{"fp32", model::Precision::kFp32, true, {}},
        Case{"bf16, activations too", model::Precision::kBf16, true, {true, true}}}) {
    SCOPED_TRACE(c.name);
    const std::string tag = c.precision == model::Precision::kBf16 ? "bf16" : "fp32";
    const RunOutput straight = run(options("straight-" + tag, c), true);
    ASSERT_TRUE(straight.result.is_ok()) << straight.result.status().to_string();

    auto at_two = [](const train::StepStats& s) { return s.step == 2; };
    const RunOutput first = run(options("cut-" + tag, c), true, at_two);
    ASSERT_TRUE(first.result.is_ok()) << first.result.status().to_string();
    EXPECT_TRUE(first.result->stopped);
    train::TrainOptions b = options("cut-" + tag, c);
    b.resume = (dir_ / ("cut-" + tag)).string();
    const RunOutput second = run(b, true);
    ASSERT_TRUE(second.result.is_ok()) << second.result.status().to_string();
    ASSERT_EQ(first.steps.size(), 2u);
    ASSERT_EQ(second.steps.size(), 2u);
    RunOutput joined = second;
    joined.steps.insert(joined.steps.begin(), first.steps.begin(), first.steps.end());
    expect_same(joined, straight);
    // The step-4 checkpoints (weights, m, v) of both runs, byte for byte.
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      const std::map<std::string, std::string> a = read_tree(dir_ / ("straight-" + tag)),
                                               z = read_tree(dir_ / ("cut-" + tag));
      const std::string path = std::string("checkpoints/step-000004/") + f;
      ASSERT_TRUE(a.count(path) && z.count(path)) << path;
      EXPECT_TRUE(a.at(path) == z.at(path)) << path << " differs";
    }

    // The CPU's checkpoint of step 2 (optimizer offload on the CPU), continued on the device.
    const RunOutput cpu_first = run(options("cpu-cut-" + tag, c), false, at_two);
    ASSERT_TRUE(cpu_first.result.is_ok()) << cpu_first.result.status().to_string();
    train::TrainOptions d = b;
    d.resume = (dir_ / ("cpu-cut-" + tag)).string();
    d.out_dir = (dir_ / ("cpu-then-fenced-" + tag)).string();
    const RunOutput continued = run(d, true);
    ASSERT_TRUE(continued.result.is_ok()) << continued.result.status().to_string();
    expect_same(continued, second);
  }
}

// Out-of-memory recoveries re-plan the step region of a run with both kinds of offload (the
// re-plan keeps the optimizer's choice, as on the CPU): the same recoveries, the same bits.
TEST_F(DeviceOffload, OutOfMemoryRecoveriesWithOffloadMatchTheCpu) {
  const Case c{"fp32, optimizer and block 0", model::Precision::kFp32, true, {true, false}};
  std::vector<train::TrainResult> results;
  check_step_peaks_ = false;
  check_case(
      c, "oom",
      [](train::TrainOptions* o) {
        o->fail_step_allocations = {1, 3};
        o->save_every = 4;
      },
      &results);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[1].oom_recoveries, 2);
  EXPECT_EQ(results[1].oom_recoveries, results[0].oom_recoveries);
  EXPECT_EQ(results[1].replans, results[0].replans);
}

// The offload tier's memory from the caller's leaf (TrainOptions::offload_leaf; a GPU run's is
// pinned host memory): every region of the tier comes from it, the peak it saw is the planned
// tier, and the run is the same bits as with plain host memory.
TEST_F(DeviceOffload, TheTierTakesItsMemoryFromTheOffloadLeaf) {
  const Case c{"bf16, optimizer and all blocks", model::Precision::kBf16, true, {true, true}};
  train::TrainOptions o = options("plain", c);
  o.save_every = 0;
  o.eval_every = 0;
  const RunOutput plain = run(o, true);
  ASSERT_TRUE(plain.result.is_ok()) << plain.result.status().to_string();
  memory::HostResource host;
  memory::TrackingResource leaf(&host);
  o.offload_leaf = &leaf;
  o.out_dir = (dir_ / "leaf").string();
  const RunOutput from_leaf = run(o, true);
  ASSERT_TRUE(from_leaf.result.is_ok()) << from_leaf.result.status().to_string();
  expect_same(from_leaf, plain);
  const memory::MemoryStats st = leaf.stats();
  EXPECT_EQ(st.allocations, from_leaf.result->offload_memory.allocations);
  EXPECT_GT(st.allocations, 0u);
  EXPECT_EQ(st.peak, from_leaf.result->planned_offload_bytes);
  EXPECT_EQ(st.current, 0u);  // all returned
}

// The loader's token slots from the caller's leaf (TrainOptions::slot_leaf; a GPU run's is
// pinned host memory): the slots' copies to the device are queued by the loader thread and
// waited by the step (deferred to the wait on the fenced device, so a step that read its slot
// before waiting would compute on the previous tokens), and the run is the same bits.
TEST_F(DeviceOffload, TheLoadersSlotsComeFromTheSlotLeafAndLandBeforeTheirStep) {
  const Case c{"fp32, no offload", model::Precision::kFp32, false, {false, false}};
  train::TrainOptions o = options("plain", c);
  o.save_every = 0;
  const RunOutput plain = run(o, false);  // the CPU
  ASSERT_TRUE(plain.result.is_ok()) << plain.result.status().to_string();
  memory::HostResource host;
  memory::TrackingResource leaf(&host);
  o.slot_leaf = &leaf;
  o.out_dir = (dir_ / "slots").string();
  const RunOutput from_leaf = run(o, true);
  ASSERT_TRUE(from_leaf.result.is_ok()) << from_leaf.result.status().to_string();
  expect_same(from_leaf, plain);
  const memory::MemoryStats st = leaf.stats();
  EXPECT_GT(st.allocations, 0u);
  EXPECT_GT(st.peak, 0u);
  EXPECT_EQ(st.current, 0u);  // all returned
}

// The table's asynchronous copies on the fenced device: each checks its device range at the call
// and is made at its wait (the latest a GPU's copy stream may run it), so the bytes round-trip,
// a destination read before the wait holds the old bytes, a source changed before the wait is
// what lands, and a host pointer given as the device side aborts, as the synchronous copies do.
TEST(DeviceOffloadCopies, AsynchronousCopiesRoundTripOnTheFencedDevice) {
  backend::FencedResource device;
  device.fence();
  backend::FencedOps ops(&device);
  Result<void*> block = device.allocate(4096, 64, memory::Category::kOffload);
  ASSERT_TRUE(block.is_ok());
  ops.fill_bytes(*block, 0, 4096);
  std::vector<float> src(1024), back(1024, -1.0f);
  for (size_t i = 0; i < src.size(); i++) src[i] = float(i) * 0.5f;
  const uint64_t in = ops.copy_to_device_async(*block, src.data(), 4096);
  EXPECT_EQ(ops.pending_copies(), 1u);
  ops.copy_to_host(back.data(), *block, 4096);  // before the wait: the old bytes
  EXPECT_EQ(back[5], 0.0f);
  src[5] = 42.0f;  // changed before the wait: lands
  ops.wait_copy(in);
  EXPECT_EQ(ops.pending_copies(), 0u);
  const uint64_t out = ops.copy_to_host_async(back.data(), *block, 4096);
  EXPECT_NE(back[7], src[7]);  // not yet
  ops.wait_copy(out);
  EXPECT_EQ(0, std::memcmp(src.data(), back.data(), 4096));
  EXPECT_EQ(back[5], 42.0f);
  EXPECT_EQ(ops.copy_to_device_async(*block, src.data(), 0), 0u);  // nothing to copy
  EXPECT_DEATH(ops.wait_copy(out), "already waited");
  EXPECT_EQ(backend::cpu_ops().copy_to_host_async(back.data(), src.data(), 4096), 0u);
  EXPECT_DEATH(ops.copy_to_host_async(back.data(), src.data(), 4096), "copy_to_host_async");
  EXPECT_DEATH(ops.copy_to_device_async(back.data(), src.data(), 4096), "copy_to_device_async");
  device.deallocate(*block, 4096, 64, memory::Category::kOffload);
}

}  // namespace
}  // namespace headroom
