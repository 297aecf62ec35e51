// Activation offload is invisible to the mathematics (DESIGN.md principle 2): the copies are
// exact, so training with any blocks offloaded (with recomputation mixes, accumulation, both
// precisions) gives bit-identical losses and weights to the same run without offload. The copy
// thread's test hooks delay every copy and poison what it copied, so a missing or misplaced wait
// in the executor, or a backward that read the forward's (dead) buffers, would show as a
// different result or a NaN.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "core/event_log.h"
#include "data/token_file.h"
#include "memory/host_resource.h"
#include "model/gpt2.h"
#include "model/offload_copier.h"
#include "plan/memory_plan.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using model::Recompute;
using train::test::one_micro_batch;

model::Gpt2Config small_config(int L) { return train::test::gpt2_config(L, 64, 4, 257, 64); }

std::string token_file(int vocab) {
  std::string path =
      (fs::path(testing::TempDir()) / ("offload_" + std::to_string(getpid()) + ".tok")).string();
  std::mt19937 rng(11);
  std::vector<int32_t> toks(20000);
  for (auto& t : toks) t = int32_t(rng() % uint32_t(vocab - 1));
  for (size_t i = 40; i < toks.size(); i += 89) toks[i] = vocab - 1;
  EXPECT_TRUE(data::write_token_file(path, toks, vocab, vocab - 1, toks.size() / 89).is_ok());
  return path;
}

constexpr int kSteps = 2;

struct RunResult {
  std::vector<double> losses;
  std::vector<float> params;
  std::optional<double> val_loss;
  train::TrainResult result;
};

RunResult train_run(const model::Gpt2Config& c, const model::ExecOptions& exec, int K,
                    const std::string& data, bool hooks) {
  train::TrainOptions o;
  o.config = c;
  o.model_name = "test";
  o.data = data;
  o.seq = 32;
  o.micro_batch = 2;
  o.accumulation = K;
  o.exec = exec;
  o.steps = kSteps;
  o.warmup_steps = 1;
  o.device_memory = uint64_t(1) << 32;
  o.offload_memory = uint64_t(1) << 30;
  o.eval_batches = 1;
  if (hooks) {
    o.offload_copier.delay = std::chrono::microseconds(500);
    o.offload_copier.poison_sources = true;
    o.offload_copier.run_at_wait = true;
  }
  RunResult run;
  train::TrainCallbacks cb;
  cb.on_step = [&](const train::StepStats& s) {
    run.losses.push_back(s.loss);
    if (s.val_loss) run.val_loss = s.val_loss;
  };
  cb.on_finish = [&](const model::Gpt2Config&, const float* params, memory::MemoryResource*) {
    const int64_t n = model::gpt2_param_table(c).total_floats;
    run.params.assign(params, params + n);
    return Status::ok();
  };
  Result<train::TrainResult> r = train::run_training(o, cb);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  if (r.is_ok()) run.result = *r;
  return run;
}

struct Case {
  std::string name;
  std::vector<Recompute> recompute;
  std::vector<bool> offload;
  int K;
  int head_chunk = 0;
  model::Precision precision = model::Precision::kFp32;
  bool hooks = true;
};

