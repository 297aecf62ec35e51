// Bucketed batching through the trainer (issue #5): an optimizer step holds the same documents
// whatever the micro-batch, the loss is normalised by the step's real tokens, the step region
// is planned once per micro-batch shape and the measured peak is the largest shape's plan, and
// a checkpoint resumes the document stream exactly.
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "data/doc_batcher.h"
#include "data/token_file.h"
#include "memory/host_resource.h"
#include "model/gpt2.h"
#include "plan/memory_plan.h"
#include "train/shape_plans.h"
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

constexpr int kT = 32;
constexpr int kBucket = 8;

class Bucketing : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(testing::TempDir()) /
           ("headroom_bucketing_" + std::to_string(getpid()) + "_" +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    data_ = (dir_ / "docs.tok").string();
    // Documents of 1..60 tokens (some longer than T = 32), each ended by the eot (210).
    std::mt19937 rng(9);
    std::vector<int32_t> toks;
    for (int d = 0; d < 400; d++) {
      const int len = 1 + int(rng() % 60);
      for (int i = 0; i < len; i++) toks.push_back(int32_t(rng() % 210u));
      toks.push_back(210);
    }
    ASSERT_TRUE(data::write_token_file(data_, toks, 211, 210, 400).is_ok());
  }
  void TearDown() override { fs::remove_all(dir_); }

  train::TrainOptions options(int b, int k) {
    train::TrainOptions o;
    o.config = tiny();
    o.model_name = "tiny";
    o.data = data_;
    o.seq = kT;
    o.micro_batch = b;
    o.accumulation = k;
    o.steps = 4;
    o.warmup_steps = 1;
    o.device_memory = uint64_t(1) << 30;
    o.val_fraction = 0.05;
    o.batching = data::Batching::kBucketed;
    o.bucket = kBucket;
    return o;
  }
  struct Run {
    std::vector<train::StepStats> steps;
    std::vector<float> params;
    train::TrainResult result;
  };
  Run run(const train::TrainOptions& o, int stop_after = 0) {
    Run out;
    train::TrainCallbacks cb;
    cb.on_step = [&](const train::StepStats& s) { out.steps.push_back(s); };
    if (stop_after)
      cb.should_stop = [&](const train::StepStats& s) { return s.step == stop_after; };
    cb.on_finish = [&](const model::Gpt2Config& c, const float* p, memory::MemoryResource*) {
      out.params.assign(p, p + model::gpt2_param_table(c).total_floats);
      return Status::ok();
    };
    Result<train::TrainResult> r = train::run_training(o, cb);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    if (r.is_ok()) out.result = *r;
    return out;
  }
  fs::path dir_;
  std::string data_;
};

// The plan of one micro-batch shape (rows x len) under `policy`'s techniques, as ShapePlans makes
// it.
Result<plan::MemoryPlan> shape_plan(plan::Policy policy, int rows, int len) {
  policy.micro_batch = rows;
  policy.accumulation = 1;
  policy.seq = len;
  return plan::plan_training_memory(tiny(), policy);
}

double max_abs(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double w = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); i++)
    w = std::max(w, double(std::fabs(a[i] - b[i])));
  return w;
}

// b = 8, k = 1 vs b = 2, k = 4 vs b = 1, k = 8: every step is one batch of documents of
// G x T = 256 tokens at most (the same documents in all three), cut into micro-batches of
// floor(b T / length) rows, so the runs differ in the shapes and counts of their micro-batches
// and in nothing else but rounding.
TEST_F(Bucketing, AccumulationIsInvariantWithDocumentsOfUnequalLength) {
  // Buckets of 12, 24 and 32 (T) tokens: below T a micro-batch's rows never fill its budget
  // exactly (floor(32 b / 12), floor(32 b / 24)), so micro-batch counts differ from k.
  auto opts = [&](int b, int k) {
    train::TrainOptions o = options(b, k);
    o.bucket = 12;
    return o;
  };
  Run r81 = run(opts(8, 1)), r24 = run(opts(2, 4)), r18 = run(opts(1, 8));
  ASSERT_EQ(r81.steps.size(), 4u);
  ASSERT_EQ(r24.steps.size(), 4u);
  ASSERT_EQ(r18.steps.size(), 4u);
  bool more_micro_batches = false;
  for (size_t i = 0; i < 4; i++) {
    // The same real tokens (the same documents), and padding in the step.
    EXPECT_EQ(r24.steps[i].tokens, r81.steps[i].tokens);
    EXPECT_EQ(r18.steps[i].tokens, r81.steps[i].tokens);
    EXPECT_LT(r81.steps[i].tokens, 8 * kT + 1);
    EXPECT_EQ(r81.steps[i].micro_batches, 1);
    more_micro_batches |= r18.steps[i].micro_batches > 8;
    // GEMMs of other shapes round differently: 1e-5 relative (the packed accumulation test's).
    EXPECT_NEAR(r24.steps[i].loss, r81.steps[i].loss, 1e-5 * r81.steps[i].loss) << i;
    EXPECT_NEAR(r18.steps[i].loss, r81.steps[i].loss, 1e-5 * r81.steps[i].loss) << i;
  }
  // A bucket shorter than T holds more than b rows per micro-batch, and some step of b = 1
  // needs more than k = 8 micro-batches (the count follows the documents, the budget is fixed).
  EXPECT_TRUE(more_micro_batches);
  // AdamW normalises each update, so rounding-level gradient differences can move a weight by up
  // to lr only where the gradient itself is at rounding level: 1e-4 absolute (as for packed).
  EXPECT_LE(max_abs(r24.params, r81.params), 1e-4);
  EXPECT_LE(max_abs(r18.params, r81.params), 1e-4);
}

