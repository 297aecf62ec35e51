// Data-parallel training through the real trainer (issue #8): run_training on this job's ranks
// with ZeRO 0-2 against one process with the same global batch; per-rank measured peak against
// the plan; checkpoints that move between rank counts; a failure on one rank that ends every
// rank with its message. Every rank computes the single-process references itself (a local
// communicator, no collectives), so the tests run the same on 1 rank or 2.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "../train/train_test_util.h"
#include "model/gpt2.h"
#include "plan/memory_plan.h"
#include "plan/zero.h"
#include "test_env.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace headroom::train {
namespace {

namespace fs = std::filesystem;
using dist::test::world;

using test::RunOutput;
model::Gpt2Config tiny(int layers = 2) {
  model::Gpt2Config c = test::tiny_config();
  c.n_layer = layers;
  return c;
}

constexpr int kSeq = 16;
constexpr int kMicroBatch = 2;  // every run's micro-batch; a step is 2 x ranks sequences

// A token file and output directories for this rank. Every rank writes the same tokens (the same
// seed) to its own file: the same stream, as a shared file would give.
class DataParallelTrainer : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::fresh_test_dir("headroom_dp");
    data_ = (dir_ / "data.tok").string();
    test::write_random_tokens(data_, 21, 20000);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // `ranks` ranks (world() when it has that many and distributed, else one local process) with
  // micro-batch 2 and the accumulation that makes the global batch 2 x world().size().
  TrainOptions options(bool distributed, int zero_stage) {
    TrainOptions o;
    o.comm = distributed ? &world() : nullptr;
    o.zero_stage = zero_stage;
    o.config = tiny();
    o.model_name = "tiny";
    o.data = data_;
    o.seq = kSeq;
    o.micro_batch = kMicroBatch;
    o.accumulation = distributed ? 1 : world().size();
    o.steps = 3;
    o.warmup_steps = 1;
    o.adamw.lr = 1e-3f;
    o.device_memory = uint64_t(1) << 30;
    o.eval_batches = 1;
    return o;
  }
  std::string out(const std::string& name) const { return (dir_ / name).string(); }

  static RunOutput run(const TrainOptions& o) { return test::run_collecting(o); }

  fs::path dir_;
  std::string data_;
};

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.size(); i++) worst = std::max(worst, double(std::fabs(a[i] - b[i])));
  return worst;
}

// Largest difference relative to the largest magnitude (for m and v, whose scale is tiny).
double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double scale = 0;
  for (float x : b) scale = std::max(scale, double(std::fabs(x)));
  return max_abs_diff(a, b) / scale;
}

// Tolerance: the ranks' summed gradient equals the single process's up to the rounding of
// gradient accumulation (oneDNN adds micro-batch 2's weight gradient onto micro-batch 1's block by
// block, which rounds differently from adding two separate gradients; see docs/notes/zero.md);
// AdamW then moves each weight by at most lr = 1e-3 per step, so after 3 steps the weights agree
// to ~1e-6. 2e-5 is 50x below one step's move: a wrong loss normalisation, a rank's sequences
// taken twice or a stale shard fails it.
constexpr double kWeightTol = 2e-5;

