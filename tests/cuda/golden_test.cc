// The golden tests on the GPU: the transformer through the CUDA op table, its parameters,
// gradients, AdamW state and activations in device memory (the planner's step region at its
// offsets, NaN-filled first), against the same PyTorch references as tests/golden (GPT-2, Llama
// with GQA and RoPE, tied with Llama 3's rope scaling), in every execution variant, at the CPU
// golden test's tolerances (fp32 GEMMs without TF32). Skips, saying why, without a GPU.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "../golden/golden_fixture.h"
#include "backend/cuda/device_memory.h"
#include "cuda_test_util.h"
#include "memory/arena.h"
#include "model/weights.h"
#include "plan/memory_plan.h"
#include "train/optimizer.h"

namespace headroom {
namespace {

using golden::expect_close;
using golden::Fixture;
using golden::Variant;

class CudaGolden : public ::testing::TestWithParam<std::tuple<const char*, Variant>> {
 protected:
  const Variant& variant() const { return std::get<1>(GetParam()); }
  void SetUp() override {
    std::string why;
    ops_ = cudatest::ops_and_leaf(&leaf_, &why);
    if (ops_ == nullptr) GTEST_SKIP() << "no CUDA device: " << why;

    fx_ = std::make_unique<Fixture>(golden::load_fixture(std::get<0>(GetParam())));
    table_ = model::gpt2_param_table(fx_->config);
    const int64_t P = table_.total_floats;
    model::ExecOptions exec;
    exec.tiled_attention = variant().tiled;
    exec.head_chunk = variant().head_chunk;
    exec.recompute = variant().recompute;
    plan::Policy policy{fx_->B, 1, fx_->T, "fp32", exec};
    policy.ops = ops_;  // the device's row strides and scratch sizes
    Result<plan::MemoryPlan> mp = plan::plan_training_memory(fx_->config, policy);
    ASSERT_TRUE(mp.is_ok()) << mp.status().to_string();
    acts_ = mp->activations;
    const std::vector<memory::BufferDesc> state = {
        {"p", DType::kF32, Shape{P * 4}, memory::Category::kWeights},
        {"tokens", DType::kI32, Shape{int64_t(fx_->B) * fx_->T * 2}, memory::Category::kStaging}};
    auto s = memory::Arena::create(leaf_.get(), state, memory::sequential_layout(state),
                                   memory::Category::kWeights);
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    state_ = std::move(s).value();
    auto a = memory::Arena::create(leaf_.get(), acts_.buffers, mp->step.layout,
                                   memory::Category::kActivations);
    ASSERT_TRUE(a.is_ok()) << a.status().to_string();
    acts_arena_ = std::move(a).value();
    // NaN bytes: a read of memory that another buffer owns shows.
    ops_->fill_bytes(acts_arena_.base(), 0xff, acts_arena_.size());
    ops_->fill_bytes(state_.base(), 0, state_.size());
    params_ = state_.f32(0);
    grads_ = params_ + P;
    m_ = grads_ + P;
    v_ = m_ + P;
    std::vector<float> host(static_cast<size_t>(P), 0.0f);
    ASSERT_TRUE(model::load_weights(fx_->file.path(), table_, host.data()).is_ok());
    ops_->copy_to_device(params_, host.data(), host.size() * sizeof(float));
    const std::vector<int32_t> in = golden::ints(fx_->file, "input_ids");
    const std::vector<int32_t> tg = golden::ints(fx_->file, "targets");
    ASSERT_EQ(in.size(), size_t(fx_->B) * size_t(fx_->T));
    ASSERT_EQ(tg.size(), in.size());
    inputs_ = static_cast<int32_t*>(state_.data(1));
    targets_ = inputs_ + in.size();
    ops_->copy_to_device(inputs_, in.data(), in.size() * sizeof(int32_t));
    ops_->copy_to_device(targets_, tg.data(), tg.size() * sizeof(int32_t));
  }

  std::vector<float> download(const float* p, int64_t n) const {
    std::vector<float> h(static_cast<size_t>(n));
    ops_->copy_to_host(h.data(), p, h.size() * sizeof(float));
    return h;
  }

