// The config.json parser: Hugging Face spellings are read, and malformed input (including the
// cases the fuzzer found, docs/notes/fuzzing.md) is an error naming the file, the field and the
// value, never a crash, an undefined conversion or an unbounded allocation.
#include "model/config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "model/gpt2.h"

namespace headroom::model {
namespace {

namespace fs = std::filesystem;

// A valid tiny config with `field` replaced by the JSON text `value` (or added).
std::string with_field(const std::string& field, const std::string& value) {
  std::string fields[][2] = {
      {"model_type", "\"gpt2\""}, {"n_layer", "2"},    {"n_head", "2"}, {"n_embd", "8"},
      {"vocab_size", "16"},       {"n_positions", "8"}};
  std::string text = "{";
  bool replaced = false;
  for (auto& [name, v] : fields) {
    if (text.size() > 1) text += ", ";
    const bool hit = name == field;
    replaced |= hit;
    text += "\"" + name + "\": " + (hit ? value : v);
  }
  if (!replaced) text += ", \"" + field + "\": " + value;
  return text + "}";
}

// Parses `text` and expects an error whose message names the file and each of `parts`.
void expect_refused(const std::string& text, std::vector<std::string> parts) {
  Result<Gpt2Config> c = parse_config_json(text, "dir/config.json");
  ASSERT_FALSE(c.is_ok()) << "accepted: " << text.substr(0, 200);
  parts.push_back("dir/config.json");
  for (const std::string& part : parts) {
    EXPECT_NE(c.status().message().find(part), std::string::npos)
        << "message does not mention '" << part << "': " << c.status().to_string();
  }
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(ConfigJson, ReadsHuggingFaceSpellingsAndRoundTrips) {
  Result<Gpt2Config> c = parse_config_json(
      R"({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8, "vocab_size": 16,
          "n_ctx": 8, "layer_norm_epsilon": 1e-6, "activation_function": "gelu_pytorch_tanh"})",
      "config.json");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->n_layer, 2);
  EXPECT_EQ(c->n_embd, 8);
  EXPECT_EQ(c->n_positions, 8);
  EXPECT_FLOAT_EQ(c->layer_norm_epsilon, 1e-6f);
  Result<Gpt2Config> again = parse_config_json(c->to_json(), "again");
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_EQ(again->to_json(), c->to_json());
}

TEST(ConfigJson, FuzzSeedCorpusIsAccepted) {
  int seen = 0;
  for (const auto& e : fs::directory_iterator(HEADROOM_SOURCE_DIR "/fuzz/corpus/config")) {
    Result<Gpt2Config> c = parse_config_json(read_file(e.path()), e.path().string());
    EXPECT_TRUE(c.is_ok()) << c.status().to_string();
    seen++;
  }
  EXPECT_GT(seen, 0);
}

// Every input the fuzzer found a crash with stays refused with a clear error.
TEST(ConfigJson, FuzzRegressionInputsAreRefusedCleanly) {
  const fs::path dir = HEADROOM_SOURCE_DIR "/tests/fuzz_regressions/config";
  if (!fs::exists(dir)) GTEST_SKIP() << "no committed inputs";
  for (const auto& e : fs::directory_iterator(dir)) {
    Result<Gpt2Config> c = parse_config_json(read_file(e.path()), e.path().string());
    if (!c.is_ok()) {
      EXPECT_NE(c.status().message().find(e.path().string()), std::string::npos)
          << c.status().to_string();
    } else {
      EXPECT_TRUE(c->validate().is_ok());
    }
  }
}

TEST(ConfigJson, NotAnObjectOrNotJson) {
  expect_refused("[1, 2]", {"expected a JSON object"});
  expect_refused("{\"n_layer\": 2,", {"not valid JSON"});
  expect_refused("", {"not valid JSON"});
}

