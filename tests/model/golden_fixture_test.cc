// Checks the committed golden fixture (tests/golden/fixtures/, written by
// tools/reference/gpt2_reference.py) is complete and self-consistent, so that the model-vs-PyTorch
// tests that read it fail on a model bug and never on a stale or broken fixture.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/safetensors.h"

namespace headroom::model {
namespace {

const std::string kFixtureDir = std::string(HEADROOM_SOURCE_DIR) + "/tests/golden/fixtures/";

int64_t meta_int(const SafetensorsFile& f, const std::string& key) {
  auto it = f.metadata().find(key);
  EXPECT_NE(it, f.metadata().end()) << "metadata lacks '" << key << "'";
  return it == f.metadata().end() ? -1 : std::stoll(it->second);
}

double meta_double(const SafetensorsFile& f, const std::string& key) {
  auto it = f.metadata().find(key);
  EXPECT_NE(it, f.metadata().end()) << "metadata lacks '" << key << "'";
  return it == f.metadata().end() ? NAN : std::stod(it->second);
}

// HF GPT-2 parameter names and shapes for a config, in canonical order.
std::vector<std::pair<std::string, Shape>> gpt2_params(int64_t L, int64_t C, int64_t V, int64_t P) {
  std::vector<std::pair<std::string, Shape>> out = {{"wte.weight", {V, C}}, {"wpe.weight", {P, C}}};
  for (int64_t i = 0; i < L; i++) {
    const std::string h = "h." + std::to_string(i) + ".";
    out.insert(out.end(), {{h + "ln_1.weight", {C}},
                           {h + "ln_1.bias", {C}},
                           {h + "attn.c_attn.weight", {C, 3 * C}},
                           {h + "attn.c_attn.bias", {3 * C}},
                           {h + "attn.c_proj.weight", {C, C}},
                           {h + "attn.c_proj.bias", {C}},
                           {h + "ln_2.weight", {C}},
                           {h + "ln_2.bias", {C}},
                           {h + "mlp.c_fc.weight", {C, 4 * C}},
                           {h + "mlp.c_fc.bias", {4 * C}},
                           {h + "mlp.c_proj.weight", {4 * C, C}},
                           {h + "mlp.c_proj.bias", {C}}});
  }
  out.push_back({"ln_f.weight", {C}});
  out.push_back({"ln_f.bias", {C}});
  return out;
}

class GoldenFixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Result<SafetensorsFile> r = SafetensorsFile::open(kFixtureDir + "gpt2_tiny.safetensors");
    ASSERT_TRUE(r.is_ok())
        << r.status().to_string()
        << " (regenerate with /usr/bin/python3 tools/reference/gpt2_reference.py)";
    file_ = new SafetensorsFile(std::move(r).value());
  }
  static void TearDownTestSuite() {
    delete file_;
    file_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(file_, nullptr); }

  // The tensor `name`, checked for dtype and shape.
  static const SafetensorsTensor* expect_tensor(const std::string& name, DType dtype,
                                                const Shape& shape) {
    const SafetensorsTensor* t = file_->find(name);
    EXPECT_NE(t, nullptr) << "fixture lacks '" << name << "'";
    if (t == nullptr) return nullptr;
    EXPECT_EQ(t->dtype, dtype) << name;
    EXPECT_EQ(t->shape, shape) << name << ": " << t->shape.to_string() << " vs "
                               << shape.to_string();
    return t;
  }

  static SafetensorsFile* file_;
};

SafetensorsFile* GoldenFixture::file_ = nullptr;

TEST_F(GoldenFixture, HasEveryTensorWithItsShape) {
  const SafetensorsFile& f = *file_;
  const int64_t L = meta_int(f, "n_layer"), C = meta_int(f, "n_embd"),
                V = meta_int(f, "vocab_size"), P = meta_int(f, "n_positions"), B = meta_int(f, "B"),
                T = meta_int(f, "T"), steps = meta_int(f, "adamw_steps");
  EXPECT_EQ(C % meta_int(f, "n_head"), 0);
  const auto params = gpt2_params(L, C, V, P);
  size_t expected_count = 0;
  for (const std::string prefix : {"", "grad.", "final."}) {
    for (const auto& [name, shape] : params) {
      const SafetensorsTensor* t = expect_tensor(prefix + name, DType::kF32, shape);
      expected_count++;
      if (t == nullptr) continue;
      const float* x = static_cast<const float*>(t->data);
      for (int64_t i = 0; i < shape.numel(); i++) {
        ASSERT_TRUE(std::isfinite(x[i])) << prefix + name << "[" << i << "]";
      }
    }
  }
  expect_tensor("input_ids", DType::kI32, Shape{B, T});
  expect_tensor("targets", DType::kI32, Shape{B, T});
  expect_tensor("ref.logits", DType::kF32, Shape{B, T, V});
  expect_tensor("ref.loss", DType::kF32, Shape{});
  expect_tensor("adamw.losses", DType::kF32, Shape{steps});
  expect_tensor("adamw.grad_norms", DType::kF32, Shape{steps});
  expected_count += 6;
  EXPECT_EQ(f.tensors().size(), expected_count) << "unexpected extra tensors in the fixture";
}

