// Golden test: the engine's transformer against the PyTorch references (tools/reference/), on
// the committed fixtures (GPT-2; Llama with grouped-query attention and RoPE, untied and tied
// with Llama 3's rope scaling): logits, loss, every parameter gradient, and five AdamW steps
// with clipping, in every execution variant.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu/kernels.h"
#include "golden_fixture.h"
#include "memory/arena.h"
#include "memory/host_resource.h"
#include "model/config.h"
#include "model/gpt2.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "plan/memory_plan.h"
#include "train/optimizer.h"

namespace headroom {
namespace {

using golden::expect_close;
using golden::Fixture;
using golden::ints;
using golden::kFixtures;
using golden::kVariants;
using golden::load_fixture;
using golden::tensor;
using golden::Variant;

class Golden : public ::testing::TestWithParam<std::tuple<const char*, Variant>> {
 protected:
  const Variant& variant() const { return std::get<1>(GetParam()); }
  void SetUp() override {
    fx_ = std::make_unique<Fixture>(load_fixture(std::get<0>(GetParam())));
    table_ = model::gpt2_param_table(fx_->config);
    model::ExecOptions exec;
    exec.tiled_attention = variant().tiled;
    exec.head_chunk = variant().head_chunk;
    exec.recompute = variant().recompute;
    // The step region at the planner's offsets (buffers share memory), poisoned with NaN bytes
    // so a read of memory that another buffer owns shows.
    plan::Policy policy{fx_->B, 1, fx_->T, "fp32", exec};
    Result<plan::MemoryPlan> mp = plan::plan_training_memory(fx_->config, policy);
    ASSERT_TRUE(mp.is_ok()) << mp.status().to_string();
    acts_ = mp->activations;
    auto p = memory::Arena::create(
        &host_, {{"p", DType::kF32, Shape{table_.total_floats * 4}, memory::Category::kWeights}},
        memory::sequential_layout(
            {{"p", DType::kF32, Shape{table_.total_floats * 4}, memory::Category::kWeights}}),
        memory::Category::kWeights);
    ASSERT_TRUE(p.is_ok());
    state_ = std::move(p).value();
    auto a = memory::Arena::create(&host_, acts_.buffers, mp->step.layout,
                                   memory::Category::kActivations);
    ASSERT_TRUE(a.is_ok());
    acts_arena_ = std::move(a).value();
    std::memset(acts_arena_.base(), 0xff, acts_arena_.size());
    params_ = state_.f32(0);
    grads_ = params_ + table_.total_floats;
    m_ = grads_ + table_.total_floats;
    v_ = m_ + table_.total_floats;
    cpu::zero(params_, table_.total_floats * 4);
    ASSERT_TRUE(model::load_weights(fx_->file.path(), table_, params_).is_ok());
    inputs_ = ints(fx_->file, "input_ids");
    targets_ = ints(fx_->file, "targets");
  }

  std::unique_ptr<Fixture> fx_;
  memory::HostResource host_;
  model::ParamTable table_;
  model::ActivationTable acts_;
  memory::Arena state_, acts_arena_;
  float *params_ = nullptr, *grads_ = nullptr, *m_ = nullptr, *v_ = nullptr;
  std::vector<int32_t> inputs_, targets_;
};

TEST_P(Golden, LogitsLossAndEveryGradient) {
  model::Gpt2 net(fx_->config, &table_);
  net.bind_params(params_, grads_);
  net.bind_activations(&acts_arena_, &acts_, fx_->B, fx_->T);
  int64_t valid = 0;
  double sum = net.forward(inputs_.data(), targets_.data(), &valid);
  // fp32 forward against the float64 reference: rounding of a 2-layer net stays near 1e-6
  // relative; 1e-5 absolute on logits of magnitude ~1 leaves room without hiding a bug. (The
  // fused head never holds the logits; its loss is checked below.)
  if (variant().head_chunk == 0) {
    // The logits' rows are padded (logits_row_stride); the reference is dense.
    const std::vector<float> ref = tensor(fx_->file, "ref.logits");
    const int64_t V = fx_->config.vocab_size, ld = net.logits_row_stride();
    ASSERT_EQ(ref.size() % size_t(V), 0u);
    std::vector<float> dense(ref.size());
    for (size_t r = 0; r < ref.size() / size_t(V); r++) {
      std::copy_n(net.logits() + int64_t(r) * ld, V, dense.begin() + int64_t(r) * V);
    }
    expect_close(dense.data(), ref, 1e-5, 1e-5, "logits");
  }
  const double ref_loss = std::stod(fx_->file.metadata().at("ref.loss_f64"));
  EXPECT_NEAR(sum / double(valid), ref_loss, 1e-5);
  EXPECT_EQ(valid, fx_->B * fx_->T - 2);  // the fixture ignores two targets

  net.backward(inputs_.data(), targets_.data(), 1.0f / float(valid));
  for (const model::ParamDesc& p : table_.params) {
    // Gradients accumulate many fp32 products; 1e-4 of the tensor's largest entry covers the
    // rounding of sums over B*T*C terms.
    expect_close(grads_ + p.offset, tensor(fx_->file, "grad." + p.name), 1e-7, 1e-4,
                 "grad." + p.name);
  }
}

TEST_P(Golden, FiveAdamWStepsWithClipping) {
  model::Gpt2 net(fx_->config, &table_);
  net.bind_params(params_, grads_);
  net.bind_activations(&acts_arena_, &acts_, fx_->B, fx_->T);
  const train::AdamWConfig cfg = golden::adamw_config(*fx_);
  const std::vector<float> losses = tensor(fx_->file, "adamw.losses");
  const std::vector<float> norms = tensor(fx_->file, "adamw.grad_norms");
  for (int step = 0; step < 5; step++) {
    int64_t valid = 0;
    double sum = net.forward(inputs_.data(), targets_.data(), &valid);
    EXPECT_NEAR(sum / double(valid), losses[size_t(step)], 2e-5) << "step " << step;
    net.backward(inputs_.data(), targets_.data(), 1.0f / float(valid));
    double norm = train::adamw_step(table_, params_, grads_, m_, v_, cfg, cfg.lr, step + 1);
    EXPECT_NEAR(norm, norms[size_t(step)], 1e-4 * norms[size_t(step)]) << "step " << step;
    cpu::zero(grads_, table_.total_floats);
  }
  for (const model::ParamDesc& p : table_.params) {
    // Adam divides by sqrt(v): entries whose gradient is at rounding level can move by up to lr
    // per step in either implementation, so compare at a fraction of lr (1e-3).
    expect_close(params_ + p.offset, tensor(fx_->file, "final." + p.name), 2e-4, 0,
                 "final." + p.name);
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, Golden,
                         ::testing::Combine(::testing::ValuesIn(kFixtures),
                                            ::testing::ValuesIn(kVariants)),
                         [](const auto& info) { return golden::param_name(info); });

}  // namespace
}  // namespace headroom