TEST(ActivationOffload, OnAndOffGiveBitIdenticalTraining) {
  const Recompute N = Recompute::kNone, S = Recompute::kSelective, F = Recompute::kFull;
  const std::vector<Case> cases = {
      {"every block", {}, {true, true, true, true}, 2},
      {"every block, no hooks", {}, {true, true, true, true}, 1, 0, model::Precision::kFp32, false},
      {"first block only", {N, N, N, N}, {true, false, false, false}, 2},
      {"last block (before the head), fused head", {}, {false, false, false, true}, 2, 16},
      {"mixed with recomputation", {F, N, S, S}, {false, true, true, false}, 2},
      {"selective + offload next to full", {S, F, S, N}, {true, false, true, true}, 3},
      {"bf16, mixed", {F, S, N, N}, {false, true, true, false}, 2, 16, model::Precision::kBf16},
  };
  const std::string data = token_file(257);
  const model::Gpt2Config c = small_config(4);
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    model::ExecOptions off;
    off.recompute = k.recompute;
    off.head_chunk = k.head_chunk;
    off.precision = k.precision;
    model::ExecOptions on = off;
    on.offload = k.offload;
    RunResult a = train_run(c, off, k.K, data, false);
    RunResult b = train_run(c, on, k.K, data, k.hooks);
    ASSERT_EQ(a.losses.size(), size_t(kSteps));
    ASSERT_EQ(b.losses.size(), size_t(kSteps));
    for (size_t i = 0; i < a.losses.size(); i++) EXPECT_EQ(a.losses[i], b.losses[i]) << i;
    ASSERT_TRUE(a.val_loss && b.val_loss);
    EXPECT_EQ(*a.val_loss, *b.val_loss);
    ASSERT_EQ(a.params.size(), b.params.size());
    EXPECT_EQ(0, std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)));
    // The copies really ran, on the thread, both ways: every offloaded block's bytes out and
    // back per micro-batch (validation adds copies out only).
    EXPECT_EQ(a.result.offload_copied_bytes, 0u);
    EXPECT_GT(b.result.offload_copied_bytes, 0u);
    EXPECT_GT(b.result.planned_offload_bytes, 0u);
    EXPECT_EQ(b.result.offload_bytes_peak, b.result.planned_offload_bytes);
    const uint64_t train_copies = 2ull * b.result.planned_offload_bytes * kSteps * uint64_t(k.K);
    EXPECT_GE(b.result.offload_copied_bytes, train_copies);
    EXPECT_LE(b.result.offload_copied_bytes, train_copies + b.result.planned_offload_bytes);
  }
  fs::remove(data);
}

TEST(ActivationOffload, PlannedOffsetsWithDelayedCopiesGiveBitIdenticalGradients) {
  const model::Gpt2Config c = small_config(5);
  model::ExecOptions plain;
  plain.recompute = {Recompute::kNone, Recompute::kFull, Recompute::kSelective, Recompute::kNone,
                     Recompute::kSelective};
  model::ExecOptions off = plain;
  off.offload = {true, false, true, true, false};
  auto p0 = plan::plan_training_memory(c, plan::Policy{2, 1, 32, "fp32", plain});
  auto p1 = plan::plan_training_memory(c, plan::Policy{2, 1, 32, "fp32", off});
  ASSERT_TRUE(p0.is_ok() && p1.is_ok());
  auto reference = one_micro_batch(c, *p0, memory::sequential_layout(p0->step.buffers), nullptr);
  for (bool threaded : {false, true}) {
    SCOPED_TRACE(threaded ? "copy thread with delay and poison" : "inline copies");
    model::OffloadCopier::Options o;
    o.delay = std::chrono::milliseconds(1);
    o.poison_sources = true;
    o.run_at_wait = true;  // every copy lands as late as the executor's waits allow
    model::OffloadCopier copier(o);
    auto got = one_micro_batch(c, *p1, p1->step.layout, threaded ? &copier : nullptr);
    EXPECT_EQ(got.second, reference.second);
    ASSERT_EQ(got.first.size(), reference.first.size());
    EXPECT_EQ(0, std::memcmp(got.first.data(), reference.first.data(), got.first.size() * 4));
    if (threaded) {
      // Every copy ran only when the executor waited for it: each offloaded block's copy out
      // and back was waited for, and blocked (deterministic, unlike a timing).
      EXPECT_EQ(copier.stats().blocked_waits, 2u * p1->activations.offloaded.size());
      EXPECT_EQ(copier.stats().bytes, 2 * p1->offload_bytes);
    }
  }
}

