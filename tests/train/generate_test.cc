// Generation with a KV cache (model/decode.h, train/generate.h, plan/generation_plan.h): each
// pass's logits equal the full forward's over the same history, the sliding window equals
// recomputing it, and the measured peak is the planned one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "memory/adaptors.h"
#include "memory/host_resource.h"
#include "model/decode.h"
#include "model/gpt2.h"
#include "plan/generation_plan.h"
#include "train/generate.h"
#include "train_test_util.h"

namespace headroom::train {
namespace {

std::vector<model::TransformerConfig> configs() {
  model::TransformerConfig gpt2 = test::tiny_config();
  model::TransformerConfig llama = test::llama_config(2, 64, 4, 2, 211, 32, false);
  model::TransformerConfig tied = test::llama_config(2, 64, 8, 4, 211, 32, true);
  // Attention n_head x head_dim wide, not n_embd (pruned heads; Note [Attention width]): the
  // cache holds head_dim per kv head, the output projection reads A columns.
  model::TransformerConfig narrow = gpt2;
  narrow.head_dim = 8;  // A = 32 < C = 64
  model::TransformerConfig wide = test::llama_config(2, 64, 4, 2, 211, 32, false);
  wide.head_dim = 24;  // A = 96 > C = 64
  return {gpt2, llama, tied, narrow, wide};
}

// Initial weights made larger, so that the logits depend clearly on every position.
std::vector<float> weights(const model::TransformerConfig& c, const model::ParamTable& t) {
  std::vector<float> p(size_t(t.total_floats));
  model::gpt2_init_params(c, t, p.data(), 7);
  for (float& x : p) x *= 4.0f;
  return p;
}

// The full forward (no cache) over tokens[0 .. n): the last row's logits.
struct FullForward {
  FullForward(const model::TransformerConfig& c, const model::ParamTable& t, const float* params)
      : c_(c),
        acts_(model::gpt2_activation_table(c, 1, c.n_positions, false, model::ExecOptions{})),
        net_(c, &t) {
    net_.bind_params(const_cast<float*>(params), nullptr);
    net_.bind_activations(&*arena_, &acts_, 1, c.n_positions);
  }
  std::vector<float> logits(const int32_t* tokens, int n) {
    net_.forward(tokens, nullptr, nullptr, n);
    const float* row = net_.logits() + int64_t(n - 1) * net_.logits_row_stride();
    return {row, row + c_.vocab_size};
  }
  model::TransformerConfig c_;
  memory::HostResource host_;
  model::ActivationTable acts_;
  Result<memory::Arena> arena_ =
      memory::Arena::create(&host_, acts_.buffers, memory::sequential_layout(acts_.buffers),
                            memory::Category::kActivations);
  model::Gpt2 net_;
};

TEST(Generation, KvCacheLogitsEqualTheFullForward) {
  for (const model::TransformerConfig& c : configs()) {
    SCOPED_TRACE(c.model_type + " kv heads " + std::to_string(c.kv_heads()));
    const model::ParamTable t = model::gpt2_param_table(c);
    const std::vector<float> p = weights(c, t);
    std::mt19937 rng(3);
    std::vector<int32_t> tokens(size_t(c.n_positions));
    for (int32_t& x : tokens) x = int32_t(rng() % uint32_t(c.vocab_size));
    FullForward full(c, t, p.data());

    const int prompt = 5;
    const model::DecodeTable d = model::decode_table(c, c.n_positions, prompt);
    memory::HostResource host;
    Result<memory::Arena> cache = memory::Arena::create(
        &host, d.cache, memory::sequential_layout(d.cache), memory::Category::kKvCache);
    Result<memory::Arena> work = memory::Arena::create(
        &host, d.work, memory::sequential_layout(d.work), memory::Category::kActivations);
    ASSERT_TRUE(cache.is_ok() && work.is_ok());
    model::Decoder dec(c, &t, p.data(), &d, &*cache, &*work);
    // NaN in the cache beyond what was written would show in the attention over it.
    std::fill(cache->f32(0), cache->f32(0) + d.cache[0].shape.numel(), NAN);
    std::fill(cache->f32(1), cache->f32(1) + d.cache[1].shape.numel(), NAN);

    const float* got = dec.prefill(tokens.data(), prompt);
    double spread = 0;
    std::vector<float> first;
    for (int n = prompt; n <= c.n_positions; n++) {
      const std::vector<float> want = full.logits(tokens.data(), n);
      double err = 0, scale = 0;
      for (int v = 0; v < c.vocab_size; v++) {
        err = std::max(err, double(std::abs(got[v] - want[size_t(v)])));
        scale = std::max(scale, double(std::abs(want[size_t(v)])));
      }
      EXPECT_LE(err, 2e-5 * std::max(1.0, scale)) << "history " << n;
      if (first.empty()) first = want;
      for (int v = 0; v < c.vocab_size; v++) {
        spread = std::max(spread, double(std::abs(want[size_t(v)] - first[size_t(v)])));
      }
      EXPECT_EQ(dec.position(), n);
      if (n < c.n_positions) got = dec.step(tokens[size_t(n)]);
    }
    // The test means something: the logits move by far more than the tolerance with the history.
    EXPECT_GT(spread, 0.1);
  }
}

// What sample_tokens did before the cache: the full forward over the window's last tokens for
// every new token, greedy.
std::vector<int32_t> greedy_by_recomputing(const model::TransformerConfig& c, const float* params,
                                           std::vector<int32_t> tokens, int new_tokens,
                                           int window = 0) {
  const model::ParamTable t = model::gpt2_param_table(c);
  FullForward full(c, t, params);
  std::vector<int32_t> out;
  for (int i = 0; i < new_tokens; i++) {
    const int len = std::min<int>(int(tokens.size()), window > 0 ? window : c.n_positions);
    const std::vector<float> l = full.logits(tokens.data() + tokens.size() - size_t(len), len);
    const int32_t next = int32_t(std::max_element(l.begin(), l.end()) - l.begin());
    tokens.push_back(next);
    out.push_back(next);
  }
  return out;
}

TEST(Generation, SlidingWindowEqualsRecomputingTheWindowAndMeasuredPeakIsPlanned) {
  for (model::TransformerConfig c : configs()) {
    SCOPED_TRACE(c.model_type);
    c.n_positions = 12;
    const model::ParamTable t = model::gpt2_param_table(c);
    const std::vector<float> p = weights(c, t);
    const std::vector<int32_t> prompt = {5, 17, 3, 99};
    // Within the window (4 + 6 <= 12), and past it (4 + 30: the window slides 22 times).
    for (int new_tokens : {6, 30}) {
      SampleOptions o;
      o.max_new_tokens = new_tokens;
      o.temperature = 0;
      memory::HostResource upstream;
      memory::TrackingResource host(&upstream);
      Result<std::vector<int32_t>> got = sample_tokens(c, p.data(), prompt, o, &host);
      ASSERT_TRUE(got.is_ok()) << got.status().to_string();
      EXPECT_EQ(*got, greedy_by_recomputing(c, p.data(), prompt, new_tokens)) << new_tokens;
      const plan::GenerationPlan gp = plan::plan_generation(c, int(prompt.size()), new_tokens);
      EXPECT_EQ(gp.shape.context, std::min(12, 4 + new_tokens));
      EXPECT_EQ(gp.shape.rows, new_tokens == 6 ? 4 : 12);
      // The weights are the caller's here: the plan's peak less them.
      EXPECT_EQ(host.stats().peak, gp.peak_bytes - gp.weights_bytes) << new_tokens;
      EXPECT_EQ(host.stats().by_category[size_t(memory::Category::kKvCache)].peak,
                gp.by_category[size_t(memory::Category::kKvCache)]);
      EXPECT_EQ(gp.table.cache_bytes(),
                2ull * 4 * c.n_layer * c.kv_heads() * gp.shape.context * c.head_size());
    }
  }
}

// A window below n_positions (train's sample: the positions the run trained) slides as
// n_positions does, and plans no more cache than it.
TEST(Generation, AShorterWindowSlidesWithinIt) {
  for (model::TransformerConfig c : configs()) {
    SCOPED_TRACE(c.model_type);
    c.n_positions = 12;
    const model::ParamTable t = model::gpt2_param_table(c);
    const std::vector<float> p = weights(c, t);
    const std::vector<int32_t> prompt = {5, 17, 3, 99, 8, 8, 1, 40, 2, 7};  // longer than 8
    SampleOptions o;
    o.max_new_tokens = 20;
    o.temperature = 0;
    o.window = 8;
    memory::HostResource upstream;
    memory::TrackingResource host(&upstream);
    Result<std::vector<int32_t>> got = sample_tokens(c, p.data(), prompt, o, &host);
    ASSERT_TRUE(got.is_ok()) << got.status().to_string();
    EXPECT_EQ(*got, greedy_by_recomputing(c, p.data(), prompt, 20, 8));
    EXPECT_NE(*got, greedy_by_recomputing(c, p.data(), prompt, 20)) << "the window matters here";
    const plan::GenerationPlan gp = plan::plan_generation(c, 8, 20, 8);
    EXPECT_EQ(gp.shape.context, 8);
    EXPECT_EQ(host.stats().peak, gp.peak_bytes - gp.weights_bytes);
  }
}

}  // namespace
}  // namespace headroom::train