// The loss of a bucketed step is normalised by its real tokens: gradients of one step batch
// (rows of unequal length, padding ignored) cut into micro-batches of 8, 2 and 1 sequences'
// budget agree; averaging per micro-batch (the common bug) does not.
TEST_F(Bucketing, LossIsNormalisedByTheRealTokensOfTheStep) {
  Result<data::TokenFile> f = data::TokenFile::open(data_);
  ASSERT_TRUE(f.is_ok());
  const int G = 8;
  Result<data::DocumentBatcher> db =
      data::DocumentBatcher::create(*f, {0, f->size()}, kT, kBucket, int64_t(G) * kT, 3);
  ASSERT_TRUE(db.is_ok());
  // A step batch of a bucket shorter than T with rows of unequal real length.
  std::vector<int32_t> in(size_t(G) * kT), tg(size_t(G) * kT);
  data::DocumentBatcher::Shape sh;
  do {
    sh = db->next(in.data(), tg.data());
  } while (sh.length == kT || sh.real_tokens == int64_t(sh.rows) * sh.length);
  const model::Gpt2Config c = tiny();
  auto gradients = [&](int b, bool per_micro_batch_mean) {
    train::ShapePlans shapes(c, plan::Policy{b, 1, kT, "fp32", {}});
    const model::ParamTable table = model::gpt2_param_table(c);
    std::vector<float> params(size_t(table.total_floats)), grads(params.size(), 0.0f);
    model::gpt2_init_params(c, table, params.data(), 5);
    model::Gpt2 net(c, &table);
    net.bind_params(params.data(), grads.data());
    memory::HostResource host;
    const int per = train::rows_per_micro_batch(b, kT, sh.length);
    const int mbs = (sh.rows + per - 1) / per;
    for (int done = 0; done < sh.rows;) {
      const int rows = std::min(per, sh.rows - done);
      Result<const plan::MemoryPlan*> p = shapes.get(rows, sh.length);
      EXPECT_TRUE(p.is_ok());
      auto arena = memory::Arena::create(&host, (*p)->step.buffers, (*p)->step.layout,
                                         memory::Category::kActivations);
      EXPECT_TRUE(arena.is_ok());
      net.bind_activations(&*arena, &(*p)->activations, rows, sh.length);
      const int32_t* i = in.data() + int64_t(done) * sh.length;
      const int32_t* t = tg.data() + int64_t(done) * sh.length;
      int64_t valid = 0;
      net.forward(i, t, &valid);
      net.backward(
          i, t,
          per_micro_batch_mean ? 1.0f / float(valid) / float(mbs) : 1.0f / float(sh.real_tokens));
      done += rows;
    }
    return grads;
  };
  auto rel = [](const std::vector<float>& a, const std::vector<float>& b) {
    double w = 0, s = 0;
    for (size_t i = 0; i < a.size(); i++) {
      w = std::max(w, double(std::fabs(a[i] - b[i])));
      s = std::max(s, double(std::fabs(b[i])));
    }
    return w / s;
  };
  const std::vector<float> g8 = gradients(G, false);
  EXPECT_LE(rel(gradients(2, false), g8), 1e-5);
  EXPECT_LE(rel(gradients(1, false), g8), 1e-5);
  EXPECT_GT(rel(gradients(1, true), g8), 1e-3);
}

