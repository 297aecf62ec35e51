// Several ranks re-plan together (issue #26): a budget that changes on one rank, or an allocation
// that fails on one rank in the middle of a step, re-plans every rank to the same micro-batch (the
// smallest room bounds it), so the collectives stay matched and the run equals an undisturbed one
// on the same ranks. Needs 2 ranks (mpirun -np 2, the ctest entry dist_mpi_2ranks_replan, which
// has its own timeout: a broken agreement hangs in a collective).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../train/train_test_util.h"
#include "data/token_file.h"
#include "model/gpt2.h"
#include "plan/memory_plan.h"
#include "test_env.h"
#include "train/elastic.h"
#include "train/trainer.h"

namespace headroom::train {
namespace {

namespace fs = std::filesystem;
using dist::test::world;
using test::RunOutput;

// Tolerances of a changed micro-batch cut (the one-process elastic tests' argument): the
// gradients of the same G sequences summed in other pieces round differently (GEMMs over other
// row counts, another order of accumulation), so losses after the re-plan agree to rounding
// (1e-5 relative) and weights to 2e-5 (AdamW moves a weight by at most lr = 1e-3 a step even for
// a gradient at rounding level; the data-parallel tests' figure). Steps before the re-plan run the
// same plan on the same data: bit-identical.
constexpr double kLossTol = 1e-5;
constexpr double kWeightTol = 2e-5;

class RanksReplanTogether : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::fresh_test_dir("headroom_ranks_replan");
    data_ = (dir_ / "data.tok").string();
    test::write_random_tokens(data_, 21, 20000);
  }
  void TearDown() override { fs::remove_all(dir_); }

  TrainOptions options(int zero_stage, int micro_batch, int accumulation, int seq = 16) const {
    TrainOptions o;
    o.comm = &world();
    o.zero_stage = zero_stage;
    o.config = test::tiny_config();
    o.config.n_layer = 2;
    o.model_name = "tiny";
    o.data = data_;
    o.seq = seq;
    o.micro_batch = micro_batch;
    o.accumulation = accumulation;
    o.steps = 4;
    o.warmup_steps = 1;
    o.adamw.lr = 1e-3f;
    o.device_memory = uint64_t(1) << 30;
    o.eval_batches = 1;
    return o;
  }
  // This rank's planned peak with micro-batch b (no recomputation: the run's starting plan).
  static uint64_t peak(const TrainOptions& o, int b) {
    plan::Policy p;
    p.micro_batch = b;
    p.accumulation = o.micro_batch * o.accumulation / b;
    p.seq = o.seq;
    p.exec = o.exec;
    p.precision = "fp32";
    p.ranks = world().size();
    p.zero_stage = o.zero_stage;
    Result<plan::MemoryPlan> mp = plan::plan_training_memory(o.config, p);
    EXPECT_TRUE(mp.is_ok()) << mp.status().to_string();
    return mp.is_ok() ? mp->peak_bytes : 0;
  }

  fs::path dir_;
  std::string data_;
};

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size() || a.empty()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.size(); i++) worst = std::max(worst, double(std::fabs(a[i] - b[i])));
  return worst;
}

// True when every rank has the same values (a collective: every rank calls it).
bool same_on_every_rank(std::vector<int64_t> v) {
  std::vector<int64_t> lo = v, neg(v.size());
  for (size_t i = 0; i < v.size(); i++) neg[i] = -v[i];
  EXPECT_TRUE(world().all_reduce_min(lo.data(), int64_t(lo.size())).is_ok());
  EXPECT_TRUE(world().all_reduce_min(neg.data(), int64_t(neg.size())).is_ok());
  for (size_t i = 0; i < v.size(); i++) {
    if (lo[i] != -neg[i]) return false;
  }
  return true;
}

