// The PyTorch reference fixtures (tools/reference/, tests/golden/fixtures/) and the comparison
// the golden tests use, shared by the CPU golden test and the CUDA one (tests/cuda).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/gpt2.h"
#include "model/safetensors.h"
#include "train/optimizer.h"

namespace headroom::golden {

inline const std::string kDir = std::string(HEADROOM_SOURCE_DIR) + "/tests/golden/fixtures/";

struct Fixture {
  model::SafetensorsFile file;
  model::Gpt2Config config;
  int B = 0, T = 0;
};

inline Fixture load_fixture(const std::string& name) {
  Result<model::SafetensorsFile> f = model::SafetensorsFile::open(kDir + name + ".safetensors");
  if (!f.is_ok()) {
    ADD_FAILURE() << f.status().to_string();
    std::abort();
  }
  Result<model::Gpt2Config> c = model::load_config_file(kDir + name + "_config.json");
  if (!c.is_ok()) {
    ADD_FAILURE() << c.status().to_string();
    std::abort();
  }
  Fixture fx{std::move(f).value(), *c};
  fx.B = std::stoi(fx.file.metadata().at("B"));
  fx.T = std::stoi(fx.file.metadata().at("T"));
  return fx;
}

inline std::vector<float> tensor(const model::SafetensorsFile& f, const std::string& name) {
  const model::SafetensorsTensor* t = f.find(name);
  if (!t) {
    ADD_FAILURE() << "fixture lacks " << name;
    return {};
  }
  std::vector<float> v(t->bytes / 4);
  std::memcpy(v.data(), t->data, t->bytes);
  return v;
}

inline std::vector<int32_t> ints(const model::SafetensorsFile& f, const std::string& name) {
  const model::SafetensorsTensor* t = f.find(name);
  std::vector<int32_t> v(t->bytes / 4);
  std::memcpy(v.data(), t->data, t->bytes);
  return v;
}

// The AdamW settings the fixture's five reference steps used (its metadata).
inline train::AdamWConfig adamw_config(const Fixture& fx) {
  const auto& md = fx.file.metadata();
  train::AdamWConfig cfg;
  cfg.lr = std::stof(md.at("lr"));
  cfg.beta1 = std::stof(md.at("beta1"));
  cfg.beta2 = std::stof(md.at("beta2"));
  cfg.eps = std::stof(md.at("eps"));
  cfg.weight_decay = std::stof(md.at("weight_decay"));
  cfg.grad_clip = std::stof(md.at("clip"));
  return cfg;
}

// max |a - b| <= atol + rtol * max |b|, reported with the worst index.
inline void expect_close(const float* a, const std::vector<float>& b, double atol, double rtol,
                         const std::string& what) {
  double scale = 0, worst = 0;
  size_t wi = 0;
  for (float x : b) scale = std::max(scale, double(std::fabs(x)));
  for (size_t i = 0; i < b.size(); i++) {
    double d = std::fabs(double(a[i]) - double(b[i]));
    if (d > worst || std::isnan(d)) {
      worst = std::isnan(d) ? INFINITY : d;
      wi = i;
    }
  }
  EXPECT_LE(worst, atol + rtol * scale) << what << ": worst at " << wi << ": " << a[wi] << " vs "
                                        << b[wi] << " (scale " << scale << ")";
}

// Every execution variant (attention kernel, LM head, recomputation) must reproduce PyTorch:
// the memory techniques are invisible to the mathematics (DESIGN.md principle 2).
struct Variant {
  const char* name;
  bool tiled;
  int head_chunk;
  std::vector<model::Recompute> recompute;  // for the fixture's two blocks
};
inline void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }
inline const Variant kVariants[] = {
    {"plain", false, 0, {}},
    {"tiled", true, 0, {}},
    {"tiled_fused7", true, 7, {}},
    {"plain_fused32", false, 32, {}},
    {"selective", true, 0, {model::Recompute::kSelective, model::Recompute::kSelective}},
    {"full", false, 0, {model::Recompute::kFull, model::Recompute::kFull}},
    {"mixed_fused5", true, 5, {model::Recompute::kFull, model::Recompute::kSelective}},
    {"none_full_plain", false, 0, {model::Recompute::kNone, model::Recompute::kFull}},
};

inline const char* const kFixtures[] = {"gpt2_tiny", "llama_tiny", "llama_tiny_tied"};

// The test name of a (fixture, variant) parameter.
template <typename Info>
std::string param_name(const Info& info) {
  return std::string(std::get<0>(info.param)) + "_" + std::get<1>(info.param).name;
}

}  // namespace headroom::golden