// Memory: the step region is planned per micro-batch shape, each once; every micro-batch finds
// its plan in the cache; the measured peak of every step is the persistent regions plus the
// largest shape's step region (or the b x T one validation uses, whichever is larger).
TEST_F(Bucketing, PlansPerShapeAreCachedAndTheMeasuredPeakIsPlanned) {
  const int b = 2, k = 4;
  train::TrainOptions o = options(b, k);
  Run r = run(o);
  ASSERT_EQ(r.steps.size(), 4u);
  // The shapes that can occur, from the batcher over the same training range.
  Result<data::TokenFile> f = data::TokenFile::open(data_);
  ASSERT_TRUE(f.is_ok());
  const auto split = data::split_train_val(*f, o.val_fraction, kT + 1);
  Result<data::DocumentBatcher> db =
      data::DocumentBatcher::create(*f, split.first, kT, kBucket, int64_t(b) * k * kT, o.seed);
  ASSERT_TRUE(db.is_ok());
  const auto shapes = train::micro_batch_shapes(db->batch_shapes(), b, kT);
  EXPECT_GT(shapes.size(), 3u);
  EXPECT_EQ(r.result.shape_plans, shapes.size());
  uint64_t micro_batches = 0;
  for (const train::StepStats& s : r.steps) micro_batches += uint64_t(s.micro_batches);
  EXPECT_EQ(r.result.shape_plan_hits, micro_batches);
  // The planned peak, computed here from the plans of the shapes.
  plan::Policy policy{b, k, kT, "fp32", {}};
  Result<plan::MemoryPlan> full = plan::plan_training_memory(tiny(), policy);
  ASSERT_TRUE(full.is_ok());
  uint64_t largest = full->step_bytes;
  for (const auto& [rows, len] : shapes) {
    Result<plan::MemoryPlan> mp = shape_plan(policy, rows, len);
    ASSERT_TRUE(mp.is_ok());
    largest = std::max(largest, mp->step_bytes);
  }
  for (const train::StepStats& s : r.steps) {
    EXPECT_EQ(s.planned_peak_bytes, full->persistent_bytes + largest);
    EXPECT_EQ(s.device_bytes_peak, s.planned_peak_bytes) << "step " << s.step;
    EXPECT_GT(s.padding, 0.0);
    EXPECT_LT(s.padding, 0.5);
  }
  EXPECT_EQ(r.result.device_bytes_peak, r.result.planned_peak_bytes);
  EXPECT_GT(r.result.padding, 0.0);
}

// Activation offload with bucketed batching: every micro-batch shape's offloaded activations
// are laid out in turn inside one offload region, the largest shape's; the run is bit-identical
// to the same run without offload, and the offload tier's measured peak is that region.
TEST_F(Bucketing, ActivationOffloadTakesTheLargestShapesRegionAndChangesNoBit) {
  const int b = 2, k = 4;
  train::TrainOptions plain = options(b, k);
  plain.bucket = 12;  // rows of 12, 24 and 32 tokens: shapes of several sizes
  train::TrainOptions off = plain;
  off.exec.offload = {true, false};  // block 0 offloaded, block 1 kept
  off.offload_memory = uint64_t(1) << 30;
  Run r0 = run(plain), r1 = run(off);
  ASSERT_EQ(r0.steps.size(), 4u);
  ASSERT_EQ(r1.steps.size(), 4u);
  for (size_t i = 0; i < 4; i++) {
    EXPECT_EQ(std::bit_cast<uint64_t>(r1.steps[i].loss), std::bit_cast<uint64_t>(r0.steps[i].loss))
        << i;
    EXPECT_EQ(r1.steps[i].micro_batches, r0.steps[i].micro_batches) << i;
  }
  ASSERT_EQ(r0.params.size(), r1.params.size());
  EXPECT_EQ(std::memcmp(r0.params.data(), r1.params.data(), r0.params.size() * 4), 0);
  // The planned tier: the largest offloaded-activations region among the shapes that occur.
  Result<data::TokenFile> f = data::TokenFile::open(data_);
  ASSERT_TRUE(f.is_ok());
  const auto split = data::split_train_val(*f, off.val_fraction, kT + 1);
  Result<data::DocumentBatcher> db =
      data::DocumentBatcher::create(*f, split.first, kT, off.bucket, int64_t(b) * k * kT, off.seed);
  ASSERT_TRUE(db.is_ok());
  plan::Policy policy{b, k, kT, "fp32", {}};
  policy.exec.offload = off.exec.offload;
  Result<plan::MemoryPlan> full = plan::plan_training_memory(tiny(), policy);
  ASSERT_TRUE(full.is_ok());
  uint64_t largest = plan::offloaded_activation_bytes(*full), smallest = largest;
  for (const auto& [rows, len] : train::micro_batch_shapes(db->batch_shapes(), b, kT)) {
    Result<plan::MemoryPlan> mp = shape_plan(policy, rows, len);
    ASSERT_TRUE(mp.is_ok());
    largest = std::max(largest, plan::offloaded_activation_bytes(*mp));
    smallest = std::min(smallest, plan::offloaded_activation_bytes(*mp));
  }
  EXPECT_LT(smallest, largest);  // the shapes' regions differ: the views are exercised
  EXPECT_EQ(r1.result.planned_offload_bytes, largest);
  EXPECT_EQ(r1.result.offload_bytes_peak, largest);
  EXPECT_EQ(r0.result.planned_offload_bytes, 0u);
  EXPECT_EQ(r1.result.device_bytes_peak, r1.result.planned_peak_bytes);
}

