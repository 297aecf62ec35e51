// bf16 mixed precision changes the arithmetic (bf16 operands for the GEMMs), not the
// mathematics: one step's loss and gradients agree with fp32 to bf16 rounding, and training
// follows the fp32 loss curve. Tolerances are stated with their reasons below.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>

#include "backend/cpu/kernels.h"
#include "data/token_file.h"
#include "memory/host_resource.h"
#include "model/config.h"
#include "model/gpt2.h"
#include "plan/memory_plan.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

using train::test::compare;
using train::test::learnable_tokens;
using train::test::one_step;
using train::test::small_config;
using train::test::StepResult;

TEST(MixedPrecision, OneStepMatchesFp32ToBf16Rounding) {
  const model::Gpt2Config c = small_config();
  struct Variant {
    int head_chunk;
    model::Recompute rc;
  };
  for (Variant v :
       {Variant{0, model::Recompute::kNone}, Variant{16, model::Recompute::kNone},
        Variant{0, model::Recompute::kSelective}, Variant{16, model::Recompute::kFull}}) {
    SCOPED_TRACE(::testing::Message()
                 << "head_chunk " << v.head_chunk << " recompute " << model::recompute_name(v.rc));
    model::ExecOptions e;
    e.head_chunk = v.head_chunk;
    if (v.rc != model::Recompute::kNone) e.recompute.assign(size_t(c.n_layer), v.rc);
    StepResult f = one_step(c, e, 2, 48);
    e.precision = model::Precision::kBf16;
    StepResult h = one_step(c, e, 2, 48);
    // The loss is an average over tokens of fp32 log-softmax of logits from bf16 operands
    // (8 significant bits): its error is far below 1%.
    EXPECT_NEAR(h.loss, f.loss, 1e-2 * f.loss);
    auto [cos, rel] = compare(h.grads, f.grads);
    // Gradients pass through a few bf16 roundings per layer (relative 2^-8 each): they point
    // the same way (cosine > 0.999) and no entry is off by more than a few percent of the
    // largest gradient.
    EXPECT_GT(cos, 0.999);
    EXPECT_LT(rel, 0.05);
    // And bf16 is not secretly fp32: some difference must show.
    EXPECT_GT(rel, 0.0);
  }
}

// The weight gradients through transposed operands (cpu::Bf16WgradStaging, forced on every GEMM
// of this small model by HEADROOM_BF16_WGRAD_TRANSPOSE=1, off with 0): the plan gains the staging
// buffer only when it is used, the loss is the same bits (the forward does not change), and the
// gradients agree to GEMM rounding, with the full-logits head and the fused one. With a 4099-token
// vocabulary the full-logits head's dlogits^T goes through the staging in chunks (3072 rows, then
// 1027), read from the bf16 gradient's rows of stride 2 ld. The planned arena starts as NaN, so a
// transpose reading or writing outside its buffers would show.
TEST(MixedPrecision, TransposedWeightGradientsMatchTheStridedOnes) {
  const char* saved = std::getenv("HEADROOM_BF16_WGRAD_TRANSPOSE");
  for (auto [head_chunk, vocab] : {std::pair(0, 0), std::pair(16, 0), std::pair(0, 4099)}) {
    model::Gpt2Config c = small_config();
    if (vocab > 0) c.vocab_size = vocab;
    SCOPED_TRACE(::testing::Message() << "head_chunk " << head_chunk << " vocab " << c.vocab_size);
    model::ExecOptions e;
    e.head_chunk = head_chunk;
    e.precision = model::Precision::kBf16;
    setenv("HEADROOM_BF16_WGRAD_TRANSPOSE", "0", 1);
    EXPECT_EQ(model::gpt2_activation_table(c, 2, 48, true, e).ids.bf16_wgrad_staging, SIZE_MAX);
    StepResult strided = one_step(c, e, 2, 48);
    setenv("HEADROOM_BF16_WGRAD_TRANSPOSE", "1", 1);
    EXPECT_NE(model::gpt2_activation_table(c, 2, 48, true, e).ids.bf16_wgrad_staging, SIZE_MAX);
    StepResult transposed = one_step(c, e, 2, 48);
    ASSERT_EQ(transposed.grads.size(), strided.grads.size());
    EXPECT_EQ(transposed.loss, strided.loss);
    double worst = 0, scale = 0;
    for (size_t i = 0; i < strided.grads.size(); i++) {
      ASSERT_TRUE(std::isfinite(transposed.grads[i])) << i;
      worst = std::max(worst, double(std::fabs(transposed.grads[i] - strided.grads[i])));
      scale = std::max(scale, double(std::fabs(strided.grads[i])));
    }
    // Only the weight GEMMs' fp32 sums change order; every other gradient is the same bits.
    EXPECT_LE(worst, 1e-5 * scale);
    EXPECT_GT(scale, 0);
  }
  if (saved != nullptr) {
    setenv("HEADROOM_BF16_WGRAD_TRANSPOSE", saved, 1);
  } else {
    unsetenv("HEADROOM_BF16_WGRAD_TRANSPOSE");
  }
}

