// Optimizer offload in the trainer (issue #4): invisible to the mathematics (weights, m and v
// bit-identical to the run without it, fp32 and bf16, with accumulation), the offload tier's
// bytes equal to the plan's, a clear error when its budget is too small, and checkpoints that
// resume exactly across offload on and off.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>

#include "data/token_file.h"
#include "model/gpt2.h"
#include "plan/memory_plan.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

model::Gpt2Config tiny() {
  model::Gpt2Config c;
  c.n_layer = 2;
  c.n_embd = 64;
  c.n_head = 4;
  c.vocab_size = 211;
  c.n_positions = 32;
  return c;
}

struct Snapshot {
  std::vector<float> params, m, v;
  std::vector<double> losses;
};

class Offload : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(testing::TempDir()) /
           ("headroom_offload_" + std::to_string(getpid()) + "_" +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    data_ = (dir_ / "data.tok").string();
    std::mt19937 rng(11);
    std::vector<int32_t> toks(30000);
    for (auto& t : toks) t = int32_t(rng() % 210u);
    for (size_t i = 40; i < toks.size(); i += 101) toks[i] = 210;  // document ends
    ASSERT_TRUE(data::write_token_file(data_, toks, 211, 210, 1).is_ok());
  }
  void TearDown() override { fs::remove_all(dir_); }

  train::TrainOptions options(const std::string& out, bool offload, model::Precision precision) {
    train::TrainOptions o;
    o.config = tiny();
    o.model_name = "tiny";
    o.data = data_;
    o.seq = 16;
    o.micro_batch = 2;
    o.accumulation = 3;
    o.steps = 5;
    o.warmup_steps = 2;
    o.adamw.lr = 3e-3f;
    o.adamw.grad_clip = 0.5f;  // clipping active: the norm's path is exercised too
    o.exec.precision = precision;
    o.device_memory = uint64_t(1) << 30;
    o.offload_optimizer = offload;
    o.offload_memory = uint64_t(1) << 30;
    o.out_dir = (dir_ / out).string();
    o.save_every = o.steps;
    return o;
  }

  // Runs `o` and reads back its last checkpoint (weights, m, v) and the losses; checks on every
  // step that the measured device and offload-tier peaks equal the plan's.
  Snapshot run(const train::TrainOptions& o, train::TrainResult* result = nullptr) {
    Snapshot s;
    train::TrainCallbacks cb;
    cb.on_step = [&](const train::StepStats& st) {
      s.losses.push_back(st.loss);
      EXPECT_EQ(st.device_bytes_peak, st.planned_peak_bytes) << "step " << st.step;
      EXPECT_EQ(st.offload_bytes_peak, st.planned_offload_bytes) << "step " << st.step;
      EXPECT_EQ(st.offload_bytes_in_use, st.planned_offload_bytes) << "step " << st.step;
      EXPECT_EQ(st.planned_offload_bytes > 0, o.offload_optimizer);
    };
    Result<train::TrainResult> r = train::run_training(o, cb);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    if (!r.is_ok()) return s;
    if (result) *result = *r;
    Result<train::LoadedCheckpoint> ck = train::find_checkpoint(o.out_dir);
    EXPECT_TRUE(ck.is_ok()) << ck.status().to_string();
    if (!ck.is_ok()) return s;
    const model::ParamTable t = model::gpt2_param_table(o.config);
    s.params.resize(size_t(t.total_floats));
    s.m.resize(size_t(t.total_floats));
    s.v.resize(size_t(t.total_floats));
    EXPECT_TRUE(train::load_checkpoint(*ck, t, s.params.data(), s.m.data(), s.v.data()).is_ok());
    return s;
  }

  static bool same(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && !a.empty() &&
           std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  }

  fs::path dir_;
  std::string data_;
};