TEST(ConfigJson, IntegerFieldsNameTheFieldAndValue) {
  expect_refused(with_field("n_layer", "-1"), {"'n_layer'", "-1", "positive integer"});
  expect_refused(with_field("n_layer", "0"), {"'n_layer'", "= 0"});
  expect_refused(with_field("n_head", "2.5"), {"'n_head'", "2.5"});
  expect_refused(with_field("n_embd", "\"8\""), {"'n_embd'", "\"8\""});
  // Beyond int64: must not be converted (and wrapped) before the range check.
  expect_refused(with_field("vocab_size", "18446744073709551615"),
                 {"'vocab_size'", "18446744073709551615"});
  expect_refused(with_field("vocab_size", "-9223372036854775808"), {"'vocab_size'"});
  expect_refused(with_field("n_positions", "1073741825"), {"'n_positions'", "1073741825"});
  expect_refused(R"({"n_layer": 2})", {"missing field 'n_head'"});
}

// Regression (found in review, see docs/notes/fuzzing.md): the value of a malformed field was
// printed with json::dump, which recurses once per nesting level, so a deeply nested value
// overflowed the stack (a crash, not an error).
TEST(ConfigJson, DeeplyNestedFieldValueIsAnErrorNotAStackOverflow) {
  const int depth = 200000;
  const std::string nested = std::string(depth, '[') + std::string(depth, ']');
  expect_refused(with_field("n_layer", nested), {"'n_layer'", "an array of 1 elements"});
  expect_refused(with_field("layer_norm_epsilon", nested), {"'layer_norm_epsilon'", "an array"});
  const std::string objects = [] {
    std::string s;
    for (int i = 0; i < depth; i++) s += "{\"a\":";
    return s + "1" + std::string(depth, '}');
  }();
  expect_refused(with_field("n_embd", objects), {"'n_embd'", "an object of 1 fields"});
  // Deep nesting in a field nobody reads is fine.
  EXPECT_TRUE(parse_config_json(with_field("task_specific_params", nested), "c").is_ok());
}

// Regression (found in review, see docs/notes/fuzzing.md): layer_norm_epsilon was converted to
// float before its range was checked; a value beyond float's range is undefined behaviour in that
// conversion.
TEST(ConfigJson, LayerNormEpsilonIsRangeCheckedBeforeConversion) {
  expect_refused(with_field("layer_norm_epsilon", "1e300"), {"'layer_norm_epsilon'", "1e+300"});
  expect_refused(with_field("layer_norm_epsilon", "-1e300"), {"'layer_norm_epsilon'"});
  expect_refused(with_field("layer_norm_epsilon", "1e-300"), {"'layer_norm_epsilon'", "1e-300"});
  expect_refused(with_field("layer_norm_epsilon", "1"), {"'layer_norm_epsilon'", "(0, 1)"});
  expect_refused(with_field("layer_norm_epsilon", "\"small\""), {"'layer_norm_epsilon'"});
  Result<Gpt2Config> c = parse_config_json(with_field("layer_norm_epsilon", "1e-12"), "c");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_FLOAT_EQ(c->layer_norm_epsilon, 1e-12f);
}

// Regression (found by fuzz_config, tests/fuzz_regressions/config/n-layer-777777-timeout.json):
// any n_layer up to 2^30 passed validation, and building the parameter table of n_layer = 777777
// (12 entries per layer) took over 10 s and 1.6 GB; 2^30 layers would ask for ~1 TB.
TEST(ConfigJson, AbsurdLayerCountIsRefused) {
  expect_refused(with_field("n_layer", "777777"), {"n_layer = 777777", "4096"});
  expect_refused(with_field("n_layer", "1073741824"), {"n_layer = 1073741824", "4096"});
  Result<Gpt2Config> c = parse_config_json(with_field("n_layer", "4096"), "c");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(gpt2_param_table(*c).params.size(), size_t(4096) * 12 + 4);
}