  const backend::Ops* ops_ = nullptr;
  std::unique_ptr<backend::cuda::CudaDeviceResource> leaf_;
  std::unique_ptr<Fixture> fx_;
  model::ParamTable table_;
  model::ActivationTable acts_;
  memory::Arena state_, acts_arena_;
  float *params_ = nullptr, *grads_ = nullptr, *m_ = nullptr, *v_ = nullptr;
  int32_t *inputs_ = nullptr, *targets_ = nullptr;
};

TEST_P(CudaGolden, LogitsLossAndEveryGradient) {
  model::Gpt2 net(fx_->config, &table_, *ops_);
  net.bind_params(params_, grads_);
  net.bind_activations(&acts_arena_, &acts_, fx_->B, fx_->T);
  int64_t valid = 0;
  const double sum = net.forward(inputs_, targets_, &valid);
  if (variant().head_chunk == 0) {
    const std::vector<float> ref = golden::tensor(fx_->file, "ref.logits");
    const int64_t V = fx_->config.vocab_size, ld = net.logits_row_stride();
    ASSERT_EQ(ref.size() % size_t(V), 0u);
    const int64_t rows = int64_t(ref.size()) / V;
    const std::vector<float> padded = download(net.logits(), rows * ld);
    std::vector<float> dense(ref.size());
    for (int64_t r = 0; r < rows; r++) {
      std::copy_n(padded.begin() + r * ld, V, dense.begin() + r * V);
    }
    expect_close(dense.data(), ref, 1e-5, 1e-5, "logits");
  }
  const double ref_loss = std::stod(fx_->file.metadata().at("ref.loss_f64"));
  EXPECT_NEAR(sum / double(valid), ref_loss, 1e-5);
  EXPECT_EQ(valid, fx_->B * fx_->T - 2);  // the fixture ignores two targets

  net.backward(inputs_, targets_, 1.0f / float(valid));
  const std::vector<float> grads = download(grads_, table_.total_floats);
  for (const model::ParamDesc& p : table_.params) {
    golden::expect_close(grads.data() + p.offset, golden::tensor(fx_->file, "grad." + p.name), 1e-7,
                         1e-4, "grad." + p.name);
  }
}

TEST_P(CudaGolden, FiveAdamWStepsWithClipping) {
  model::Gpt2 net(fx_->config, &table_, *ops_);
  net.bind_params(params_, grads_);
  net.bind_activations(&acts_arena_, &acts_, fx_->B, fx_->T);
  const train::AdamWConfig cfg = golden::adamw_config(*fx_);
  const std::vector<float> losses = golden::tensor(fx_->file, "adamw.losses");
  const std::vector<float> norms = golden::tensor(fx_->file, "adamw.grad_norms");
  for (int step = 0; step < 5; step++) {
    int64_t valid = 0;
    const double sum = net.forward(inputs_, targets_, &valid);
    EXPECT_NEAR(sum / double(valid), losses[size_t(step)], 2e-5) << "step " << step;
    net.backward(inputs_, targets_, 1.0f / float(valid));
    const double norm = train::adamw_step(table_, params_, grads_, m_, v_, cfg, cfg.lr, step + 1,
                                          nullptr, 0.0f, *ops_);
    EXPECT_NEAR(norm, norms[size_t(step)], 1e-4 * norms[size_t(step)]) << "step " << step;
    ops_->zero(grads_, table_.total_floats);
  }
  const std::vector<float> params = download(params_, table_.total_floats);
  for (const model::ParamDesc& p : table_.params) {
    golden::expect_close(params.data() + p.offset, golden::tensor(fx_->file, "final." + p.name),
                         2e-4, 0, "final." + p.name);
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, CudaGolden,
                         ::testing::Combine(::testing::ValuesIn(golden::kFixtures),
                                            ::testing::ValuesIn(golden::kVariants)),
                         [](const auto& info) { return golden::param_name(info); });

}  // namespace
}  // namespace headroom