TEST_F(DataParallelTrainer, RanksEqualOneProcessWithTheSameGlobalBatchForStages0To3) {
  const RunOutput ref = run(options(false, 0));
  ASSERT_TRUE(ref.result.is_ok()) << ref.result.status().to_string();
  {  // The weights moved well beyond the tolerance: the comparisons are not vacuous.
    const model::ParamTable table = model::gpt2_param_table(tiny());
    std::vector<float> init(size_t(table.total_floats));
    model::gpt2_init_params(tiny(), table, init.data(), options(false, 0).seed);
    EXPECT_GT(max_abs_diff(ref.params, init), 100 * kWeightTol);
  }
  std::vector<float> stage0;
  uint64_t stage0_peak = 0;
  for (int stage = 0; stage <= 3; stage++) {
    const RunOutput dp = run(options(true, stage));
    ASSERT_TRUE(dp.result.is_ok()) << "stage " << stage << ": " << dp.result.status().to_string();
    EXPECT_LE(max_abs_diff(dp.params, ref.params), kWeightTol) << "stage " << stage;
    RecordProperty("max_diff_stage" + std::to_string(stage),
                   std::to_string(max_abs_diff(dp.params, ref.params)));
    // Per rank, the measured peak is the planned one (principle 1 holds on every rank).
    EXPECT_EQ(dp.result->device_bytes_peak, dp.result->planned_peak_bytes) << "stage " << stage;
    if (stage == 0) {
      stage0 = dp.params;
      stage0_peak = dp.result->planned_peak_bytes;
      continue;
    }
    // The ZeRO machinery adds no rounding on up to 2 ranks (train/zero.h): bit-identical. With
    // one micro-batch per rank, stages 2-3 reduce each window once: g0 + g1, as stage 0 does;
    // stage 3 computes on gathered copies of the same floats.
    if (world().size() <= 2) {
      EXPECT_EQ(dp.params, stage0) << "stage " << stage;
    }
    if (stage >= 2) continue;  // their memory: Stage3HoldsLessThanStage2ByItsShards
    // Stages 1-2 hold a 1/R shard of m and v plus a reduced-gradient shard instead of the full
    // m and v: 8P - 12S bytes less per rank (S = the planned shard, plan/zero.h).
    plan::ZeroSpec zs;
    zs.stage = stage;
    zs.ranks = world().size();
    zs.param_floats = model::gpt2_param_table(tiny()).total_floats;
    const int64_t S = plan::zero_memory(zs).optimizer / 8;
    EXPECT_EQ(int64_t(stage0_peak) - int64_t(dp.result->planned_peak_bytes),
              8 * zs.param_floats - 12 * S)
        << "stage " << stage;
  }
}

// The Llama family under ZeRO: grouped-query attention, RoPE, SwiGLU and an untied head (a unit
// of its own in the head's site, taking turns with the embedding's in one window: model/gpt2.h
// ParamDesc::site, train/zero_windows.h) train on the ranks as in one process, every stage, also
// over two accumulated micro-batches (the window's reductions then alternate between the head's
// and the embedding's twice a step), with the measured peak the planned one on every rank.
TEST_F(DataParallelTrainer, LlamaWithUntiedHeadRanksEqualOneProcessForStages0To3) {
  auto llama = [&](bool distributed, int stage, int accumulation) {
    TrainOptions o = options(distributed, stage);
    o.config = test::llama_config(2, 64, 4, 2, 211, 32, false);
    o.micro_batch = kMicroBatch / accumulation;
    o.accumulation *= accumulation;
    return o;
  };
  for (int accumulation : {1, 2}) {
    const RunOutput ref = run(llama(false, 0, accumulation));
    ASSERT_TRUE(ref.result.is_ok()) << ref.result.status().to_string();
    for (int stage = 0; stage <= 3; stage++) {
      const RunOutput dp = run(llama(true, stage, accumulation));
      ASSERT_TRUE(dp.result.is_ok()) << "stage " << stage << ": " << dp.result.status().to_string();
      EXPECT_LE(max_abs_diff(dp.params, ref.params), kWeightTol)
          << "stage " << stage << ", accumulation " << accumulation;
      EXPECT_EQ(dp.result->device_bytes_peak, dp.result->planned_peak_bytes)
          << "stage " << stage << ", accumulation " << accumulation;
    }
  }
  // The window holds the larger of the two tables, not both.
  const model::ParamTable t =
      model::gpt2_param_table(test::llama_config(2, 64, 4, 2, 211, 32, false));
  const plan::ZeroWindowSizes w = plan::gpt2_zero_window_sizes(t, world().size());
  EXPECT_EQ(w.embedding, model::ParamTable::end_of(t.params[t.wte]) - t.params[t.wte].offset);
  EXPECT_EQ(w.final_norm, model::ParamTable::end_of(t.params[t.lnf_w]) - t.params[t.lnf_w].offset);
}

