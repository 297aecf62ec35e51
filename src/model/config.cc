// GPT-2 configuration parsing and presets.
#include "model/config.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/utf8.h"

namespace headroom::model {

namespace {

// Bounds that keep every size derived from a config inside int64 and the parameter table small
// enough to build: the largest GPT-2 has 48 layers and 1.6B parameters; no transformer trained so
// far has a thousand layers or a trillion parameters in a single model replica.
constexpr int kMaxLayers = 4096;
constexpr int64_t kMaxParameters = int64_t(1) << 40;

// A JSON value for an error message: scalars as written, containers and long strings shortened.
// Never recursive, so a deeply nested value cannot exhaust the stack.
std::string describe(const nlohmann::json& v) {
  if (v.is_array()) return fmt::format("an array of {} elements", v.size());
  if (v.is_object()) return fmt::format("an object of {} fields", v.size());
  std::string text = dump_json(v);
  if (text.size() <= 40) return text;
  size_t n = 37;  // cut at a UTF-8 character boundary: the message may be written as JSON
  while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) n--;
  return text.substr(0, n) + "...";
}

}  // namespace

Status Gpt2Config::validate() const {
  auto positive = [](const char* field, int v) -> Status {
    if (v <= 0) return Status::invalid_argument(fmt::format("{} = {} must be positive", field, v));
    return Status::ok();
  };
  HR_RETURN_IF_ERROR(positive("n_layer", n_layer));
  HR_RETURN_IF_ERROR(positive("n_head", n_head));
  HR_RETURN_IF_ERROR(positive("n_embd", n_embd));
  HR_RETURN_IF_ERROR(positive("vocab_size", vocab_size));
  HR_RETURN_IF_ERROR(positive("n_positions", n_positions));
  if (n_embd % n_head != 0) {
    return Status::invalid_argument(
        fmt::format("n_embd = {} is not divisible by n_head = {}", n_embd, n_head));
  }
  if (!(layer_norm_epsilon > 0 && layer_norm_epsilon < 1)) {
    return Status::invalid_argument(
        fmt::format("layer_norm_epsilon = {} must be in (0, 1)", layer_norm_epsilon));
  }
  if (n_layer > kMaxLayers) {
    return Status::invalid_argument(fmt::format(
        "n_layer = {} is more layers than this build supports ({})", n_layer, kMaxLayers));
  }
  // Keep every activation index in 32 bits for the kernels' int arithmetic.
  if (int64_t(n_embd) * 4 * n_positions > (int64_t(1) << 31)) {
    return Status::invalid_argument(
        fmt::format("n_embd = {} with n_positions = {} is too large for this build (4 x n_embd x "
                    "n_positions must stay within 2^31)",
                    n_embd, n_positions));
  }
  // The parameter count of gpt2_param_table, in 128 bits so that the check cannot overflow.
  const __int128 C = n_embd;
  const __int128 params =
      (__int128(vocab_size) + n_positions + 2) * C + __int128(n_layer) * (12 * C * C + 13 * C);
  if (params > kMaxParameters) {
    return Status::invalid_argument(fmt::format(
        "n_layer = {}, n_embd = {}, vocab_size = {} give more than 2^40 parameters; this build "
        "supports at most 2^40",
        n_layer, n_embd, vocab_size));
  }
  return Status::ok();
}

std::string Gpt2Config::to_json() const {
  nlohmann::ordered_json j;
  j["model_type"] = "gpt2";
  j["architectures"] = {"GPT2LMHeadModel"};
  j["n_layer"] = n_layer;
  j["n_head"] = n_head;
  j["n_embd"] = n_embd;
  j["vocab_size"] = vocab_size;
  j["n_positions"] = n_positions;
  j["n_ctx"] = n_positions;
  j["layer_norm_epsilon"] = layer_norm_epsilon;
  j["activation_function"] = "gelu_new";
  j["tie_word_embeddings"] = true;
  return dump_json(j, 2) + "\n";
}