TEST_F(Offload, WeightsAndMomentsAreBitIdenticalToNoOffload) {
  for (model::Precision p : {model::Precision::kFp32, model::Precision::kBf16}) {
    const std::string name(model::precision_name(p));
    SCOPED_TRACE(name);
    Snapshot off = run(options("off_" + name, false, p));
    train::TrainResult on_result;
    Snapshot on = run(options("on_" + name, true, p), &on_result);
    ASSERT_EQ(off.losses.size(), 5u);
    EXPECT_EQ(off.losses, on.losses);
    EXPECT_TRUE(same(off.params, on.params));
    EXPECT_TRUE(same(off.m, on.m));
    EXPECT_TRUE(same(off.v, on.v));
    // The update computed and copied back in small pieces (192 floats: hundreds of them, none
    // on a tensor's boundary): the same bits.
    train::TrainOptions pieces = options("pieces_" + name, true, p);
    pieces.optimizer_upload_chunk = 192;
    Snapshot piecewise = run(pieces);
    EXPECT_EQ(off.losses, piecewise.losses);
    EXPECT_TRUE(same(off.params, piecewise.params));
    EXPECT_TRUE(same(off.m, piecewise.m));
    EXPECT_TRUE(same(off.v, piecewise.v));
    // The weights moved: a test that would pass with AdamW skipped would fail here.
    Snapshot start;
    train::TrainOptions none = options("none_" + name, true, p);
    none.steps = 1;
    none.save_every = 1;
    start = run(none);
    EXPECT_FALSE(same(start.params, on.params));
    // The offload tier held exactly the plan: master, m, v and the gradient copy.
    plan::Policy pol;
    pol.micro_batch = 2;
    pol.accumulation = 3;
    pol.seq = 16;
    pol.precision = name;
    pol.offload_optimizer = true;
    Result<plan::MemoryPlan> mp = plan::plan_training_memory(tiny(), pol);
    ASSERT_TRUE(mp.is_ok());
    EXPECT_EQ(on_result.planned_offload_bytes, mp->offload_bytes);
    EXPECT_EQ(on_result.offload_bytes_peak, mp->offload_bytes);
    EXPECT_EQ(on_result.offload_memory.allocations, 3u);
    EXPECT_EQ(on_result.device_bytes_peak, mp->peak_bytes);
  }
}

TEST_F(Offload, TooSmallOffloadBudgetIsAClearOutOfMemory) {
  train::TrainOptions o = options("small", true, model::Precision::kFp32);
  o.offload_memory = 64 * 1024;
  Result<train::TrainResult> r = train::run_training(o, {});
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfMemory);
  const std::string& msg = r.status().message();
  for (const char* what : {"offload tier", "--offload-memory", "64.0 KiB", "optimizer state",
                           "--offload-optimizer off"}) {
    EXPECT_NE(msg.find(what), std::string::npos) << what << "\n" << msg;
  }
}

// Both kinds in one offload tier (Note [Optimizer offload], "Both kinds"): the optimizer state
// and the offloaded activations share its stack and budget. Weights, m, v and the losses are
// bit-identical to neither; the tier's measured peak (and what it holds after every step) is
// the combined plan's offload_bytes, the sum of the two kinds'. The copy thread's test hooks
// deliver each activation copy as late as the waits allow and poison its source (as in
// activation_offload_test.cc), so a missing wait or a region shared wrongly between the two
// kinds changes the result.
TEST_F(Offload, BothKindsTogetherAreBitIdenticalToNeither) {
  using R = model::Recompute;
  struct Case {
    model::Precision precision;
    std::vector<bool> offload;
    std::vector<R> recompute;
  };
  const Case cases[] = {{model::Precision::kFp32, {true, true}, {}},
                        {model::Precision::kBf16, {true, false}, {R::kSelective, R::kNone}}};
  for (const Case& c : cases) {
    const std::string name(model::precision_name(c.precision));
    SCOPED_TRACE(name);
    train::TrainOptions neither = options("neither_" + name, false, c.precision);
    neither.exec.recompute = c.recompute;
    const Snapshot off = run(neither);
    train::TrainOptions o = options("both_" + name, true, c.precision);
    o.exec.recompute = c.recompute;
    o.exec.offload = c.offload;
    o.offload_copier.delay = std::chrono::microseconds(200);
    o.offload_copier.poison_sources = true;
    o.offload_copier.run_at_wait = true;
    train::TrainResult result;
    const Snapshot both = run(o, &result);
    ASSERT_EQ(off.losses.size(), 5u);
    EXPECT_EQ(off.losses, both.losses);
    EXPECT_TRUE(same(off.params, both.params));
    EXPECT_TRUE(same(off.m, both.m));
    EXPECT_TRUE(same(off.v, both.v));
    EXPECT_GT(result.offload_copied_bytes, 0u);  // the activations did move
    // The tier: the sum of the two kinds' plans, measured; four regions, four allocations.
    plan::Policy pol{2, 3, 16, name, o.exec};
    pol.offload_optimizer = true;
    Result<plan::MemoryPlan> mp = plan::plan_training_memory(tiny(), pol);
    plan::Policy opt_only{2, 3, 16, name, neither.exec};
    opt_only.offload_optimizer = true;
    Result<plan::MemoryPlan> opt = plan::plan_training_memory(tiny(), opt_only);
    ASSERT_TRUE(mp.is_ok() && opt.is_ok()) << mp.status().to_string();
    EXPECT_EQ(mp->offload_bytes, opt->offload_bytes + plan::offloaded_activation_bytes(*mp));
    EXPECT_GT(plan::offloaded_activation_bytes(*mp), 0u);
    EXPECT_EQ(result.planned_offload_bytes, mp->offload_bytes);
    EXPECT_EQ(result.offload_bytes_peak, mp->offload_bytes);
    EXPECT_EQ(result.offload_memory.allocations, 4u);
    EXPECT_EQ(result.device_bytes_peak, mp->peak_bytes);
    EXPECT_EQ(result.planned_peak_bytes, mp->peak_bytes);
  }
}