// Accumulation over micro-batches on R ranks: stages 0-1 accumulate in the full buffer and reduce
// it in buckets during the last micro-batch's backward only; stages 2-3 reduce-scatter every
// micro-batch's windows with the shard so far added by its owner. 2 micro-batches of 1 per rank
// equal one process's 2 x ranks micro-batches of 1 (tolerance as above: accumulation rounding).
TEST_F(DataParallelTrainer, AccumulatedMicroBatchesEqualOneProcessForStages0To3) {
  TrainOptions one = options(false, 0);
  one.micro_batch = 1;
  one.accumulation = 2 * world().size();
  const RunOutput ref = run(one);
  ASSERT_TRUE(ref.result.is_ok()) << ref.result.status().to_string();
  for (int stage : {0, 1, 2, 3}) {
    TrainOptions o = options(true, stage);
    o.micro_batch = 1;
    o.accumulation = 2;
    const RunOutput dp = run(o);
    ASSERT_TRUE(dp.result.is_ok()) << "stage " << stage << ": " << dp.result.status().to_string();
    EXPECT_LE(max_abs_diff(dp.params, ref.params), kWeightTol) << "stage " << stage;
    EXPECT_EQ(dp.result->device_bytes_peak, dp.result->planned_peak_bytes) << "stage " << stage;
  }
  // Only the first micro-batch adding (a shard that forgets earlier micro-batches) would leave
  // half the gradient: the weights would differ by far more than the tolerance from this run.
  TrainOptions half = one;
  half.accumulation = world().size();
  const RunOutput h = run(half);
  ASSERT_TRUE(h.result.is_ok());
  EXPECT_GT(max_abs_diff(h.params, ref.params), 10 * kWeightTol);
}

// Per rank, stage 2 holds gradient windows instead of the full gradient buffer, and stage 3 also
// the parameter shard and windows instead of the full parameters; measured == planned on every
// rank, and the plans differ by exactly that arithmetic (P parameter floats, W the windows of one
// kind, S2 the flat shard, S3 the per-unit shard):
//   stage 1: P params + P grads + S2 grad shard + 2 S2 moments
//   stage 2: P params + W grads + 3 S2
//   stage 3: S3 + W params + W grads + 3 S3
// A 6-block model, so that the windows (the embedding and two blocks) are below P.
TEST_F(DataParallelTrainer, Stage3HoldsLessThanStage2ByItsShards) {
  const int R = world().size();
  const model::ParamTable table = model::gpt2_param_table(tiny(6));
  const int64_t P = table.total_floats;
  const plan::ZeroWindowSizes win = plan::gpt2_zero_window_sizes(table, R);
  const int64_t W = win.total(), S3 = win.unit_shard;
  plan::ZeroSpec zs;
  zs.stage = 2;
  zs.ranks = R;
  zs.param_floats = P;
  const int64_t S2 = plan::zero_memory(zs).optimizer / 8;
  std::array<uint64_t, 4> peak{};
  for (int stage = 1; stage <= 3; stage++) {
    TrainOptions o = options(true, stage);
    o.config = tiny(6);
    o.steps = 1;
    const RunOutput dp = run(o);
    ASSERT_TRUE(dp.result.is_ok()) << "stage " << stage << ": " << dp.result.status().to_string();
    EXPECT_EQ(dp.result->device_bytes_peak, dp.result->planned_peak_bytes) << "stage " << stage;
    peak[size_t(stage)] = dp.result->planned_peak_bytes;
  }
  EXPECT_EQ(int64_t(peak[1]) - int64_t(peak[2]), 4 * (P - W));
  EXPECT_EQ(int64_t(peak[2]) - int64_t(peak[3]), 4 * (P - W + 3 * S2 - 4 * S3));
  if (R >= 2) {
    EXPECT_LT(peak[3], peak[2]);
    EXPECT_LT(peak[2], peak[1]);
  }
}

// The overlap: a block's gradient reduction is handed to the communication thread as soon as
// its backward ends, before the backward of the block below starts, and (somewhere in the run)
// the communication thread is running one while the training thread computes the next block.
// Verified from the order of recorded events (one counter across both threads), not timing.
TEST_F(DataParallelTrainer, ReductionOfABlockRunsWhileBackwardComputesTheNext) {
  for (int stage : {2, 3}) {
    TrainOptions o = options(true, stage);
    o.config = tiny(6);
    o.record_zero_events = true;
    const RunOutput dp = run(o);
    ASSERT_TRUE(dp.result.is_ok()) << dp.result.status().to_string();
    using E = ZeroWindows::Event;
    const std::vector<E>& ev = dp.result->zero_events;
    ASSERT_FALSE(ev.empty());
    int submitted_early = 0, late = 0, overlapped = 0;
    // Per backward pass: block l's submit must come before block l-1's begin.
    for (size_t i = 0; i < ev.size(); i++) {
      if (ev[i].kind != E::kReduceSubmit || ev[i].layer <= 0 || ev[i].layer >= 6) continue;
      const int l = ev[i].layer;
      // The next backward-begin event after the submit is block l-1's.
      size_t j = i + 1;
      while (j < ev.size() && ev[j].kind != E::kBackwardBegin) j++;
      if (j < ev.size() && ev[j].layer == l - 1) {
        submitted_early++;
      } else {
        late++;
      }
      // Its reduction began before block l-1's backward ended.
      size_t begin = i + 1;
      while (begin < ev.size() && !(ev[begin].kind == E::kReduceBegin && ev[begin].layer == l))
        begin++;
      size_t end = j;
      while (end < ev.size() && !(ev[end].kind == E::kBackwardEnd && ev[end].layer == l - 1)) end++;
      if (begin < ev.size() && end < ev.size() && begin < end) overlapped++;
    }
    EXPECT_EQ(late, 0) << "stage " << stage;
    // 5 blocks with a predecessor x 2 units x 3 steps.
    EXPECT_EQ(submitted_early, 5 * 2 * 3) << "stage " << stage;
    // Whether the communication thread actually started a reduction before the next block's
    // backward ended is up to the scheduler (on 2 oversubscribed cores it may not): reported,
    // not asserted. The order above is what the code guarantees.
    RecordProperty("overlapped_stage_" + std::to_string(stage), overlapped);
  }
}

