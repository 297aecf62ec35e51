// Principle 2 (DESIGN.md): the effective batch is invariant. Splitting an optimizer step's
// sequences into more, smaller micro-batches changes nothing but rounding, because the loss is
// normalised by the valid tokens of the whole step, not per micro-batch.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>

#include "data/token_file.h"
#include "memory/host_resource.h"
#include "model/gpt2.h"
#include "plan/memory_plan.h"
#include "train/trainer.h"

namespace headroom {
namespace {

model::Gpt2Config tiny() {
  model::Gpt2Config c;
  c.n_layer = 2;
  c.n_embd = 64;
  c.n_head = 4;
  c.vocab_size = 211;
  c.n_positions = 32;
  return c;
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < a.size(); i++) {
    worst = std::max(worst, double(std::fabs(a[i] - b[i])));
    scale = std::max(scale, double(std::fabs(b[i])));
  }
  return worst / scale;
}

// Gradients of one optimizer step over 8 sequences of unequal length (ignored targets pad the
// short ones), run as micro-batches of `b`. `per_micro_batch_mean` reproduces the common bug
// (mean loss per micro-batch, then averaged over micro-batches) to show the test can tell.
std::vector<float> step_gradients(int b, bool per_micro_batch_mean) {
  const model::Gpt2Config c = tiny();
  const int S = 8, T = 16;
  std::mt19937 rng(11);
  std::vector<int32_t> in(S * T), tg(S * T);
  for (int s = 0; s < S; s++) {
    const int len = 2 + (s * 5) % T;  // 2..16 real tokens: documents of unequal length
    for (int t = 0; t < T; t++) {
      in[size_t(s * T + t)] = int32_t(rng() % uint32_t(c.vocab_size));
      tg[size_t(s * T + t)] = t < len ? int32_t(rng() % uint32_t(c.vocab_size)) : -1;
    }
  }
  int64_t step_valid = 0;
  for (int32_t t : tg) step_valid += t >= 0;

  memory::HostResource host;
  Result<plan::MemoryPlan> mp =
      plan::plan_training_memory(c, plan::Policy{b, S / b, T, "fp32", {}});
  EXPECT_TRUE(mp.is_ok());
  const model::ParamTable& table = mp->params;
  std::vector<float> params(size_t(table.total_floats)), grads(size_t(table.total_floats), 0.0f);
  model::gpt2_init_params(c, table, params.data(), 5);
  auto arena = memory::Arena::create(&host, mp->step.buffers, mp->step.layout,
                                     memory::Category::kActivations);
  EXPECT_TRUE(arena.is_ok());
  model::Gpt2 net(c, &table);
  net.bind_params(params.data(), grads.data());
  net.bind_activations(&*arena, &mp->activations, b, T);
  for (int k = 0; k < S / b; k++) {
    const int32_t* i = in.data() + k * b * T;
    const int32_t* t = tg.data() + k * b * T;
    int64_t valid = 0;
    net.forward(i, t, &valid);
    const float dloss =
        per_micro_batch_mean ? 1.0f / float(valid) / float(S / b) : 1.0f / float(step_valid);
    net.backward(i, t, dloss);
  }
  return grads;
}

TEST(Accumulation, MicroBatchSplitsGiveTheSameGradients) {
  const std::vector<float> g8 = step_gradients(8, false);
  // Different GEMM shapes round differently; 1e-5 of the largest gradient is far below any
  // normalisation error (see the next check).
  EXPECT_LE(max_rel_diff(step_gradients(2, false), g8), 1e-5);
  EXPECT_LE(max_rel_diff(step_gradients(1, false), g8), 1e-5);
  // Averaging per micro-batch weights the short documents wrongly: a visible difference.
  EXPECT_GT(max_rel_diff(step_gradients(1, true), g8), 1e-2);
}

std::string token_file(int vocab) {
  std::string path =
      (std::filesystem::path(testing::TempDir()) / ("accum_" + std::to_string(getpid()) + ".tok"))
          .string();
  std::mt19937 rng(3);
  std::vector<int32_t> toks(20000);
  for (auto& t : toks) t = int32_t(rng() % uint32_t(vocab - 1));
  EXPECT_TRUE(data::write_token_file(path, toks, vocab, vocab - 1, 1).is_ok());
  return path;
}

// Through the trainer: three optimizer steps with 8 sequences each, as 8x1, 2x4 and 1x8.
TEST(Accumulation, TrainerStepsAreInvariant) {
  const std::string data = token_file(tiny().vocab_size);
  auto run = [&](int b, int k, std::vector<double>* losses) {
    train::TrainOptions o;
    o.config = tiny();
    o.model_name = "tiny";
    o.data = data;
    o.seq = 16;
    o.micro_batch = b;
    o.accumulation = k;
    o.steps = 3;
    o.warmup_steps = 1;
    o.device_memory = uint64_t(1) << 30;
    o.val_fraction = 0;
    std::vector<float> final_params;
    train::TrainCallbacks cb;
    cb.on_step = [&](const train::StepStats& s) { losses->push_back(s.loss); };
    cb.on_finish = [&](const model::Gpt2Config&, const float* p, memory::MemoryResource*) {
      final_params.assign(p, p + model::gpt2_param_table(o.config).total_floats);
      return Status::ok();
    };
    Result<train::TrainResult> r = train::run_training(o, cb);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    return final_params;
  };
  std::vector<double> l81, l24, l18;
  std::vector<float> p81 = run(8, 1, &l81), p24 = run(2, 4, &l24), p18 = run(1, 8, &l18);
  ASSERT_EQ(l81.size(), 3u);
  for (size_t i = 0; i < 3; i++) {
    EXPECT_NEAR(l24[i], l81[i], 1e-5 * l81[i]);
    EXPECT_NEAR(l18[i], l81[i], 1e-5 * l81[i]);
  }
  // AdamW normalises each update, so rounding-level gradient differences can move a weight by
  // up to lr (1e-3) only where a gradient is itself at rounding level; 1e-4 absolute allows that
  // for a handful of entries and still catches a wrong normalisation (which moves all of them).
  auto max_abs = [](const std::vector<float>& a, const std::vector<float>& b) {
    double w = 0;
    for (size_t i = 0; i < a.size(); i++) w = std::max(w, double(std::fabs(a[i] - b[i])));
    return w;
  };
  EXPECT_LE(max_abs(p24, p81), 1e-4);
  EXPECT_LE(max_abs(p18, p81), 1e-4);
  std::filesystem::remove(data);
}

}  // namespace
}  // namespace headroom