// Regression (found in review, see docs/notes/fuzzing.md): dimensions within each field's limit
// could still give a parameter count that overflows the int64 sizes computed from it.
TEST(ConfigJson, ParameterCountBeyondTwoToTheFortyIsRefused) {
  expect_refused(R"({"n_layer": 4096, "n_head": 1, "n_embd": 65536, "vocab_size": 16,
                     "n_positions": 8})",
                 {"n_layer = 4096", "n_embd = 65536", "2^40 parameters"});
  expect_refused(R"({"n_layer": 1, "n_head": 1, "n_embd": 536870912, "vocab_size": 16,
                     "n_positions": 1})",
                 {"n_embd = 536870912"});
  expect_refused(R"({"n_layer": 1, "n_head": 1, "n_embd": 8, "vocab_size": 16,
                     "n_positions": 1073741824})",
                 {"n_positions = 1073741824"});
  // gpt2-xl, the largest preset, is far inside.
  EXPECT_TRUE(preset_config("gpt2-xl")->validate().is_ok());
}

TEST(ConfigJson, UnsupportedModelOrActivation) {
  expect_refused(with_field("model_type", "\"bert\""), {"'model_type'", "\"bert\""});
  expect_refused(with_field("activation_function", "\"relu\""), {"activation_function 'relu'"});
}

// A Llama-family config.json with `extra` fields appended (JSON text after a comma).
std::string llama_json(const std::string& type, const std::string& extra = "") {
  std::string text = "{\"model_type\": \"" + type +
                     "\", \"hidden_size\": 64, \"intermediate_size\": 176, "
                     "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                     "\"num_key_value_heads\": 2, \"vocab_size\": 97, "
                     "\"max_position_embeddings\": 32, \"rms_norm_eps\": 1e-5, "
                     "\"hidden_act\": \"silu\"";
  if (!extra.empty()) text += ", " + extra;
  return text + "}";
}

TEST(ConfigJson, LlamaFamilyArchitecture) {
  Result<TransformerConfig> c = parse_config_json(llama_json("llama"), "x");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->norm, NormKind::kRmsNorm);
  EXPECT_EQ(c->positions, PositionKind::kRope);
  EXPECT_EQ(c->mlp, MlpKind::kSwiGlu);
  EXPECT_EQ(c->kv_heads(), 2);
  EXPECT_EQ(c->mlp_width(), 176);
  EXPECT_EQ(c->qkv_width(), (4 + 2 * 2) * 16);
  EXPECT_FALSE(c->tied_head);  // transformers' default for Llama
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_FLOAT_EQ(c->rope_theta, 10000.0f);
  // Qwen2 has q, k, v biases; Mistral's sliding window caps the context.
  Result<TransformerConfig> q = parse_config_json(llama_json("qwen2"), "x");
  ASSERT_TRUE(q.is_ok()) << q.status().to_string();
  EXPECT_TRUE(q->qkv_bias);
  Result<TransformerConfig> m =
      parse_config_json(llama_json("mistral", "\"sliding_window\": 16"), "x");
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  EXPECT_EQ(m->n_positions, 16);
  Result<TransformerConfig> m2 =
      parse_config_json(llama_json("mistral", "\"sliding_window\": null"), "x");
  ASSERT_TRUE(m2.is_ok());
  EXPECT_EQ(m2->n_positions, 32);
  // The parameter count the config gives is the table's.
  for (const TransformerConfig& cfg : {*c, *q, *m}) {
    EXPECT_EQ(gpt2_param_table(cfg).num_parameters, cfg.num_parameters());
  }
  EXPECT_EQ(gpt2_param_table(*preset_config("gpt2")).num_parameters,
            preset_config("gpt2")->num_parameters());
}