// A checkpoint holds the full (gathered) m and v: a checkpoint of R ranks resumes on one process
// and one of a single process on R ranks, each continuing as the other would.
// Bucketed batching (docs/notes/batching.md): every rank reads the step's batch of documents and
// runs every R-th micro-batch; the loss is normalised by the step's real tokens on every rank.
// Equal to one process with the same global batch (accumulation R) within the tolerance above.
TEST_F(DataParallelTrainer, BucketedRanksEqualOneProcess) {
  const std::string docs = (dir_ / "docs.tok").string();
  std::mt19937 rng(23);
  std::vector<int32_t> toks;
  for (int d = 0; d < 300; d++) {
    const int len = 1 + int(rng() % 40);  // 1..40 tokens, some longer than T = 16
    for (int i = 0; i < len; i++) toks.push_back(int32_t(rng() % 210u));
    toks.push_back(210);
  }
  ASSERT_TRUE(data::write_token_file(docs, toks, 211, 210, 300).is_ok());
  auto opts = [&](bool distributed, int stage) {
    TrainOptions o = options(distributed, stage);
    o.data = docs;
    o.batching = data::Batching::kBucketed;
    o.bucket = 6;  // buckets of 6, 12 and 16 (T): micro-batches of 5, 2 and 2 rows
    o.steps = 4;
    return o;
  };
  const RunOutput ref = run(opts(false, 0));
  ASSERT_TRUE(ref.result.is_ok()) << ref.result.status().to_string();
  for (int stage = 0; stage <= 3; stage++) {
    const RunOutput dp = run(opts(true, stage));
    ASSERT_TRUE(dp.result.is_ok()) << "stage " << stage << ": " << dp.result.status().to_string();
    EXPECT_LE(max_abs_diff(dp.params, ref.params), kWeightTol) << "stage " << stage;
    // AdamW's update hardly changes when every gradient is scaled alike (a micro-batch run on
    // every rank doubles all of them): the loss, summed over the ranks, tells.
    EXPECT_NEAR(dp.result->final_loss, ref.result->final_loss, 1e-5 * ref.result->final_loss)
        << "stage " << stage;
    EXPECT_EQ(dp.result->device_bytes_peak, dp.result->planned_peak_bytes) << "stage " << stage;
  }
}

