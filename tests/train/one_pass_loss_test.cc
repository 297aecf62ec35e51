// Note [One-pass loss and gradient] (docs/notes/loss.md): a training step tells the model its loss
// gradient before the forward (Gpt2::set_next_dloss), and the forward turns the logits into their
// gradient in the same pass as the loss. Every loss and every gradient must be the same bits as
// the two-pass path (forward, then backward), in each precision, with ignored targets, gradient
// accumulation, fp16 loss scaling and 1 or 2 threads; and the model must fall back to the two
// passes wherever it was not told.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/kernels.h"
#include "core/check.h"
#include "memory/host_resource.h"
#include "model/gpt2.h"
#include "plan/memory_plan.h"
#include "train_test_util.h"

namespace headroom {
namespace {

using train::test::small_config;

struct StepRun {
  std::vector<double> losses;  // each micro-batch's summed loss
  std::vector<float> grads;    // accumulated over the micro-batches, as scaled (not unscaled)
};

// One optimizer step of K micro-batches of B x T tokens (about one target in 9 ignored), from a
// planned arena poisoned with NaN bytes, with dloss = scale / (valid tokens of the whole step).
// one_pass: the model is told dloss before each forward.
StepRun run_step(const model::Gpt2Config& c, model::ExecOptions exec, int B, int T, int K,
                 float scale, bool one_pass) {
  StepRun r;
  std::unique_ptr<train::test::PlannedModel> m =
      train::test::make_planned_model(c, exec, B, K, T, 21);
  if (!m) return r;
  model::Gpt2& net = *m->net;
  std::mt19937 rng(7);
  const int S = B * K;
  std::vector<int32_t> in(size_t(S * T)), tg(size_t(S * T));
  int64_t step_valid = 0;
  for (int i = 0; i < S * T; i++) {
    in[size_t(i)] = int32_t(rng() % uint32_t(c.vocab_size));
    tg[size_t(i)] = rng() % 9 == 0 ? -1 : int32_t(rng() % uint32_t(c.vocab_size));
    step_valid += tg[size_t(i)] >= 0;
  }
  const float dloss = scale / float(step_valid);
  for (int k = 0; k < K; k++) {
    m->bind(B, T);
    const int32_t* i = in.data() + int64_t(k) * B * T;
    const int32_t* g = tg.data() + int64_t(k) * B * T;
    if (one_pass) net.set_next_dloss(dloss);
    r.losses.push_back(net.forward(i, g));
    net.backward(i, g, dloss);
  }
  r.grads = m->grads;
  return r;
}

TEST(OnePassLoss, LossesAndGradientsAreTheTwoPassBits) {
  const model::Gpt2Config c = small_config();  // V = 300: padded logits rows (ld 320)
  const int saved = omp_get_max_threads();
  struct Variant {
    model::Precision precision;
    int accumulation;
    float scale;  // fp16's loss scale (a power of two), 1 otherwise
    int head_chunk;
    bool pad_rows;
  };
  for (Variant v : {Variant{model::Precision::kFp32, 1, 1.0f, 0, true},
                    Variant{model::Precision::kFp32, 3, 1.0f, 0, false},
                    Variant{model::Precision::kBf16, 3, 1.0f, 0, true},
                    Variant{model::Precision::kBf16, 2, 1.0f, 0, false},
                    Variant{model::Precision::kFp16, 3, 65536.0f, 0, true},
                    Variant{model::Precision::kBf16, 2, 1.0f, 16, true}}) {  // fused: no effect
    for (int threads : {1, 2}) {
      SCOPED_TRACE(::testing::Message()
                   << model::precision_name(v.precision) << " accumulation " << v.accumulation
                   << " scale " << v.scale << " head_chunk " << v.head_chunk << " pad_rows "
                   << v.pad_rows << " threads " << threads);
      omp_set_num_threads(threads);
      model::ExecOptions e;
      e.precision = v.precision;
      e.head_chunk = v.head_chunk;
      e.pad_rows = v.pad_rows;
      const StepRun two = run_step(c, e, 2, 24, v.accumulation, v.scale, false);
      const StepRun one = run_step(c, e, 2, 24, v.accumulation, v.scale, true);
      ASSERT_EQ(one.losses.size(), two.losses.size());
      for (size_t k = 0; k < one.losses.size(); k++) {
        EXPECT_EQ(one.losses[k], two.losses[k]) << "micro-batch " << k;  // exact
        EXPECT_TRUE(std::isfinite(one.losses[k]) && one.losses[k] > 0.0);
      }
      ASSERT_EQ(one.grads.size(), two.grads.size());
      EXPECT_EQ(0, std::memcmp(one.grads.data(), two.grads.data(), one.grads.size() * 4))
          << "gradients differ in their bits";
      double norm = 0;
      for (float g : one.grads) norm += double(g) * g;
      EXPECT_GT(norm, 0.0);
      EXPECT_TRUE(std::isfinite(norm));
    }
  }
  omp_set_num_threads(saved);
}

// set_next_dloss holds for one forward: an evaluation forward after a one-pass step keeps its
// logits (the same as a fresh model's), and a generation forward (no targets) after
// set_next_dloss keeps them too.
TEST(OnePassLoss, OnlyTheNextForwardIsOnePass) {
  const model::Gpt2Config c = small_config();
  const int B = 2, T = 16;
  for (model::Precision p : {model::Precision::kFp32, model::Precision::kBf16}) {
    SCOPED_TRACE(std::string(model::precision_name(p)));
    model::ExecOptions e;
    e.precision = p;
    std::unique_ptr<train::test::PlannedModel> m =
        train::test::make_planned_model(c, e, B, 1, T, 4);
    ASSERT_NE(m, nullptr);
    m->bind(B, T);
    model::Gpt2& net = *m->net;
    std::vector<int32_t> in(size_t(B * T)), tg(size_t(B * T));
    for (int i = 0; i < B * T; i++) {
      in[size_t(i)] = (i * 7 + 3) % c.vocab_size;
      tg[size_t(i)] = (i * 13 + 1) % c.vocab_size;
    }
    const int64_t ld = net.logits_row_stride();
    auto logits_now = [&] {
      std::vector<float> l;
      for (int r = 0; r < B * T; r++) {
        const float* row = net.logits() + r * ld;
        l.insert(l.end(), row, row + c.vocab_size);
      }
      return l;
    };
    const double eval_loss = net.forward(in.data(), tg.data());
    const std::vector<float> want = logits_now();
    // A one-pass training step: the logits' memory holds their gradient afterwards.
    net.set_next_dloss(0.5f);
    EXPECT_EQ(net.forward(in.data(), tg.data()), eval_loss);
    EXPECT_NE(logits_now(), want) << "the one-pass forward wrote the gradient";
    net.backward(in.data(), tg.data(), 0.5f);
    // Evaluation after it: logits again, and the same loss.
    EXPECT_EQ(net.forward(in.data(), tg.data()), eval_loss);
    EXPECT_EQ(logits_now(), want);
    // Generation after set_next_dloss: no targets, logits kept; the next forward is two-pass.
    net.set_next_dloss(0.5f);
    EXPECT_EQ(net.forward(in.data(), nullptr), 0.0);
    EXPECT_EQ(logits_now(), want);
    EXPECT_EQ(net.forward(in.data(), tg.data()), eval_loss);
    EXPECT_EQ(logits_now(), want);
  }
}

// A one-pass forward with dloss 0.25, then a backward given 0.5.
void backward_with_another_dloss() {
  const model::Gpt2Config c = small_config();
  std::unique_ptr<train::test::PlannedModel> m =
      train::test::make_planned_model(c, model::ExecOptions{}, 1, 1, 8, 4);
  HR_CHECK(m != nullptr);
  m->bind(1, 8);
  model::Gpt2& net = *m->net;
  std::vector<int32_t> in(8, 1), tg(8, 2);
  net.set_next_dloss(0.25f);
  net.forward(in.data(), tg.data());
  net.backward(in.data(), tg.data(), 0.5f);
}

// The backward checks that it is given the dloss the forward computed the gradient with.
TEST(OnePassLossDeathTest, BackwardWithAnotherDlossStops) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(backward_with_another_dloss(), "dloss differs from the one given to set_next_dloss");
}

}  // namespace
}  // namespace headroom