TEST(ActivationOffload, OffloadLowersThePlannedDevicePeak) {
  const model::Gpt2Config c = small_config(8);
  model::ExecOptions none, all;
  all.offload.assign(8, true);
  auto p0 = plan::plan_training_memory(c, plan::Policy{4, 1, 64, "fp32", none});
  auto p1 = plan::plan_training_memory(c, plan::Policy{4, 1, 64, "fp32", all});
  ASSERT_TRUE(p0.is_ok() && p1.is_ok());
  EXPECT_LT(p1->peak_bytes, p0->peak_bytes);
  EXPECT_EQ(p0->offload_bytes, 0u);
  EXPECT_TRUE(p0->offload.empty());
  ASSERT_EQ(p1->offload.size(), 1u);
  EXPECT_EQ(p1->offload[0].category, memory::Category::kOffload);
  // The offload tier holds every block's kept activations: what no-offload keeps on the device
  // for them (12 buffers a block).
  uint64_t kept = 0;
  for (int l = 0; l < 8; l++) {
    for (const model::OffloadMove& m : p1->activations.offloaded[size_t(l)].moves) {
      kept += p1->step.buffers[m.saved].bytes();
    }
  }
  EXPECT_EQ(p1->activations.offloaded.size(), 8u);
  EXPECT_LE(kept, p1->offload_bytes);
  EXPECT_LT(p1->offload_bytes, kept + 8 * 12 * 64);  // plus alignment only
}

TEST(ActivationOffload, BadPoliciesAreRefused) {
  const model::Gpt2Config c = small_config(3);
  model::ExecOptions e;
  e.offload = {true, false};  // wrong length
  auto r = plan::plan_training_memory(c, plan::Policy{1, 1, 16, "fp32", e});
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("offload choice per block"), std::string::npos);
  e.offload = {false, true, false};
  e.recompute = {Recompute::kNone, Recompute::kFull, Recompute::kNone};
  r = plan::plan_training_memory(c, plan::Policy{1, 1, 16, "fp32", e});
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("block 1"), std::string::npos) << r.status().message();
}

// --profile: every job of the copy thread is an op on the copy track (thread 1), with the run's
// time base, and none is left out (as many as the copier ran).
TEST(ActivationOffload, ProfileShowsTheCopiesOnTheCopyTrack) {
  const std::string data = token_file(257);
  const model::Gpt2Config c = small_config(3);
  train::TrainOptions o;
  o.config = c;
  o.model_name = "test";
  o.data = data;
  o.seq = 32;
  o.micro_batch = 2;
  o.accumulation = 2;
  o.exec.offload = {true, false, true};
  o.steps = 2;
  o.warmup_steps = 1;
  o.device_memory = uint64_t(1) << 32;
  o.offload_memory = uint64_t(1) << 30;
  o.eval_batches = 1;
  o.profile = true;
  Result<train::TrainResult> r = train::run_training(o, {});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_TRUE(r->profile.has_value());
  const EventLog& log = r->profile->events.log();
  int begins = 0, ends = 0;
  double last_end = 0;
  for (const Event& e : log.events()) {
    if (e.thread != kEventThreadCopy) continue;
    EXPECT_EQ(log.name(e.name), "offload copy");
    begins += e.kind == EventKind::kOpBegin;
    ends += e.kind == EventKind::kOpEnd;
    if (e.kind == EventKind::kOpEnd) last_end = std::max(last_end, e.t_us);
  }
  // Two offloaded blocks, out and back, in 2 steps x 2 micro-batches.
  EXPECT_EQ(begins, 2 * 2 * 2 * 2);
  EXPECT_EQ(ends, begins);
  EXPECT_GT(last_end, 0.0);
}

// Optimizer offload and activation offload would share the offload tier: together they are refused
// with both flags named, and the search with optimizer offload on keeps activations on the device.
// With optimizer offload too, both kinds share one offload tier: tests/train/offload_test.cc
// (BothKinds*), tests/plan/offload_search_test.cc (BothKindsShareOneTierAndAddUp,
// TheSearchChoosesBothWhenOnlyBothFit) and tests/dist/offload_dp_test.cc.

TEST(ActivationOffload, ATooSmallOffloadTierIsAClearError) {
  const std::string data = token_file(257);
  train::TrainOptions o;
  o.config = small_config(2);
  o.model_name = "test";
  o.data = data;
  o.seq = 32;
  o.micro_batch = 2;
  o.exec.offload = {true, true};
  o.steps = 1;
  o.device_memory = uint64_t(1) << 30;
  o.offload_memory = 4096;
  Result<train::TrainResult> r = train::run_training(o, {});
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(r.status().message().find("--offload-memory"), std::string::npos)
      << r.status().message();
  fs::remove(data);
}

}  // namespace
}  // namespace headroom