namespace {
struct Preset {
  const char* name;
  Gpt2Config config;
};
// gpt2-tiny is small enough to train visibly in minutes on two cores.
const Preset kPresets[] = {
    {"gpt2-tiny", {4, 4, 128, 50257, 256, 1e-5f}},
    {"gpt2", {12, 12, 768, 50257, 1024, 1e-5f}},
    {"gpt2-medium", {24, 16, 1024, 50257, 1024, 1e-5f}},
    {"gpt2-large", {36, 20, 1280, 50257, 1024, 1e-5f}},
    {"gpt2-xl", {48, 25, 1600, 50257, 1024, 1e-5f}},
};
}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> v;
  for (const Preset& p : kPresets) v.push_back(p.name);
  return v;
}

Result<Gpt2Config> preset_config(const std::string& name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) return p.config;
  }
  std::string names;
  for (const Preset& p : kPresets) names += std::string(names.empty() ? "" : ", ") + p.name;
  return Status::not_found(
      fmt::format("unknown model '{}': use one of {} or the path of a config.json", name, names));
}

Result<Gpt2Config> parse_config_json(const std::string& text, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return Status::invalid_argument(fmt::format("{}: not valid JSON: {}", source, e.what()));
  }
  if (!j.is_object()) return Status::invalid_argument(source + ": expected a JSON object");
  if (j.contains("model_type") && j["model_type"].is_string() && j["model_type"] != "gpt2") {
    return Status::unsupported(fmt::format("{}: model_type '{}' is not supported (only gpt2)",
                                           source, j["model_type"].get<std::string>()));
  }
  Gpt2Config c;
  auto field = [&](const char* name, const char* alt, int* out) -> Status {
    const char* used = name;
    if (!j.contains(name) && alt && j.contains(alt)) used = alt;
    if (!j.contains(used)) {
      return Status::invalid_argument(fmt::format("{}: missing field '{}'", source, name));
    }
    const nlohmann::json& v = j[used];
    // is_number_unsigned: a negative or an over-large value never reaches the int64 conversion.
    if (!v.is_number_unsigned() || v.get<uint64_t>() == 0 || v.get<uint64_t>() > (1u << 30)) {
      return Status::invalid_argument(
          fmt::format("{}: field '{}' = {} must be a positive integer (at most 2^30)", source, used,
                      describe(v)));
    }
    *out = v.get<int>();
    return Status::ok();
  };
  HR_RETURN_IF_ERROR(field("n_layer", "num_hidden_layers", &c.n_layer));
  HR_RETURN_IF_ERROR(field("n_head", "num_attention_heads", &c.n_head));
  HR_RETURN_IF_ERROR(field("n_embd", "hidden_size", &c.n_embd));
  HR_RETURN_IF_ERROR(field("vocab_size", nullptr, &c.vocab_size));
  HR_RETURN_IF_ERROR(field("n_positions", "n_ctx", &c.n_positions));
  if (j.contains("layer_norm_epsilon")) {
    const nlohmann::json& v = j["layer_norm_epsilon"];
    // Checked as a double: a value outside float's range must not reach the float conversion.
    const double eps = v.is_number() ? v.get<double>() : 0;
    if (!v.is_number() || !(eps > 0 && eps < 1) || float(eps) == 0) {
      return Status::invalid_argument(fmt::format(
          "{}: field 'layer_norm_epsilon' = {} must be a number in (0, 1)", source, describe(v)));
    }
    c.layer_norm_epsilon = float(eps);
  }
  if (j.contains("activation_function") && j["activation_function"].is_string()) {
    std::string act = j["activation_function"];
    if (act != "gelu_new" && act != "gelu_pytorch_tanh") {
      return Status::unsupported(
          fmt::format("{}: activation_function '{}' is not supported (gelu_new, the tanh GELU, is)",
                      source, act));
    }
  }
  Status s = c.validate();
  if (!s.is_ok()) return s.with_context(source);
  return c;
}

Result<Gpt2Config> load_config_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return Status::not_found(fmt::format("cannot open model config '{}'", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_config_json(ss.str(), path);
}

Result<Gpt2Config> resolve_model(const std::string& name_or_path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(name_or_path, ec)) {
    return load_config_file((fs::path(name_or_path) / "config.json").string());
  }
  if (fs::exists(name_or_path, ec) || name_or_path.ends_with(".json")) {
    return load_config_file(name_or_path);
  }
  return preset_config(name_or_path);
}

}  // namespace headroom::model