TEST_F(GoldenFixture, BatchAndReferenceValuesAreConsistent) {
  const SafetensorsFile& f = *file_;
  const int64_t V = meta_int(f, "vocab_size"), B = meta_int(f, "B"), T = meta_int(f, "T");
  const SafetensorsTensor* ids = expect_tensor("input_ids", DType::kI32, Shape{B, T});
  const SafetensorsTensor* targets = expect_tensor("targets", DType::kI32, Shape{B, T});
  ASSERT_TRUE(ids && targets);
  int ignored = 0;
  for (int64_t i = 0; i < B * T; i++) {
    const int32_t id = static_cast<const int32_t*>(ids->data)[i];
    const int32_t tg = static_cast<const int32_t*>(targets->data)[i];
    EXPECT_TRUE(id >= 0 && id < V) << "input_ids[" << i << "] = " << id;
    EXPECT_TRUE(tg >= -1 && tg < V) << "targets[" << i << "] = " << tg;
    ignored += tg == -1;
  }
  EXPECT_EQ(ignored, 2) << "the fixture ignores exactly two targets";

  // The float64 loss, stored as f32 and as full-precision text, and the first AdamW loss
  // (computed in float32) agree to float32 rounding; near ln(V) for a freshly initialised model.
  const SafetensorsTensor* loss = expect_tensor("ref.loss", DType::kF32, Shape{});
  const SafetensorsTensor* losses = expect_tensor("adamw.losses", DType::kF32, Shape{5});
  ASSERT_TRUE(loss && losses);
  const double loss64 = meta_double(f, "ref.loss_f64");
  EXPECT_NEAR(*static_cast<const float*>(loss->data), loss64, 1e-6);
  EXPECT_NEAR(static_cast<const float*>(losses->data)[0], loss64, 1e-5);
  EXPECT_NEAR(loss64, std::log(double(V)), 0.2);
  for (int i = 1; i < 5; i++) {
    EXPECT_LT(static_cast<const float*>(losses->data)[i],
              static_cast<const float*>(losses->data)[i - 1])
        << "AdamW on one batch must lower the loss at step " << i;
  }
}

TEST_F(GoldenFixture, ConfigJsonMatchesMetadata) {
  const std::string path = kFixtureDir + "gpt2_tiny_config.json";
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << path;
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    FAIL() << path << ": " << e.what();
  }
  const SafetensorsFile& f = *file_;
  EXPECT_EQ(config.value("model_type", ""), "gpt2");
  for (const char* key : {"n_layer", "n_head", "n_embd", "vocab_size", "n_positions"}) {
    ASSERT_TRUE(config.contains(key) && config[key].is_number_integer()) << path << ": " << key;
    EXPECT_EQ(config[key].get<int64_t>(), meta_int(f, key)) << key;
  }
  ASSERT_TRUE(config.contains("layer_norm_epsilon"));
  EXPECT_EQ(config["layer_norm_epsilon"].get<double>(), meta_double(f, "layer_norm_epsilon"));
  EXPECT_EQ(config.value("activation_function", ""), f.metadata().at("activation_function"));
  EXPECT_EQ(config.value("activation_function", ""), "gelu_new");
}

TEST_F(GoldenFixture, MetadataStatesTheOptimizerRun) {
  const SafetensorsFile& f = *file_;
  EXPECT_EQ(meta_double(f, "lr"), 1e-3);
  EXPECT_EQ(meta_double(f, "beta1"), 0.9);
  EXPECT_EQ(meta_double(f, "beta2"), 0.95);
  EXPECT_EQ(meta_double(f, "eps"), 1e-8);
  EXPECT_EQ(meta_double(f, "weight_decay"), 0.1);
  EXPECT_EQ(meta_double(f, "clip"), 1.0);
  EXPECT_EQ(meta_int(f, "adamw_steps"), 5);
  EXPECT_TRUE(f.metadata().count("torch_version"));
}

}  // namespace
}  // namespace headroom::model