TEST(ConfigJson, LlamaRopeScalingAndRoundTrip) {
  const std::string rs =
      "\"rope_theta\": 500000.0, \"tie_word_embeddings\": true, \"rope_scaling\": "
      "{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
      "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 16}";
  Result<TransformerConfig> c = parse_config_json(llama_json("llama", rs), "x");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->rope_scaling.kind, RopeScalingConfig::Kind::kLlama3);
  EXPECT_FLOAT_EQ(c->rope_scaling.factor, 8.0f);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 16);
  EXPECT_TRUE(c->tied_head);
  Result<TransformerConfig> back = parse_config_json(c->to_json(), "written");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_TRUE(*back == *c);
  // Every shipped Llama-family config parses.
  for (const char* name : {"llama-3.2-1b", "llama-3.1-8b", "mistral-7b", "smollm-135m"}) {
    Result<TransformerConfig> r =
        load_config_file(std::string(HEADROOM_SOURCE_DIR) + "/configs/" + name + ".json");
    EXPECT_TRUE(r.is_ok()) << name << ": " << r.status().to_string();
  }
  EXPECT_EQ(load_config_file(std::string(HEADROOM_SOURCE_DIR) + "/configs/llama-3.1-8b.json")
                ->num_parameters(),
            8030261248);  // Llama 3.1 8B's published parameter count
}

TEST(ConfigJson, LlamaUnsupportedSettingsNameFieldAndValue) {
  std::string gelu = llama_json("llama");
  gelu.replace(gelu.find("\"silu\""), 6, "\"gelu\"");
  expect_refused(gelu, {"'hidden_act'", "gelu"});
  expect_refused(llama_json("llama", "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}"),
                 {"rope_scaling.rope_type", "yarn"});
  // An odd head size cannot be rotated in pairs; a head_dim that is not an integer is refused
  // as the other integer fields are.
  expect_refused(llama_json("llama", "\"head_dim\": 15"), {"head size 15", "even"});
  expect_refused(llama_json("llama", "\"head_dim\": 0"), {"'head_dim'", "= 0"});
  expect_refused(llama_json("llama", "\"head_dim\": 8.5"), {"'head_dim'", "8.5"});
  expect_refused(llama_json("llama", "\"mlp_bias\": true"), {"'mlp_bias'"});
  expect_refused(llama_json("llama", "\"num_key_value_heads\": 3"), {"num_key_value_heads = 3"});
  expect_refused(llama_json("llama", "\"tie_word_embeddings\": 1"), {"'tie_word_embeddings'"});
  expect_refused(llama_json("llama", "\"rope_scaling\": {\"rope_type\": \"llama3\"}"),
                 {"rope_scaling.factor"});
}

