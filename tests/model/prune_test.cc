// Pruning (model/prune.h): the masks' patterns and counts, and structured pruning (MLP channels,
// attention heads / KV groups) that writes a smaller model which reloads and computes what the
// unpruned one does with those channels or heads zeroed.
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

// Head pruning writes a model that reloads (its config carries head_dim and the new head counts)
// and computes what the unpruned one does with every weight of those heads zeroed.
TEST(Prune, HeadPruningWritesAModelThatReloadsAndMatchesTheZeroedOne) {
  TransformerConfig gpt2 = gpt2_tiny();
  gpt2.n_head = 4;
  for (const TransformerConfig& c : {gpt2, llama_tiny()}) {
    const Model m = make_model(c, 13);
    Result<StructuredPrune> sp = prune_attention_heads(c, m.table, m.params.data(), 0.5);
    ASSERT_TRUE(sp.is_ok()) << sp.status().to_string();
    EXPECT_EQ(sp->unit, StructuredPrune::Unit::kKvGroup);
    EXPECT_EQ(sp->config.n_head, 2) << c.model_type;
    EXPECT_EQ(sp->config.kv_heads(), c.is_gpt2() ? 2 : 1);
    EXPECT_EQ(sp->config.head_size(), c.head_size());
    EXPECT_EQ(sp->config.n_embd, c.n_embd);
    EXPECT_EQ(sp->config.mlp_width(), c.mlp_width());
    EXPECT_LT(sp->table.num_parameters, m.table.num_parameters);
    EXPECT_EQ(sp->table.num_parameters, sp->config.num_parameters());
    for (const auto& r : sp->removed) EXPECT_EQ(r.size(), size_t(c.kv_heads() / 2));

    Model zeroed = m;
    zero_attention_heads(c, zeroed.table, zeroed.params.data(), sp->removed);
    const double want = loss_of(zeroed);
    EXPECT_GT(std::fabs(loss_of(m) - want), 1e-6) << "zeroing the heads changed nothing";
    // The output projection's columns alone decide: q, k, v of a head without them do nothing.
    Model out_only = m;
    zero_attention_output(c, out_only.table, out_only.params.data(), sp->removed);
    EXPECT_NEAR(loss_of(out_only), want, 1e-6 * want);

    const fs::path dir = fs::path(::testing::TempDir()) / ("heads_pruned_" + c.model_type);
    fs::remove_all(dir);
    ASSERT_TRUE(save_pretrained(dir.string(), sp->config, sp->table, sp->params.data()).is_ok());
    Result<TransformerConfig> back = load_config_file((dir / "config.json").string());
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    EXPECT_EQ(*back, sp->config) << c.model_type;
    EXPECT_EQ(back->head_dim, c.head_size());
    Model reloaded{*back, gpt2_param_table(*back), {}};
    reloaded.params.assign(size_t(reloaded.table.total_floats), NAN);
    Status s = load_pretrained(dir.string(), reloaded.table, reloaded.params.data());
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_NEAR(loss_of(reloaded), want, 1e-5 * want) << c.model_type;
    std::vector<float> full(size_t(m.table.total_floats));
    EXPECT_FALSE(load_pretrained(dir.string(), m.table, full.data()).is_ok());
    // And its MLP can be pruned after its heads (--what both).
    Result<StructuredPrune> both =
        prune_mlp_channels(sp->config, sp->table, sp->params.data(), 0.25);
    ASSERT_TRUE(both.is_ok()) << both.status().to_string();
    EXPECT_EQ(both->config.n_head, 2);
    EXPECT_EQ(both->config.head_dim, c.head_size());
    fs::remove_all(dir);
  }
}