TEST_F(Bucketing, ShapePlansAreComputedOnceEach) {
  train::ShapePlans shapes(tiny(), plan::Policy{4, 1, kT, "fp32", {}});
  Result<const plan::MemoryPlan*> a = shapes.get(8, 16);
  Result<const plan::MemoryPlan*> again = shapes.get(8, 16);
  Result<const plan::MemoryPlan*> other = shapes.get(4, 32);
  ASSERT_TRUE(a.is_ok() && again.is_ok() && other.is_ok());
  EXPECT_EQ(*a, *again);
  EXPECT_NE(*a, *other);
  EXPECT_EQ(shapes.misses(), 2u);
  EXPECT_EQ(shapes.hits(), 1u);
  EXPECT_EQ((*a)->policy.micro_batch, 8);
  EXPECT_EQ((*a)->policy.seq, 16);
  // Under a budget of 4 x 32 tokens: 16 rows of 8, 5 rows of 24 (and what is left of a step).
  EXPECT_EQ(train::rows_per_micro_batch(4, 32, 8), 16);
  EXPECT_EQ(train::rows_per_micro_batch(4, 32, 24), 5);
  EXPECT_EQ(train::rows_per_micro_batch(4, 32, 32), 4);
  const auto mb = train::micro_batch_shapes({{10, 24}, {3, 24}, {8, 32}}, 4, 32);
  const std::vector<std::pair<int, int>> want = {{3, 24}, {4, 32}, {5, 24}};
  EXPECT_EQ(mb, want);
}

// 4 steps straight and 2 + resume + 2 give bit-identical weights (the data position is the
// document stream's); resuming at another micro-batch of the same global batch continues the
// same documents, equal within rounding; another batching mode is refused.
TEST_F(Bucketing, ResumeContinuesTheDocumentStreamExactly) {
  train::TrainOptions o = options(2, 4);
  o.out_dir = (dir_ / "straight").string();
  Run straight = run(o);
  o.out_dir = (dir_ / "cut").string();
  o.save_every = 2;
  Run first = run(o, 2);
  ASSERT_EQ(first.steps.size(), 2u);
  train::TrainOptions resumed = o;
  resumed.resume = o.out_dir + "/checkpoints/step-000002";
  resumed.out_dir = (dir_ / "resumed").string();
  Run second = run(resumed);
  ASSERT_EQ(second.steps.size(), 2u);
  EXPECT_EQ(second.steps[0].loss, straight.steps[2].loss);
  EXPECT_EQ(second.steps[1].loss, straight.steps[3].loss);
  ASSERT_FALSE(straight.params.empty());
  EXPECT_EQ(second.params, straight.params) << "resume is not bit-identical";

  train::TrainOptions other_b = resumed;
  other_b.micro_batch = 8;
  other_b.accumulation = 1;
  other_b.out_dir = (dir_ / "other_b").string();
  Run third = run(other_b);
  ASSERT_EQ(third.steps.size(), 2u);
  EXPECT_EQ(third.steps[0].tokens, straight.steps[2].tokens);
  EXPECT_NEAR(third.steps[1].loss, straight.steps[3].loss, 1e-5 * straight.steps[3].loss);
  EXPECT_LE(max_abs(third.params, straight.params), 1e-4);

  train::TrainOptions packed = resumed;
  packed.batching = data::Batching::kPacked;
  Result<train::TrainResult> refused = train::run_training(packed, {});
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("--batching bucketed --bucket 8"), std::string::npos)
      << refused.status().message();
}

}  // namespace
}  // namespace headroom
