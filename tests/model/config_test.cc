// The config.json parser: Hugging Face spellings are read, and malformed input (including the
// cases the fuzzer found, docs/notes/fuzzing.md) is an error naming the file, the field and the
// value, never a crash, an undefined conversion or an unbounded allocation.
#include "model/config.h"

#include <gtest/gtest.h>

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
  expect_refused(with_field("model_type", "\"llama\""), {"model_type 'llama'"});
  expect_refused(with_field("activation_function", "\"relu\""), {"activation_function 'relu'"});
}

}  // namespace
}  // namespace headroom::model