// head_dim other than hidden_size / heads (Note [Attention width]): the attention is
// n_head x head_dim wide, the residual stream hidden_size; the config writes and reads it back,
// and the parameter table's shapes follow it.
TEST(ConfigJson, HeadDimThatIsNotHiddenOverHeadsRoundTripsAndShapesTheTable) {
  Result<TransformerConfig> c = parse_config_json(llama_json("llama", "\"head_dim\": 24"), "x");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->head_size(), 24);
  EXPECT_EQ(c->attn_width(), 4 * 24);
  EXPECT_EQ(c->qkv_width(), (4 + 2 * 2) * 24);
  Result<TransformerConfig> back = parse_config_json(c->to_json(), "y");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(*back, *c);
  const ParamTable t = gpt2_param_table(*c);
  EXPECT_EQ(t.find("model.layers.0.self_attn.q_proj.weight")->shape, (Shape{96, 64}));
  EXPECT_EQ(t.find("model.layers.0.self_attn.k_proj.weight")->shape, (Shape{48, 64}));
  EXPECT_EQ(t.find("model.layers.0.self_attn.o_proj.weight")->shape, (Shape{64, 96}));
  EXPECT_EQ(t.num_parameters, c->num_parameters());
  // head_dim spelt out as hidden_size / heads is the default: the same config as without it.
  Result<TransformerConfig> plain = parse_config_json(llama_json("llama"), "x");
  Result<TransformerConfig> spelt = parse_config_json(llama_json("llama", "\"head_dim\": 16"), "x");
  ASSERT_TRUE(plain.is_ok() && spelt.is_ok());
  EXPECT_EQ(*spelt, *plain);
  EXPECT_EQ(plain->head_dim, 0);

  // GPT-2: headroom's own head_dim field, written only when it differs (HF's GPT-2 has none).
  TransformerConfig g;
  g.n_layer = 2;
  g.n_head = 2;
  g.n_embd = 16;
  g.vocab_size = 40;
  g.n_positions = 16;
  EXPECT_EQ(g.to_json().find("head_dim"), std::string::npos);  // unpruned configs unchanged
  g.head_dim = 4;  // A = 8 < C = 16, as after pruning half the heads of a 4-head model
  ASSERT_TRUE(g.validate().is_ok());
  const std::string text = g.to_json();
  EXPECT_NE(text.find("\"head_dim\": 4"), std::string::npos) << text;
  Result<TransformerConfig> gb = parse_config_json(text, "config.json");
  ASSERT_TRUE(gb.is_ok()) << gb.status().to_string();
  EXPECT_EQ(*gb, g);
  const ParamTable gt = gpt2_param_table(g);
  EXPECT_EQ(gt.find("h.1.attn.c_attn.weight")->shape, (Shape{16, 24}));
  EXPECT_EQ(gt.find("h.1.attn.c_attn.bias")->shape, (Shape{24}));
  EXPECT_EQ(gt.find("h.1.attn.c_proj.weight")->shape, (Shape{8, 16}));
  EXPECT_EQ(gt.num_parameters, g.num_parameters());
  // A head size that does not divide n_embd needs head_dim; given, it is fine.
  g.n_head = 3;
  g.head_dim = 0;
  Status s = g.validate();
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.to_string().find("head_dim"), std::string::npos) << s.to_string();
  g.head_dim = 5;
  EXPECT_TRUE(g.validate().is_ok());
}

TEST(ParamTable, LlamaNamesGroupsAndSites) {
  Result<TransformerConfig> c = parse_config_json(llama_json("llama"), "x");
  ASSERT_TRUE(c.is_ok());
  const ParamTable t = gpt2_param_table(*c);
  ASSERT_NE(t.find("model.layers.1.self_attn.k_proj.weight"), nullptr);
  EXPECT_EQ(t.find("model.layers.1.self_attn.k_proj.weight")->shape, (Shape{32, 64}));
  ASSERT_NE(t.find("lm_head.weight"), nullptr);
  // The untied head belongs to the head's site (ZeRO-3: its own unit, the head site's decayed).
  EXPECT_EQ(t.find("lm_head.weight")->site, 2);
  EXPECT_EQ(t.group_of(*t.find("lm_head.weight")), INT32_MAX);
  EXPECT_EQ(t.find("model.norm.weight")->site, 2);
  EXPECT_EQ(t.find("model.layers.0.mlp.down_proj.weight")->site, 0);
  // q|k|v and gate|up are one GEMM weight each: adjacent without padding.
  for (const ParamTable::Layer& y : t.layers) {
    const ParamDesc& q = t.params[y.qkv_w];
    const ParamDesc& k = t.params[y.qkv_w + 1];
    const ParamDesc& v = t.params[y.qkv_w + 2];
    EXPECT_EQ(k.offset, q.offset + q.shape.numel());
    EXPECT_EQ(v.offset, k.offset + k.shape.numel());
    const ParamDesc& g = t.params[y.fc_w];
    const ParamDesc& u = t.params[y.fc_w + 1];
    EXPECT_EQ(u.offset, g.offset + g.shape.numel());
    EXPECT_EQ(u.name.substr(u.name.size() - 14), "up_proj.weight");
  }
  // Tensors never overlap and the decayed ones come first.
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const ParamDesc& p : t.params) {
    spans.push_back({p.offset, p.offset + p.shape.numel()});
    EXPECT_EQ(p.decay, p.offset < t.decay_floats) << p.name;
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); i++) EXPECT_LE(spans[i - 1].second, spans[i].first);
}

}  // namespace
}  // namespace headroom::model