TEST_F(DataParallelTrainer, CheckpointsMoveBetweenRankCounts) {
  // The single-process run, checkpointed at step 2 (and 3).
  TrainOptions one = options(false, 0);
  one.out_dir = out("one");
  one.save_every = 2;
  one.keep_checkpoints = 0;
  const RunOutput ref = run(one);
  ASSERT_TRUE(ref.result.is_ok()) << ref.result.status().to_string();
  // R ranks with ZeRO-1 (sharded m and v), checkpointed the same way by rank 0.
  TrainOptions dp = options(true, 1);
  dp.out_dir = out("dp");
  dp.save_every = 2;
  dp.keep_checkpoints = 0;
  const RunOutput sharded = run(dp);
  ASSERT_TRUE(sharded.result.is_ok()) << sharded.result.status().to_string();
  EXPECT_LE(max_abs_diff(sharded.params, ref.params), kWeightTol);

  // Rank 0's step-2 checkpoint of the R-rank run holds complete moments: equal to the single
  // process's up to accumulation rounding (a missing shard would differ by 100%).
  if (world().rank() == 0) {
    const model::ParamTable table = model::gpt2_param_table(tiny());
    const size_t n = size_t(table.total_floats);
    auto load = [&](const std::string& path, std::vector<float>* p, std::vector<float>* m,
                    std::vector<float>* v) {
      p->assign(n, 0.0f);
      m->assign(n, 0.0f);
      v->assign(n, 0.0f);
      Result<LoadedCheckpoint> ck = find_checkpoint(path);
      ASSERT_TRUE(ck.is_ok()) << ck.status().to_string();
      EXPECT_EQ(ck->state.step, 2);
      EXPECT_EQ(ck->state.micro_batch * ck->state.accumulation, kMicroBatch * world().size());
      const Status s = load_checkpoint(*ck, table, p->data(), m->data(), v->data());
      ASSERT_TRUE(s.is_ok()) << s.to_string();
    };
    std::vector<float> p1, m1, v1, p2, m2, v2;
    load(out("one") + "/checkpoints/step-000002", &p1, &m1, &v1);
    load(out("dp") + "/checkpoints/step-000002", &p2, &m2, &v2);
    EXPECT_LE(max_abs_diff(p2, p1), kWeightTol);
    EXPECT_LE(max_rel_diff(m2, m1), 1e-5);
    EXPECT_LE(max_rel_diff(v2, v1), 1e-5);
  }

  // The R-rank checkpoint continued by one process (rank 0 alone, no collectives; EXPECT only,
  // so that rank 0 always reaches the broadcast below).
  if (world().rank() == 0) {
    TrainOptions resumed = options(false, 0);
    resumed.resume = out("dp") + "/checkpoints/step-000002";
    const RunOutput r = run(resumed);
    EXPECT_TRUE(r.result.is_ok()) << r.result.status().to_string();
    EXPECT_LE(max_abs_diff(r.params, ref.params), kWeightTol);
    EXPECT_LE(max_abs_diff(r.params, sharded.params), kWeightTol);
  }
  // The single process's checkpoint continued by R ranks with ZeRO-2 (each takes its shard). Every
  // rank reads rank 0's checkpoint directory (one machine).
  std::vector<char> path(4096, 0);
  const std::string mine = out("one") + "/checkpoints/step-000002";
  std::copy(mine.begin(), mine.end(), path.begin());
  ASSERT_TRUE(world().broadcast(path.data(), int64_t(path.size()), 0).is_ok());
  TrainOptions spread = options(true, 2);
  spread.resume = std::string(path.data());
  const RunOutput r = run(spread);
  ASSERT_TRUE(r.result.is_ok()) << r.result.status().to_string();
  EXPECT_LE(max_abs_diff(r.params, ref.params), kWeightTol);
}

// Allocation failures on rank 1 only, from step 2 on, until nothing fits rank 1's room: every
// rank stops with rank 1's report after rank 0 has checkpointed step 1 (a collective: the moments
// are gathered), and nothing hangs (ctest's timeout is the backstop). (A failure that a smaller
// plan recovers: tests/dist/ranks_replan_test.cc.)
TEST_F(DataParallelTrainer, FailureOnOneRankStopsEveryRankWithItsMessage) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks (mpirun -np 2)";
  // Every rank meets at the micro-batch boundary: the ranks agree there, re-plan together after
  // each failure, and stop together when no plan fits.
  for (int stage : {1, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    TrainOptions o = options(true, stage);
    o.out_dir = out("fail" + std::to_string(stage));
    if (world().rank() == 1) {  // step 2's first micro-batch, and every retry
      for (uint64_t i = 1; i < 40; i++) o.fail_step_allocations.push_back(i);
    }
    const RunOutput r = run(o);
    ASSERT_FALSE(r.result.is_ok());
    const Status& s = r.result.status();
    EXPECT_EQ(s.code(), StatusCode::kOutOfMemory) << s.to_string();
    EXPECT_EQ(s.message().rfind("rank 1: ", 0), 0u) << s.to_string();
    EXPECT_NE(s.message().find("injected failure"), std::string::npos) << s.to_string();
    EXPECT_NE(s.message().find("found nothing that fits"), std::string::npos) << s.to_string();
    EXPECT_NE(s.message().find("checkpoint of the last completed step (1) saved to"),
              std::string::npos)
        << s.to_string();
    if (world().rank() == 0) {
      EXPECT_TRUE(fs::exists(out("fail" + std::to_string(stage)) + "/checkpoints/step-000001"));
    }
  }

  // A failure before step one (rank 1 cannot open its data): the same, from set-up.
  TrainOptions bad = options(true, 0);
  if (world().rank() == 1) bad.data = out("missing.tok");
  const RunOutput b = run(bad);
  ASSERT_FALSE(b.result.is_ok());
  EXPECT_EQ(b.result.status().message().rfind("rank 1: ", 0), 0u) << b.result.status().to_string();
  EXPECT_NE(b.result.status().message().find("missing.tok"), std::string::npos)
      << b.result.status().to_string();
}