// bf16 recomputation is invisible like fp32's: the recomputed buffers are rounded the same way
// as the saved ones, so every recompute mode gives bit-identical gradients.
TEST(MixedPrecision, RecomputeIsBitIdenticalInBf16) {
  const model::Gpt2Config c = small_config();
  model::ExecOptions e;
  e.precision = model::Precision::kBf16;
  StepResult none = one_step(c, e, 2, 40);
  for (model::Recompute rc : {model::Recompute::kSelective, model::Recompute::kFull}) {
    e.recompute.assign(size_t(c.n_layer), rc);
    StepResult r = one_step(c, e, 2, 40);
    EXPECT_EQ(r.loss, none.loss) << model::recompute_name(rc);
    EXPECT_EQ(0, std::memcmp(r.grads.data(), none.grads.data(), r.grads.size() * 4))
        << model::recompute_name(rc);
  }
}

// Casting each block's weights just before use instead of keeping a bf16 copy gives the same
// bf16 values, so the same bits; the plan has no copy region but two step buffers.
TEST(MixedPrecision, CastingWeightsPerLayerEqualsTheCopy) {
  const model::Gpt2Config c = small_config();
  for (model::Recompute rc : {model::Recompute::kNone, model::Recompute::kFull}) {
    for (int head : {0, 16}) {
      model::ExecOptions e;
      e.precision = model::Precision::kBf16;
      e.head_chunk = head;
      if (rc != model::Recompute::kNone) e.recompute.assign(size_t(c.n_layer), rc);
      StepResult copy = one_step(c, e, 2, 40);
      e.bf16_weight_copy = false;
      StepResult cast = one_step(c, e, 2, 40);
      EXPECT_EQ(cast.loss, copy.loss);
      EXPECT_EQ(0, std::memcmp(cast.grads.data(), copy.grads.data(), cast.grads.size() * 4));
      if (head == 0) {
        // With the copy the head's forward computes the logits' padded columns too (rows of
        // the flat copy past wte; Note [The head's padded columns]); the per-layer cast
        // computes V. Same bits in columns [0, V) either way.
        EXPECT_EQ(copy.head_columns, int(cpu::logits_row_stride(c.vocab_size)));
        EXPECT_EQ(cast.head_columns, c.vocab_size);
        EXPECT_NE(c.vocab_size % 64, 0) << "the test needs a vocabulary with padded rows";
      }
    }
  }
  model::ExecOptions e;
  e.bf16_weight_copy = false;
  Result<plan::MemoryPlan> mp = plan::plan_training_memory(c, plan::Policy{2, 1, 40, "bf16", e});
  ASSERT_TRUE(mp.is_ok());
  EXPECT_EQ(mp->persistent.size(), plan::MemoryPlan::kBf16WeightsRegion);
  EXPECT_NE(mp->activations.ids.block_weights_bf16, SIZE_MAX);
  EXPECT_NE(mp->activations.ids.head_weights_bf16, SIZE_MAX);
}