// One budget for both kinds: room for the optimizer state alone is not room for both, and the
// error names the flag and both parts.
TEST_F(Offload, BothKindsShareOneBudget) {
  train::TrainOptions o = options("small_both", true, model::Precision::kFp32);
  o.exec.offload = {true, true};
  plan::Policy pol{2, 3, 16, "fp32", {}};
  pol.offload_optimizer = true;
  Result<plan::MemoryPlan> opt = plan::plan_training_memory(tiny(), pol);
  ASSERT_TRUE(opt.is_ok());
  o.offload_memory = opt->offload_bytes;
  Result<train::TrainResult> r = train::run_training(o, {});
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfMemory);
  const std::string& msg = r.status().message();
  for (const char* what :
       {"offload tier", "--offload-memory", "optimizer state", "offloaded activations",
        "--offload-optimizer off", "--offload-activations"}) {
    EXPECT_NE(msg.find(what), std::string::npos) << what << "\n" << msg;
  }
  // The same budget holds the optimizer state alone.
  o.exec.offload.clear();
  o.steps = 1;
  o.save_every = 0;
  Result<train::TrainResult> alone = train::run_training(o, {});
  ASSERT_TRUE(alone.is_ok()) << alone.status().to_string();
  EXPECT_EQ(alone->offload_bytes_peak, opt->offload_bytes);
}

TEST_F(Offload, CheckpointsResumeExactlyAcrossOffloadOnAndOff) {
  const model::Precision p = model::Precision::kFp32;
  Snapshot straight = run(options("straight", false, p));
  for (bool first_on : {false, true}) {
    SCOPED_TRACE(first_on ? "on, then off" : "off, then on");
    const std::string out = first_on ? "on_off" : "off_on";
    train::TrainOptions a = options(out, first_on, p);
    a.steps = 5;
    a.save_every = 2;
    train::TrainCallbacks stop;
    stop.should_stop = [](const train::StepStats& s) { return s.step == 2; };
    Result<train::TrainResult> r1 = train::run_training(a, stop);
    ASSERT_TRUE(r1.is_ok()) << r1.status().to_string();
    ASSERT_TRUE(r1->stopped);
    train::TrainOptions b = options(out, !first_on, p);
    b.resume = (dir_ / out).string();
    Snapshot resumed = run(b);
    EXPECT_TRUE(same(straight.params, resumed.params));
    EXPECT_TRUE(same(straight.m, resumed.m));
    EXPECT_TRUE(same(straight.v, resumed.v));
  }
}

}  // namespace
}  // namespace headroom