// GQA: the unit is a whole KV group (its k and v heads with the query heads that read them), so
// every block keeps one group size. The least important groups go (here the groups whose weights
// were shrunk), the kept groups' weights move unchanged and in their original order.
TEST(Prune, GqaPruningRemovesWholeKvGroupsByImportance) {
  TransformerConfig c = llama_tiny();
  c.n_head = 8;  // 4 groups of 2 query heads, head size 2
  c.n_kv_head = 4;
  c.qkv_bias = true;
  Model m = make_model(c, 19);
  const int64_t C = c.n_embd, HS = c.head_size(), G = 2, A = c.attn_width();
  // Block 0: group 1 and group 3 tiny; block 1: group 0 and group 2 (every block ranks alone).
  const std::vector<std::vector<int64_t>> weak = {{1, 3}, {0, 2}};
  for (int l = 0; l < 2; l++) {
    const ParamTable::Layer& y = m.table.layers[size_t(l)];
    for (int64_t j : weak[size_t(l)]) {
      auto shrink = [&](size_t tensor, int64_t row0, int64_t rows, int64_t cols) {
        float* w = m.params.data() + m.table.params[tensor].offset;
        for (int64_t r = row0; r < row0 + rows; r++)
          for (int64_t i = 0; i < cols; i++) w[r * cols + i] *= 1e-3f;
      };
      shrink(y.qkv_w, j * G * HS, G * HS, C);  // q rows
      shrink(y.qkv_w + 1, j * HS, HS, C);      // k rows
      shrink(y.qkv_w + 2, j * HS, HS, C);      // v rows
      float* o = m.params.data() + m.table.params[y.attproj_w].offset;
      for (int64_t i = 0; i < C; i++)
        for (int64_t d = j * G * HS; d < (j + 1) * G * HS; d++) o[i * A + d] *= 1e-3f;
    }
  }
  Result<StructuredPrune> sp = prune_attention_heads(c, m.table, m.params.data(), 0.5);
  ASSERT_TRUE(sp.is_ok()) << sp.status().to_string();
  EXPECT_EQ(sp->removed, weak);
  EXPECT_EQ(sp->config.n_head, 4);
  EXPECT_EQ(sp->config.kv_heads(), 2);
  EXPECT_EQ(sp->config.n_head / sp->config.kv_heads(), G);  // the group size is kept
  // Block 0 keeps groups 0 and 2: new group 1 is old group 2, rows and biases unchanged.
  const ParamTable::Layer& y = m.table.layers[0];
  const ParamTable::Layer& z = sp->table.layers[0];
  auto at = [](const Model& mm, size_t tensor) {
    return mm.params.data() + mm.table.params[tensor].offset;
  };
  const Model pm{sp->config, sp->table, sp->params};
  for (int64_t r = 0; r < G * HS; r++) {
    for (int64_t i = 0; i < C; i++) {
      EXPECT_EQ(at(pm, z.qkv_w)[(G * HS + r) * C + i], at(m, y.qkv_w)[(2 * G * HS + r) * C + i]);
    }
    EXPECT_EQ(at(pm, z.qkv_b)[G * HS + r], at(m, y.qkv_b)[2 * G * HS + r]);
  }
  for (int64_t r = 0; r < HS; r++) {
    for (int64_t i = 0; i < C; i++) {
      EXPECT_EQ(at(pm, z.qkv_w + 1)[(HS + r) * C + i], at(m, y.qkv_w + 1)[(2 * HS + r) * C + i]);
      EXPECT_EQ(at(pm, z.qkv_w + 2)[(HS + r) * C + i], at(m, y.qkv_w + 2)[(2 * HS + r) * C + i]);
    }
    EXPECT_EQ(at(pm, z.qkv_b + 2)[HS + r], at(m, y.qkv_b + 2)[2 * HS + r]);
  }
  const int64_t A2 = sp->config.attn_width();
  for (int64_t i = 0; i < C; i++) {
    for (int64_t d = 0; d < G * HS; d++) {
      EXPECT_EQ(at(pm, z.attproj_w)[i * A2 + G * HS + d],
                at(m, y.attproj_w)[i * A + 2 * G * HS + d]);
    }
  }
  // The shrunk groups cost little: the pruned model's loss is near the unpruned one's.
  EXPECT_NEAR(loss_of(pm), loss_of(m), 1e-2 * loss_of(m));
}

TEST(Prune, HeadPruningRefusesWhatWouldLeaveNoHead) {
  auto refused = [](const Status& s, const std::vector<std::string>& parts) {
    EXPECT_FALSE(s.is_ok());
    for (const std::string& p : parts)
      EXPECT_NE(s.to_string().find(p), std::string::npos) << s.to_string();
  };
  const Model g = make_model(gpt2_tiny(), 1);  // 2 heads
  refused(prune_attention_heads(g.config, g.table, g.params.data(), 0.8).status(),
          {"--sparsity 0.8", "would remove all 2 attention heads"});
  refused(prune_attention_heads(g.config, g.table, g.params.data(), 1.0).status(),
          {"--sparsity 1", "[0, 1)"});
  refused(prune_attention_heads(g.config, g.table, g.params.data(), -0.5).status(),
          {"--sparsity -0.5"});
  const Model l = make_model(llama_tiny(), 1);  // 2 KV groups of 2 query heads
  refused(prune_attention_heads(l.config, l.table, l.params.data(), 0.9).status(),
          {"would remove all 2 KV groups"});
  // Zero sparsity removes nothing and keeps the config.
  Result<StructuredPrune> none = prune_attention_heads(g.config, g.table, g.params.data(), 0.0);
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(none->config, g.config);
  EXPECT_EQ(none->params, g.params);
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