std::vector<int64_t> plans_of(const RunOutput& r) {
  std::vector<int64_t> v;
  for (const StepStats& s : r.steps) {
    v.push_back(s.micro_batch);
    v.push_back(s.accumulation);
    v.push_back(int64_t(std::hash<std::string>()(s.recompute) & 0xffffff));
    v.push_back(s.budget_rank);
  }
  v.resize(4 * 4, -1);  // a run that stopped early still makes the same collective
  return v;
}

void expect_equal_to_undisturbed(const RunOutput& r, const RunOutput& ref, int first_replanned,
                                 int stage) {
  ASSERT_EQ(r.steps.size(), ref.steps.size());
  for (size_t i = 0; i < r.steps.size(); i++) {
    if (int(i) + 1 < first_replanned) {
      EXPECT_EQ(r.steps[i].loss, ref.steps[i].loss) << "step " << i + 1;
    } else {
      EXPECT_NEAR(r.steps[i].loss, ref.steps[i].loss, kLossTol * std::fabs(ref.steps[i].loss))
          << "step " << i + 1;
    }
  }
  ASSERT_TRUE(r.result->final_val_loss && ref.result->final_val_loss);
  EXPECT_NEAR(*r.result->final_val_loss, *ref.result->final_val_loss,
              kLossTol * *ref.result->final_val_loss);
  EXPECT_LE(max_abs_diff(r.params, ref.params), kWeightTol);
  double worst_loss = 0;
  for (size_t i = 0; i < r.steps.size(); i++) {
    worst_loss = std::max(worst_loss, std::fabs(r.steps[i].loss / ref.steps[i].loss - 1));
  }
  std::ostringstream figures;
  figures << "max weight diff " << max_abs_diff(r.params, ref.params) << ", max rel loss diff "
          << worst_loss << "; plan at the end " << r.steps.back().micro_batch << " x "
          << r.steps.back().accumulation << " (recompute " << r.steps.back().recompute << ")";
  for (const std::string& e : r.steps[size_t(first_replanned - 1)].events) figures << "; " << e;
  ::testing::Test::RecordProperty("figures_stage" + std::to_string(stage), figures.str());
}