// Mixed precision: ZeRO-1/2 also refresh the bf16 copy of the weights that the GEMMs read (every
// rank's whole copy, not only its own piece). A stale copy on any piece would make the next
// forward use old weights there, and the weights drift from the single process's (measured
// with the cast left out: 2.6e-3). Tolerance as above; measured 3.7e-9.
TEST_F(DataParallelTrainer, Bf16CopyIsRefreshedOnEveryRank) {
  auto bf16 = [&](bool distributed, int stage) {
    TrainOptions o = options(distributed, stage);
    o.exec.precision = model::Precision::kBf16;
    o.exec.tiled_attention = true;
    return o;
  };
  const RunOutput ref = run(bf16(false, 0));
  ASSERT_TRUE(ref.result.is_ok()) << ref.result.status().to_string();
  for (int stage : {0, 1, 2}) {
    const RunOutput dp = run(bf16(true, stage));
    ASSERT_TRUE(dp.result.is_ok()) << dp.result.status().to_string();
    EXPECT_LE(max_abs_diff(dp.params, ref.params), kWeightTol) << "stage " << stage;
    EXPECT_EQ(dp.result->device_bytes_peak, dp.result->planned_peak_bytes);
  }
}

// ZeRO-3 with a persistent bf16 copy of the whole model is refused with a reason (it would undo
// the sharding); with the per-layer cast it runs and equals the single process.
TEST_F(DataParallelTrainer, Stage3WithBf16CastsPerLayer) {
  auto bf16 = [&](bool distributed, int stage, bool copy) {
    TrainOptions o = options(distributed, stage);
    o.exec.precision = model::Precision::kBf16;
    o.exec.tiled_attention = true;
    o.exec.bf16_weight_copy = copy;
    return o;
  };
  const RunOutput refused = run(bf16(true, 3, true));
  ASSERT_FALSE(refused.result.is_ok());
  EXPECT_EQ(refused.result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.result.status().message().find("--bf16-weights cast"), std::string::npos)
      << refused.result.status().to_string();
  const RunOutput ref = run(bf16(false, 0, false));
  ASSERT_TRUE(ref.result.is_ok()) << ref.result.status().to_string();
  const RunOutput dp = run(bf16(true, 3, false));
  ASSERT_TRUE(dp.result.is_ok()) << dp.result.status().to_string();
  EXPECT_LE(max_abs_diff(dp.params, ref.params), kWeightTol);
  EXPECT_EQ(dp.result->device_bytes_peak, dp.result->planned_peak_bytes);
}

