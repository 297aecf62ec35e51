// Optimizer offload with data parallelism (ZeRO 0-3 over this job's ranks): the offload tier holds
// the rank's shard, and weights, m and v are bit-identical to the same ranks without offload.
// Runs the same on 1 rank or under mpirun -np 2 (dist_mpi_2ranks).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "data/token_file.h"
#include "model/gpt2.h"
#include "plan/memory_plan.h"
#include "test_env.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace headroom::train {
namespace {

namespace fs = std::filesystem;
using dist::test::world;

model::Gpt2Config tiny() {
  model::Gpt2Config c;
  c.n_layer = 2;
  c.n_embd = 64;
  c.n_head = 4;
  c.vocab_size = 211;
  c.n_positions = 32;
  return c;
}

struct Output {
  Status status;
  std::vector<float> params, m, v;  // m and v on rank 0 (from its checkpoint)
  uint64_t device_peak = 0, device_planned = 0, offload_peak = 0, offload_planned = 0;
};

class OffloadDataParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(testing::TempDir()) /
           ("headroom_offload_dp_" + std::to_string(getpid()) + "_" +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    data_ = (dir_ / "data.tok").string();
    std::mt19937 rng(23);
    std::vector<int32_t> toks(20000);
    for (auto& t : toks) t = int32_t(rng() % 210u);
    ASSERT_TRUE(data::write_token_file(data_, toks, 211, 210, 1).is_ok());
  }
  void TearDown() override { fs::remove_all(dir_); }

  // `activations`: activation offload per block (empty: none), in the same offload tier.
  Output run(int zero_stage, bool offload, model::Precision precision, const std::string& name,
             std::vector<bool> activations = {}) {
    TrainOptions o;
    o.comm = &world();
    o.zero_stage = zero_stage;
    o.config = tiny();
    o.model_name = "tiny";
    o.data = data_;
    o.seq = 16;
    o.micro_batch = 2;
    o.accumulation = 2;
    o.steps = 3;
    o.warmup_steps = 1;
    o.adamw.lr = 2e-3f;
    o.adamw.grad_clip = 0.5f;
    o.exec.precision = precision;
    o.exec.bf16_weight_copy = zero_stage < 3;  // ZeRO-3 casts each gathered block instead
    o.device_memory = uint64_t(1) << 30;
    o.eval_batches = 1;
    o.offload_optimizer = offload;
    o.optimizer_upload_chunk = 128;  // the update copied back in pieces (bits unchanged)
    o.offload_memory = uint64_t(1) << 30;
    o.exec.offload = std::move(activations);
    o.out_dir = (dir_ / name).string();
    o.save_every = o.steps;
    Output out;
    TrainCallbacks cb;
    cb.on_finish = [&](const model::Gpt2Config& c, const float* p, memory::MemoryResource*) {
      out.params.assign(p, p + model::gpt2_param_table(c).total_floats);
      return Status::ok();
    };
    Result<TrainResult> r = run_training(o, cb);
    out.status = r.status();
    if (!r.is_ok()) return out;
    out.device_peak = r->device_bytes_peak;
    out.device_planned = r->planned_peak_bytes;
    out.offload_peak = r->offload_bytes_peak;
    out.offload_planned = r->planned_offload_bytes;
    if (world().rank() == 0) {
      Result<LoadedCheckpoint> ck = find_checkpoint(o.out_dir);
      if (ck.is_ok()) {
        const int64_t P = model::gpt2_param_table(o.config).total_floats;
        std::vector<float> params(static_cast<size_t>(P));
        out.m.resize(size_t(P));
        out.v.resize(size_t(P));
        out.status = load_checkpoint(*ck, model::gpt2_param_table(o.config), params.data(),
                                     out.m.data(), out.v.data());
      } else {
        out.status = ck.status();
      }
    }
    return out;
  }

  static bool same(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
  }

  fs::path dir_;
  std::string data_;
};