TEST(MixedPrecision, PlanHoldsBf16ActivationsAndAWeightCopy) {
  const model::Gpt2Config c = small_config();
  model::ExecOptions e;
  Result<plan::MemoryPlan> f = plan::plan_training_memory(c, plan::Policy{4, 1, 64, "fp32", e});
  Result<plan::MemoryPlan> h = plan::plan_training_memory(c, plan::Policy{4, 1, 64, "bf16", e});
  ASSERT_TRUE(f.is_ok() && h.is_ok());
  EXPECT_EQ(h->policy.exec.precision, model::Precision::kBf16);
  ASSERT_EQ(h->persistent.size(), plan::MemoryPlan::kBf16WeightsRegion + 1);
  EXPECT_EQ(h->persistent[0].category, memory::Category::kMaster);
  EXPECT_EQ(h->persistent[plan::MemoryPlan::kBf16WeightsRegion].buffers[0].dtype, DType::kBF16);
  const auto& ids = h->activations.ids;
  EXPECT_EQ(h->activations.buffers[ids.fwd[0].qkv].dtype, DType::kBF16);
  EXPECT_EQ(h->activations.buffers[ids.fwd[0].residual2].dtype, DType::kF32);
  // Less activation memory: the GEMM-side activations are half the size.
  EXPECT_LT(double(h->step_lower_bound), 0.8 * double(f->step_lower_bound));
  // bf16 without tiled attention is refused with a clear message (fp16: tests/train/fp16_test.cc).
  e.tiled_attention = false;
  Result<plan::MemoryPlan> plain = plan::plan_training_memory(c, plan::Policy{4, 1, 64, "bf16", e});
  ASSERT_FALSE(plain.is_ok());
  EXPECT_NE(plain.status().message().find("tiled attention"), std::string::npos);
}

// The check: 50 steps of gpt2-tiny in bf16 follow the fp32 loss curve. gpt2-tiny's
// blocks (4 layers, 128 wide) with a 512-token vocabulary, so that the test takes seconds (the
// full vocabulary's LM head is 90% of its time); docs/notes/mixed-precision.md has the curves of
// the real gpt2-tiny on the fortunes corpus.
TEST(MixedPrecision, Bf16LossCurveFollowsFp32Over50Steps) {
  Result<model::Gpt2Config> cfg = model::resolve_model("gpt2-tiny");
  ASSERT_TRUE(cfg.is_ok());
  cfg->vocab_size = 512;
  const std::string data = learnable_tokens(cfg->vocab_size, 40000, "mixed");
  auto run = [&](model::Precision p) {
    const train::TrainOptions o = train::test::loss_curve_options(*cfg, data, p);
    std::vector<double> losses;
    train::TrainCallbacks cb;
    cb.on_step = [&](const train::StepStats& s) { losses.push_back(s.loss); };
    Result<train::TrainResult> r = train::run_training(o, cb);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    return losses;
  };
  const std::vector<double> f = run(model::Precision::kFp32), h = run(model::Precision::kBf16);

  ASSERT_EQ(f.size(), 50u);
  ASSERT_EQ(h.size(), 50u);
  // It learns: the loss falls well below its start (ln 512 = 6.2).
  EXPECT_LT(f.back(), f.front() - 1.5);
  // Same data in the same order: the curves coincide at every step (measured: within 1e-3;
  // bounded at 2%, since rounding differences can grow through training), and the mean over
  // the last 10 steps within 0.5%.
  double tail_f = 0, tail_h = 0;
  for (size_t i = 0; i < f.size(); i++) {
    EXPECT_NEAR(h[i], f[i], 0.02 * f[i]) << "step " << i + 1;
    if (i >= 40) {
      tail_f += f[i];
      tail_h += h[i];
    }
  }
  EXPECT_NEAR(tail_h, tail_f, 0.005 * tail_f);
  fs::remove(data);
}

}  // namespace
}  // namespace headroom