// A 2-rank ZeRO-3 checkpoint (parameters, m and v gathered unit by unit to rank 0) equals one
// process's, and resumes on one process and on R ranks at stage 1, each continuing as the
// uninterrupted single process.
TEST_F(DataParallelTrainer, Stage3CheckpointsResumeOnOneProcessAndAtStage1) {
  TrainOptions one = options(false, 0);
  one.out_dir = out("one");
  one.save_every = 2;
  one.keep_checkpoints = 0;
  const RunOutput ref = run(one);
  ASSERT_TRUE(ref.result.is_ok()) << ref.result.status().to_string();
  TrainOptions dp = options(true, 3);
  dp.out_dir = out("dp");
  dp.save_every = 2;
  dp.keep_checkpoints = 0;
  const RunOutput sharded = run(dp);
  ASSERT_TRUE(sharded.result.is_ok()) << sharded.result.status().to_string();
  EXPECT_LE(max_abs_diff(sharded.params, ref.params), kWeightTol);
  std::vector<char> path(4096, 0);
  if (world().rank() == 0) {
    const model::ParamTable table = model::gpt2_param_table(tiny());
    const size_t n = size_t(table.total_floats);
    auto load = [&](const std::string& where, std::vector<float>* p, std::vector<float>* m,
                    std::vector<float>* v) {
      p->assign(n, 0.0f);
      m->assign(n, 0.0f);
      v->assign(n, 0.0f);
      Result<LoadedCheckpoint> ck = find_checkpoint(where);
      ASSERT_TRUE(ck.is_ok()) << ck.status().to_string();
      EXPECT_EQ(ck->state.step, 2);
      const Status s = load_checkpoint(*ck, table, p->data(), m->data(), v->data());
      ASSERT_TRUE(s.is_ok()) << s.to_string();
    };
    std::vector<float> p1, m1, v1, p2, m2, v2;
    load(out("one") + "/checkpoints/step-000002", &p1, &m1, &v1);
    load(out("dp") + "/checkpoints/step-000002", &p2, &m2, &v2);
    EXPECT_LE(max_abs_diff(p2, p1), kWeightTol);
    EXPECT_LE(max_rel_diff(m2, m1), 1e-5);
    EXPECT_LE(max_rel_diff(v2, v1), 1e-5);
    TrainOptions resumed = options(false, 0);
    resumed.resume = out("dp") + "/checkpoints/step-000002";
    const RunOutput r = run(resumed);
    EXPECT_TRUE(r.result.is_ok()) << r.result.status().to_string();
    EXPECT_LE(max_abs_diff(r.params, ref.params), kWeightTol);
    const std::string mine = out("dp") + "/checkpoints/step-000002";
    std::copy(mine.begin(), mine.end(), path.begin());
  }
  // Every rank continues rank 0's checkpoint with ZeRO-1.
  ASSERT_TRUE(world().broadcast(path.data(), int64_t(path.size()), 0).is_ok());
  TrainOptions spread = options(true, 1);
  spread.resume = std::string(path.data());
  const RunOutput r = run(spread);
  ASSERT_TRUE(r.result.is_ok()) << r.result.status().to_string();
  EXPECT_LE(max_abs_diff(r.params, ref.params), kWeightTol);
}

// fp16: an overflow on one rank only (rank 1's gradients get an infinity at step 2, before the
// reduction) is seen by every rank, since the norm is computed from the reduced gradients: every
// rank skips step 2 and halves its scale, and the weights equal the single process's with the
// same overflow (tolerance as above).
TEST_F(DataParallelTrainer, Fp16OverflowOnOneRankSkipsTheStepOnEveryRank) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks (mpirun -np 2)";
  auto fp16 = [&](bool distributed, int stage) {
    TrainOptions o = options(distributed, stage);
    o.exec.precision = model::Precision::kFp16;
    o.loss_scale.initial = 1024.0f;
    if (!distributed || world().rank() == 1) o.inject_overflow_steps = {1};
    return o;
  };
  auto run_logged = [](const TrainOptions& o, std::vector<StepStats>* steps) {
    RunOutput r;
    TrainCallbacks cb;
    cb.on_step = [&](const StepStats& s) { steps->push_back(s); };
    cb.on_finish = [&](const model::Gpt2Config& c, const float* p, memory::MemoryResource*) {
      r.params.assign(p, p + model::gpt2_param_table(c).total_floats);
      return Status::ok();
    };
    r.result = run_training(o, cb);
    return r;
  };
  std::vector<StepStats> ref_steps;
  const RunOutput ref = run_logged(fp16(false, 0), &ref_steps);
  ASSERT_TRUE(ref.result.is_ok()) << ref.result.status().to_string();
  ASSERT_EQ(ref_steps.size(), 3u);
  EXPECT_TRUE(ref_steps[1].skipped);
  for (int stage : {0, 1, 2, 3}) {
    std::vector<StepStats> steps;
    const RunOutput dp = run_logged(fp16(true, stage), &steps);
    ASSERT_TRUE(dp.result.is_ok()) << dp.result.status().to_string();
    ASSERT_EQ(steps.size(), 3u);
    for (size_t i = 0; i < 3; i++) {
      EXPECT_EQ(steps[i].skipped, i == 1) << "rank " << world().rank() << " step " << i + 1;
      EXPECT_EQ(steps[i].loss_scale, ref_steps[i].loss_scale) << "step " << i + 1;
    }
    EXPECT_EQ(steps[2].loss_scale, 512.0f);
    EXPECT_LE(max_abs_diff(dp.params, ref.params), kWeightTol) << "stage " << stage;
  }
}

}  // namespace
}  // namespace headroom::train