TEST_F(OffloadDataParallel, BitIdenticalToTheSameRanksWithoutOffload) {
  const int R = world().size();
  struct Case {
    int stage;
    model::Precision precision;
  };
  const Case cases[] = {{0, model::Precision::kFp32}, {1, model::Precision::kFp32},
                        {2, model::Precision::kFp32}, {3, model::Precision::kFp32},
                        {1, model::Precision::kBf16}, {3, model::Precision::kBf16}};
  for (const Case& c : cases) {
    if (c.stage > 0 && R == 1) continue;  // sharding needs ranks (the trainer refuses it alone)
    const std::string tag =
        std::to_string(c.stage) + "_" + std::string(model::precision_name(c.precision));
    SCOPED_TRACE(tag);
    Output off = run(c.stage, false, c.precision, "off_" + tag);
    Output on = run(c.stage, true, c.precision, "on_" + tag);
    ASSERT_TRUE(off.status.is_ok()) << off.status.to_string();
    ASSERT_TRUE(on.status.is_ok()) << on.status.to_string();
    EXPECT_TRUE(same(off.params, on.params));
    if (world().rank() == 0) {
      EXPECT_TRUE(same(off.m, on.m));
      EXPECT_TRUE(same(off.v, on.v));
    }
    EXPECT_EQ(on.device_peak, on.device_planned);
    EXPECT_EQ(on.offload_peak, on.offload_planned);
    EXPECT_EQ(off.offload_planned, 0u);
    // The offload tier holds this rank's shard: 16 bytes a shard float (64-byte aligned).
    plan::Policy p;
    p.micro_batch = 2;
    p.accumulation = 2;
    p.seq = 16;
    p.precision = std::string(model::precision_name(c.precision));
    p.ranks = R;
    p.zero_stage = c.stage;
    p.offload_optimizer = true;
    p.exec.bf16_weight_copy = c.stage < 3;
    Result<plan::MemoryPlan> mp = plan::plan_training_memory(tiny(), p);
    ASSERT_TRUE(mp.is_ok());
    EXPECT_EQ(on.offload_planned, mp->offload_bytes);
    if (c.stage < 3) {  // (stage 3's shard is the sum of its units' pieces: dist::ShardLayout)
      const int64_t P = mp->params.total_floats;
      const int64_t S = c.stage == 0 ? P : ((P + R - 1) / R + 15) / 16 * 16;
      EXPECT_EQ(on.offload_planned, 4 * ((uint64_t(S) * 4 + 63) / 64 * 64));
    }
    EXPECT_EQ(on.device_planned, mp->peak_bytes);
  }
}

// Both kinds in one offload tier with data parallelism: each rank's tier holds its optimizer
// shard and its micro-batch's offloaded activations; weights, m and v are bit-identical to the
// same ranks with neither, and the tier's measured peak is the plan's sum of the two.
TEST_F(OffloadDataParallel, BothKindsBitIdenticalToTheSameRanksWithNeither) {
  const int R = world().size();
  for (int stage : {0, 2, 3}) {
    if (stage > 0 && R == 1) continue;
    const std::string tag = "both_" + std::to_string(stage);
    SCOPED_TRACE(tag);
    Output off = run(stage, false, model::Precision::kFp32, "neither_" + tag);
    Output on = run(stage, true, model::Precision::kFp32, tag, {true, true});
    ASSERT_TRUE(off.status.is_ok()) << off.status.to_string();
    ASSERT_TRUE(on.status.is_ok()) << on.status.to_string();
    EXPECT_TRUE(same(off.params, on.params));
    if (world().rank() == 0) {
      EXPECT_TRUE(same(off.m, on.m));
      EXPECT_TRUE(same(off.v, on.v));
    }
    plan::Policy p;
    p.micro_batch = 2;
    p.accumulation = 2;
    p.seq = 16;
    p.ranks = R;
    p.zero_stage = stage;
    p.offload_optimizer = true;
    Result<plan::MemoryPlan> opt = plan::plan_training_memory(tiny(), p);
    p.exec.offload = {true, true};
    Result<plan::MemoryPlan> both = plan::plan_training_memory(tiny(), p);
    ASSERT_TRUE(opt.is_ok() && both.is_ok());
    EXPECT_EQ(both->offload_bytes, opt->offload_bytes + plan::offloaded_activation_bytes(*both));
    EXPECT_EQ(on.offload_planned, both->offload_bytes);
    EXPECT_EQ(on.offload_peak, both->offload_bytes);
    EXPECT_EQ(on.device_peak, on.device_planned);
    EXPECT_EQ(on.device_planned, both->peak_bytes);
  }
}

}  // namespace
}  // namespace headroom::train