// Rank 1's budget file is halved after step 2; rank 0's stays. Both ranks read their own file
// (`{rank}` in the path), agree before step 3 that rank 1's room is the smallest, and both run
// the plan chosen for it from step 3 on.
TEST_F(RanksReplanTogether, BudgetHalvedOnOneRankReplansEveryRankAlike) {
  if (world().size() != 2) GTEST_SKIP() << "needs 2 ranks (mpirun -np 2)";
  for (int stage : {0, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    // Seq 32 and 8 sequences per rank: the step region is most of the memory, so that half the
    // budget holds a smaller micro-batch.
    const TrainOptions ref_o = options(stage, 8, 1, 32);
    const RunOutput ref = test::run_collecting(ref_o);
    ASSERT_TRUE(ref.result.is_ok()) << ref.result.status().to_string();

    // A budget the starting plan (8 x 1) fits with a little to spare, and its half, which it
    // does not fit but micro-batch 2 does (the preconditions of the test).
    const uint64_t budget = peak(ref_o, 8) + 64 * 1024, half = budget / 2;
    ASSERT_GT(peak(ref_o, 8), half);
    ASSERT_LE(peak(ref_o, 2), half);
    TrainOptions o = ref_o;
    o.device_memory = budget;
    o.device_memory_file = (dir_ / ("budget-s" + std::to_string(stage) + "-{rank}")).string();
    const std::string mine = budget_file_for_rank(o.device_memory_file, world().rank());
    EXPECT_EQ(mine.substr(mine.size() - 2), "-" + std::to_string(world().rank()));
    std::ofstream(mine, std::ios::trunc) << budget << "B\n";
    const RunOutput r = test::run_collecting(o, [&](const StepStats& s) {
      if (s.step == 2 && world().rank() == 1) std::ofstream(mine, std::ios::trunc) << half << "B\n";
    });
    // Collectives first (every rank, whatever happened), then the checks.
    const bool same = same_on_every_rank(plans_of(r));
    ASSERT_TRUE(r.result.is_ok()) << r.result.status().to_string();
    EXPECT_TRUE(same) << "the ranks ran different plans";
    ASSERT_EQ(r.steps.size(), 4u);
    EXPECT_EQ(r.steps[1].micro_batch, 8);
    EXPECT_EQ(r.steps[1].replans, 0);
    // Step 3 re-planned on both ranks, bound by rank 1's budget, and the plan stays.
    EXPECT_EQ(r.steps[2].replans, 1);
    EXPECT_EQ(r.steps[2].budget_rank, 1);
    ASSERT_EQ(r.steps[2].events.size(), 1u);
    const std::string& e = r.steps[2].events[0];
    EXPECT_NE(e.find("on rank 1 (rank 1's budget"), std::string::npos) << e;
    EXPECT_NE(e.find("re-planned"), std::string::npos) << e;
    EXPECT_EQ(r.steps[3].micro_batch, r.steps[2].micro_batch);
    EXPECT_EQ(r.steps[2].accumulation * r.steps[2].micro_batch, 8 * world().size());
    // Principle 1 on every rank: the measured peak is the re-planned one.
    EXPECT_EQ(r.steps[3].device_bytes_peak, r.steps[3].planned_peak_bytes);
    EXPECT_LE(r.steps[3].device_bytes_peak, world().rank() == 1 ? half : budget);
    expect_equal_to_undisturbed(r, ref, 3, stage);
  }
}

// Rank 1's step region fails at step 2's second micro-batch (acquisition #3: two per step). Rank
// 0 has its region; both agree at that boundary, drop their regions, re-plan for rank 1's room
// (less than the failed plan) and redo the micro-batch: the first micro-batch's gradients are
// kept, and the result equals the undisturbed run's.
TEST_F(RanksReplanTogether, AllocationFailureOnOneRankMidStepIsRedoneOnEveryRank) {
  if (world().size() != 2) GTEST_SKIP() << "needs 2 ranks (mpirun -np 2)";
  for (int stage : {0, 1, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const TrainOptions ref_o = options(stage, 2, 2);
    const RunOutput ref = test::run_collecting(ref_o);
    ASSERT_TRUE(ref.result.is_ok()) << ref.result.status().to_string();
    TrainOptions o = ref_o;
    o.out_dir = (dir_ / ("oom" + std::to_string(stage))).string();
    // Twice: the first re-plan keeps micro-batch 2 with recomputation, the retry of the same
    // micro-batch fails again, and the second re-plan cuts the rest of the step smaller.
    if (world().rank() == 1) o.fail_step_allocations = {3, 4};
    const RunOutput r = test::run_collecting(o);
    const bool same = same_on_every_rank(plans_of(r));
    ASSERT_TRUE(r.result.is_ok()) << r.result.status().to_string();
    EXPECT_TRUE(same) << "the ranks ran different plans";
    ASSERT_EQ(r.steps.size(), 4u);
    EXPECT_EQ(r.steps[0].micro_batch, 2);
    EXPECT_EQ(r.steps[1].oom_recoveries, 2);
    EXPECT_EQ(r.result->oom_recoveries, 2);
    EXPECT_EQ(r.steps[1].budget_rank, 1);
    EXPECT_EQ(r.steps[1].replans, 2);
    // The first micro-batch (2 sequences) under the old plan, the other 2 under the new one.
    const int b = r.steps[1].micro_batch;
    ASSERT_TRUE(b == 1 || b == 2) << b;
    EXPECT_EQ(r.steps[1].micro_batches, 1 + 2 / b);
    EXPECT_LT(r.steps[1].planned_peak_bytes, r.steps[0].planned_peak_bytes);
    EXPECT_EQ(r.steps[3].micro_batch, b);  // the lowered room stays (as on one process)
    ASSERT_EQ(r.steps[1].events.size(), 2u);
    const std::string& e = r.steps[1].events[0];
    // Rank 1's own sequence numbers (its share is sequences 5-8 of the step), on every rank.
    EXPECT_NE(e.find("out of memory on rank 1 at micro-batch 2 (sequence 7 of 8)"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("on every rank; redoing it"), std::string::npos) << e;
    // The failing rank wrote its report, the other none.
    const std::string report = o.out_dir + "/oom-report-step-000002-rank-1.txt";
    if (world().rank() == 1) {
      EXPECT_TRUE(fs::exists(report)) << report;
      EXPECT_NE(e.find("(report: " + report + ")"), std::string::npos) << e;
      ASSERT_EQ(r.steps[1].oom_reports.size(), 2u);
      EXPECT_NE(r.steps[1].oom_reports[0].find("injected failure"), std::string::npos);
    } else {
      EXPECT_TRUE(r.steps[1].oom_reports.empty());
    }
    EXPECT_EQ(r.steps[3].device_bytes_peak, r.steps[3].planned_peak_bytes);
    expect_equal_to_undisturbed(r, ref, 2, stage);
  }
}

// Bucketed batching: the ranks take turns over a step's micro-batches (of varying shapes), so a
// rank that does not run a micro-batch only joins its agreement; when its owner's acquisition
// fails, both re-plan and the owner redoes it. (The failure here is of a smaller shape's region:
// the lowered ceiling is the largest shape's peak less one byte, under which the run's policy
// still fits, so the re-plan keeps it, as one process would; the point is the agreement.)
TEST_F(RanksReplanTogether, BucketedFailureOnOneRankIsRedoneOnEveryRank) {
  if (world().size() != 2) GTEST_SKIP() << "needs 2 ranks (mpirun -np 2)";
  const std::string docs = (dir_ / "docs.tok").string();
  std::mt19937 rng(23);
  std::vector<int32_t> toks;
  for (int d = 0; d < 300; d++) {
    const int len = 1 + int(rng() % 40);
    for (int i = 0; i < len; i++) toks.push_back(int32_t(rng() % 210u));
    toks.push_back(210);
  }
  ASSERT_TRUE(data::write_token_file(docs, toks, 211, 210, 300).is_ok());
  for (int stage : {0, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    TrainOptions ref_o = options(stage, 2, 1);
    ref_o.data = docs;
    ref_o.batching = data::Batching::kBucketed;
    ref_o.bucket = 6;
    const RunOutput ref = test::run_collecting(ref_o);
    ASSERT_TRUE(ref.result.is_ok()) << ref.result.status().to_string();
    TrainOptions o = ref_o;
    if (world().rank() == 1) o.fail_step_allocations = {2};
    const RunOutput r = test::run_collecting(o);
    const bool same = same_on_every_rank(plans_of(r));
    ASSERT_TRUE(r.result.is_ok()) << r.result.status().to_string();
    EXPECT_TRUE(same) << "the ranks ran different plans";
    EXPECT_EQ(r.result->oom_recoveries, 1);
    EXPECT_EQ(r.result->replans, 1);  // the same on both ranks (plans_of: the same plans)
    std::string events;
    for (const StepStats& st : r.steps) {
      for (const std::string& e : st.events) events += e + "\n";
    }
    RecordProperty("events_stage" + std::to_string(stage), events);
    ASSERT_EQ(r.steps.size(), ref.steps.size());
    for (size_t i = 0; i < r.steps.size(); i++) {
      EXPECT_NEAR(r.steps[i].loss, ref.steps[i].loss, kLossTol * std::fabs(ref.steps[i].loss))
          << "step " << i + 1;
    }
    EXPECT_LE(max_abs_diff(r.params, ref.params), kWeightTol);
  }
}

}  // namespace
}  // namespace headroom::train
