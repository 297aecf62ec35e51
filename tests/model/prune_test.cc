// Pruning (model/prune.h): the masks' patterns and counts, and structured MLP pruning that writes
// a smaller model which reloads and computes what the unpruned one does with those channels
// zeroed.
#include "model/prune.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "model/weights.h"

namespace headroom::model {
namespace {

namespace fs = std::filesystem;

TransformerConfig gpt2_tiny() {
  TransformerConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  c.vocab_size = 40;
  c.n_positions = 16;
  return c;
}

TransformerConfig llama_tiny() {
  TransformerConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 16;
  c.vocab_size = 40;
  c.n_positions = 16;
  c.model_type = "llama";
  c.norm = NormKind::kRmsNorm;
  c.positions = PositionKind::kRope;
  c.mlp = MlpKind::kSwiGlu;
  c.n_kv_head = 2;
  c.intermediate_size = 24;
  c.qkv_bias = false;
  c.other_bias = false;
  c.tied_head = false;
  return c;
}

struct Model {
  TransformerConfig config;
  ParamTable table;
  std::vector<float> params;
};

// Initialised, with biases and norm weights perturbed so that zeroing a channel's bias matters.
Model make_model(const TransformerConfig& c, uint64_t seed) {
  Model m{c, gpt2_param_table(c), {}};
  m.params.assign(size_t(m.table.total_floats), 0.0f);
  gpt2_init_params(c, m.table, m.params.data(), seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> nd(0.0f, 0.05f);
  for (const ParamDesc& p : m.table.params) {
    if (p.shape.rank() != 1) continue;
    for (int64_t i = 0; i < p.shape.numel(); i++) m.params[size_t(p.offset + i)] += nd(rng);
  }
  return m;
}

void tokens(const TransformerConfig& c, int n, std::vector<int32_t>* in, std::vector<int32_t>* tg) {
  in->resize(size_t(n));
  tg->resize(size_t(n));
  for (int i = 0; i < n; i++) {
    (*in)[size_t(i)] = (i * 7 + 3) % c.vocab_size;
    (*tg)[size_t(i)] = (i * 13 + 1) % c.vocab_size;
  }
}

double loss_of(const Model& m, int seqs = 3, int T = 8) {
  std::vector<int32_t> in, tg;
  tokens(m.config, seqs * T, &in, &tg);
  Result<double> l =
      mean_loss(m.config, m.table, m.params.data(), in.data(), tg.data(), seqs, 2, T);
  EXPECT_TRUE(l.is_ok()) << l.status().to_string();
  return l.is_ok() ? *l : NAN;
}

TEST(Prune, PrunableTensorsAreTheBlocksMatrices) {
  for (const TransformerConfig& c : {gpt2_tiny(), llama_tiny()}) {
    const ParamTable t = gpt2_param_table(c);
    const std::vector<size_t> p = prunable_tensors(t);
    EXPECT_EQ(p.size(), size_t(c.is_gpt2() ? 4 : 7) * size_t(c.n_layer)) << c.model_type;
    for (size_t i : p) {
      EXPECT_EQ(t.params[i].shape.rank(), 2u) << t.params[i].name;
      EXPECT_NE(i, t.wte);
      EXPECT_NE(i, t.head);
    }
  }
}

TEST(Prune, NmPatternHoldsInEveryGroup) {
  for (const TransformerConfig& c : {gpt2_tiny(), llama_tiny()}) {
    const Model m = make_model(c, 7);
    for (auto [n, mm] : {std::pair{2, 4}, std::pair{1, 4}, std::pair{3, 8}}) {
      Result<SparsityMask> mask = nm_mask(c, m.table, m.params.data(), n, mm);
      ASSERT_TRUE(mask.is_ok()) << mask.status().to_string();
      const int in_dim = input_dim(c);
      for (size_t t : prunable_tensors(m.table)) {
        const ParamDesc& p = m.table.params[t];
        const int64_t in = p.shape[size_t(in_dim)], out = p.shape[size_t(1 - in_dim)];
        const int64_t so = in_dim == 1 ? in : 1, si = in_dim == 1 ? 1 : out;
        for (int64_t o = 0; o < out; o++) {
          for (int64_t g = 0; g < in; g += mm) {
            int kept = 0;
            float min_kept = INFINITY, max_pruned = 0;
            for (int j = 0; j < mm; j++) {
              const int64_t k = p.offset + o * so + (g + j) * si;
              const float a = std::fabs(m.params[size_t(k)]);
              if ((*mask)[size_t(k)]) {
                kept++;
                min_kept = std::min(min_kept, a);
              } else {
                max_pruned = std::max(max_pruned, a);
              }
            }
            ASSERT_EQ(kept, n) << p.name << " row " << o << " group " << g;
            ASSERT_LE(max_pruned, min_kept) << p.name << " row " << o << " group " << g;
          }
        }
      }
      const MaskCounts cnt = count_mask(m.table, *mask);
      EXPECT_EQ(cnt.pruned * mm, cnt.prunable * (mm - n));
      // Everything else is kept.
      int64_t zeros = 0;
      for (uint8_t k : *mask) zeros += k == 0;
      EXPECT_EQ(zeros, cnt.pruned);
    }
  }
}

TEST(Prune, MagnitudeMasksTheSmallestGloballyOrPerLayer) {
  const Model m = make_model(gpt2_tiny(), 3);
  for (bool per_layer : {false, true}) {
    const SparsityMask mask = magnitude_mask(m.table, m.params.data(), 0.3, per_layer);
    const MaskCounts cnt = count_mask(m.table, mask);
    EXPECT_NEAR(double(cnt.pruned) / double(cnt.prunable), 0.3, 1e-3);
    const int groups = per_layer ? m.config.n_layer : 1;
    for (int g = 0; g < groups; g++) {
      float max_pruned = 0, min_kept = INFINITY;
      int64_t pruned = 0, n = 0;
      for (size_t t : prunable_tensors(m.table)) {
        const ParamDesc& p = m.table.params[t];
        if (per_layer && p.site != g) continue;
        for (int64_t i = p.offset; i < p.offset + p.shape.numel(); i++) {
          const float a = std::fabs(m.params[size_t(i)]);
          n++;
          if (mask[size_t(i)]) {
            min_kept = std::min(min_kept, a);
          } else {
            pruned++;
            max_pruned = std::max(max_pruned, a);
          }
        }
      }
      EXPECT_LE(max_pruned, min_kept) << "group " << g;
      EXPECT_EQ(pruned, std::llround(0.3 * double(n))) << "group " << g;
    }
  }
  // Zero sparsity masks nothing.
  const SparsityMask none = magnitude_mask(m.table, m.params.data(), 0.0, false);
  EXPECT_EQ(count_mask(m.table, none).pruned, 0);
}

TEST(Prune, MaskFromZerosFindsTheAppliedMask) {
  Model m = make_model(llama_tiny(), 5);
  Result<SparsityMask> mask = nm_mask(m.config, m.table, m.params.data(), 2, 4);
  ASSERT_TRUE(mask.is_ok());
  apply_mask(*mask, m.params.data(), m.table.total_floats);
  EXPECT_EQ(mask_from_zeros(m.table, m.params.data()), *mask);
}

// The strong test: the smaller model computes exactly what the unpruned one does with those
// channels zeroed (up to the GEMMs' summation order over a shorter reduction), and it reloads
// from disk with a config whose shapes agree with its tensors.
TEST(Prune, StructuredMlpPruningWritesAModelThatReloadsAndMatchesTheZeroedOne) {
  for (const TransformerConfig& c : {gpt2_tiny(), llama_tiny()}) {
    const Model m = make_model(c, 11);
    Result<StructuredPrune> sp = prune_mlp_channels(c, m.table, m.params.data(), 0.25);
    ASSERT_TRUE(sp.is_ok()) << sp.status().to_string();
    const int64_t I = c.mlp_width(), keep = std::llround(0.75 * double(I));
    EXPECT_EQ(sp->config.mlp_width(), keep);
    EXPECT_LT(sp->table.num_parameters, m.table.num_parameters);
    for (const auto& r : sp->removed) EXPECT_EQ(int64_t(r.size()), I - keep);

    Model zeroed = m;
    zero_mlp_channels(c, zeroed.table, zeroed.params.data(), sp->removed);
    const double want = loss_of(zeroed);
    EXPECT_GT(std::fabs(loss_of(m) - want), 1e-6) << "zeroing the channels changed nothing";

    const fs::path dir = fs::path(::testing::TempDir()) / ("pruned_" + c.model_type);
    fs::remove_all(dir);
    ASSERT_TRUE(save_pretrained(dir.string(), sp->config, sp->table, sp->params.data()).is_ok());
    Result<TransformerConfig> back = load_config_file((dir / "config.json").string());
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    EXPECT_EQ(*back, sp->config) << c.model_type;
    Model reloaded{*back, gpt2_param_table(*back), {}};
    reloaded.params.assign(size_t(reloaded.table.total_floats), NAN);
    Status s = load_pretrained(dir.string(), reloaded.table, reloaded.params.data());
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    const double got = loss_of(reloaded);
    EXPECT_NEAR(got, want, 1e-5 * std::fabs(want)) << c.model_type;
    // And the unpruned shapes are refused for the pruned files (the config really changed).
    std::vector<float> full(size_t(m.table.total_floats));
    EXPECT_FALSE(load_pretrained(dir.string(), m.table, full.data()).is_ok());
    fs::remove_all(dir);
  }
}

TEST(Prune, BadInputsAreRefusedWithTheValue) {
  const Model m = make_model(gpt2_tiny(), 1);
  auto refused = [](const Status& s, const std::string& part) {
    EXPECT_FALSE(s.is_ok());
    EXPECT_NE(s.to_string().find(part), std::string::npos) << s.to_string();
  };
  refused(nm_mask(m.config, m.table, m.params.data(), 4, 2).status(), "4:2");
  refused(nm_mask(m.config, m.table, m.params.data(), 0, 4).status(), "0:4");
  refused(nm_mask(m.config, m.table, m.params.data(), 2, 5).status(), "multiple of M = 5");
  refused(prune_mlp_channels(m.config, m.table, m.params.data(), 1.0).status(), "[0, 1)");
  refused(prune_mlp_channels(m.config, m.table, m.params.data(), -0.1).status(), "-0.1");
  refused(prune_mlp_channels(m.config, m.table, m.params.data(), 0.999).status(),
          "would remove all");
}

TEST(Prune, Gpt2ConfigCarriesThePrunedMlpWidth) {
  TransformerConfig c = gpt2_tiny();
  EXPECT_EQ(c.to_json().find("n_inner"), std::string::npos);  // unpruned configs unchanged
  c.intermediate_size = 40;
  const std::string text = c.to_json();
  EXPECT_NE(text.find("\"n_inner\": 40"), std::string::npos) << text;
  Result<TransformerConfig> back = parse_config_json(text, "config.json");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(*back, c);
  // n_inner spelt out as 4 n_embd is the default.
  Result<TransformerConfig> four = parse_config_json(
      R"({"n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": 40, "n_positions": 16,
          "n_inner": 64})",
      "config.json");
  ASSERT_TRUE(four.is_ok());
  EXPECT_EQ(*four, gpt2_tiny());
}

}  // namespace
}  // namespace headroom::model
