// `train --model DIR` with weights in DIR starts from them (TrainOptions::init_from), as
// from_pretrained does: a run from a saved model begins at the validation loss it ended at; a
// directory of another shape is refused naming the tensor; a config.json alone starts from the
// seed.
#include <gtest/gtest.h>

#include <filesystem>

#include "train/run_request.h"
#include "train_test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

class InitFrom : public train::test::RandomTokensTest {
 protected:
  train::TrainOptions options() {
    train::TrainOptions o;
    o.config = train::test::tiny_config();
    o.model_name = "tiny";
    o.data = data_;
    o.seq = 16;
    o.micro_batch = 4;
    o.steps = 8;
    o.warmup_steps = 2;
    o.device_memory = uint64_t(1) << 30;
    o.val_fraction = 0.1;
    o.eval_at_start = true;
    return o;
  }
};

TEST_F(InitFrom, StartsAtTheLossTheSavedModelEndedAt) {
  train::TrainOptions a = options();
  a.out_dir = (dir_ / "a").string();
  train::test::RunOutput first = train::test::run_collecting(a);
  ASSERT_TRUE(first.result.is_ok()) << first.result.status().to_string();
  ASSERT_TRUE(first.result->final_val_loss && first.result->initial_val_loss);

  train::TrainOptions b = options();
  b.init_from = a.out_dir;
  b.steps = 2;
  train::test::RunOutput second = train::test::run_collecting(b);
  ASSERT_TRUE(second.result.is_ok()) << second.result.status().to_string();
  // The same validation windows on the same weights: the same loss, to the bit.
  EXPECT_EQ(*second.result->initial_val_loss, *first.result->final_val_loss);
  EXPECT_NE(*second.result->initial_val_loss, *first.result->initial_val_loss);

  // Another shape: refused, naming what does not match.
  train::TrainOptions c = options();
  c.config.n_embd = 32;
  c.init_from = a.out_dir;
  train::test::RunOutput wrong = train::test::run_collecting(c);
  ASSERT_FALSE(wrong.result.is_ok());
  EXPECT_NE(wrong.result.status().message().find("shape"), std::string::npos)
      << wrong.result.status().message();
}

TEST_F(InitFrom, ModelDirectoryWithWeightsIsAFineTuneAndAConfigFileIsNot) {
  train::TrainOptions a = options();
  a.out_dir = (dir_ / "saved").string();
  a.steps = 2;
  ASSERT_TRUE(train::test::run_collecting(a).result.is_ok());
  train::RunRequest r;
  r.model = a.out_dir;
  r.data = data_;
  r.seq = 16;
  r.micro_batch = 4;
  r.steps = 2;
  r.device_memory = uint64_t(1) << 30;
  r.quiet = true;
  Result<train::ResolvedRun> run = train::resolve_run(r);
  ASSERT_TRUE(run.is_ok()) << run.status().message();
  EXPECT_EQ(run->options.init_from, a.out_dir);
  r.model = a.out_dir + "/config.json";
  run = train::resolve_run(r);
  ASSERT_TRUE(run.is_ok()) << run.status().message();
  EXPECT_TRUE(run->options.init_from.empty());
}

}  // namespace
}  // namespace headroom
