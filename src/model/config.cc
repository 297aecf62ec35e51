// Transformer configuration parsing and presets.
#include "model/config.h"

#include <fmt/format.h>

#include <algorithm>
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

int64_t TransformerConfig::block_parameters() const {
  const int64_t C = n_embd, norm_params = norm == NormKind::kLayerNorm ? 2 * C : C;
  const int64_t q = qkv_width(), f = fc_width();
  return 2 * norm_params + C * q + (qkv_bias ? q : 0) + attn_width() * C + C * f +
         int64_t(mlp_width()) * C + (other_bias ? C + f + C : 0);
}

int64_t TransformerConfig::num_parameters() const {
  const int64_t C = n_embd;
  return int64_t(vocab_size) * C * (tied_head ? 1 : 2) +
         (positions == PositionKind::kLearned ? int64_t(n_positions) * C : 0) +
         int64_t(n_layer) * block_parameters() + (norm == NormKind::kLayerNorm ? 2 * C : C);
}

Status TransformerConfig::validate() const {
  auto positive = [](const char* field, int v) -> Status {
    if (v <= 0) return Status::invalid_argument(fmt::format("{} = {} must be positive", field, v));
    return Status::ok();
  };
  HR_RETURN_IF_ERROR(positive("n_layer", n_layer));
  HR_RETURN_IF_ERROR(positive("n_head", n_head));
  HR_RETURN_IF_ERROR(positive("n_embd", n_embd));
  HR_RETURN_IF_ERROR(positive("vocab_size", vocab_size));
  HR_RETURN_IF_ERROR(positive("n_positions", n_positions));
  if (n_kv_head < 0) {
    return Status::invalid_argument(
        fmt::format("num_key_value_heads = {} must be positive", n_kv_head));
  }
  if (intermediate_size < 0) {
    return Status::invalid_argument(
        fmt::format("intermediate_size = {} must be positive", intermediate_size));
  }
  if (head_dim < 0) {
    return Status::invalid_argument(fmt::format("head_dim = {} must be positive", head_dim));
  }
  if (head_dim == 0 && n_embd % n_head != 0) {
    return Status::invalid_argument(fmt::format(
        "n_embd = {} is not divisible by n_head = {} (give head_dim for another head size)", n_embd,
        n_head));
  }
  if (n_head % kv_heads() != 0) {
    return Status::invalid_argument(
        fmt::format("num_attention_heads = {} is not a multiple of num_key_value_heads = {}",
                    n_head, kv_heads()));
  }
  if (positions == PositionKind::kRope && head_size() % 2 != 0) {
    return Status::invalid_argument(fmt::format(
        "head size {} (head_dim, or hidden_size / num_attention_heads) must be even for rotary "
        "embeddings",
        head_size()));
  }
  if (!(layer_norm_epsilon > 0 && layer_norm_epsilon < 1)) {
    return Status::invalid_argument(
        fmt::format("layer_norm_epsilon = {} must be in (0, 1)", layer_norm_epsilon));
  }
  if (positions == PositionKind::kRope && !(rope_theta > 1)) {
    return Status::invalid_argument(fmt::format("rope_theta = {} must be > 1", rope_theta));
  }
  if (n_layer > kMaxLayers) {
    return Status::invalid_argument(fmt::format(
        "n_layer = {} is more layers than this build supports ({})", n_layer, kMaxLayers));
  }
  // Keep every activation index in 32 bits for the kernels' int arithmetic: GPT-2 trains at its
  // n_positions; the Llama family's (up to 131072) is a capability, checked per sequence length
  // (check_seq).
  if (is_gpt2() && !check_seq(n_positions).is_ok()) {
    return Status::invalid_argument(
        fmt::format("n_embd = {} with n_positions = {} is too large for this build (4 x n_embd x "
                    "n_positions must stay within 2^31)",
                    n_embd, n_positions));
  }
  // The parameter count, in 128 bits so that the check cannot overflow.
  const __int128 C = n_embd;
  const __int128 params =
      (__int128(vocab_size) * 2 + n_positions + 2) * C +
      __int128(n_layer) * (C * (qkv_width() + attn_width() + fc_width() + mlp_width()) + 4 * C +
                           qkv_width() + fc_width());
  if (params > kMaxParameters) {
    return Status::invalid_argument(fmt::format(
        "n_layer = {}, n_embd = {}, vocab_size = {} give more than 2^40 parameters; this build "
        "supports at most 2^40",
        n_layer, n_embd, vocab_size));
  }
  if (mlp_width() > (int64_t(1) << 30)) {
    return Status::invalid_argument(
        fmt::format("n_embd = {} gives an MLP width of {}, more than 2^30", n_embd, mlp_width()));
  }
  // The attention's widths stay within the kernels' int arithmetic, as the MLP's do.
  if (qkv_width() > (int64_t(1) << 30)) {
    return Status::invalid_argument(fmt::format(
        "n_head = {} x head_dim = {} gives an attention wider than 2^30", n_head, head_size()));
  }
  return Status::ok();
}

Status TransformerConfig::check_seq(int seq) const {
  const int64_t widest = std::max<int64_t>({fc_width(), qkv_width(), 4 * int64_t(n_embd)});
  if (widest * seq > (int64_t(1) << 31)) {
    return Status::invalid_argument(
        fmt::format("n_embd = {} with sequence length {} is too large for this build (the widest "
                    "activation row, {} wide, times the sequence length must stay within 2^31)",
                    n_embd, seq, widest));
  }
  return Status::ok();
}

std::string TransformerConfig::to_json() const {
  nlohmann::ordered_json j;
  j["model_type"] = model_type;
  if (is_gpt2()) {
    j["architectures"] = {"GPT2LMHeadModel"};
    j["n_layer"] = n_layer;
    j["n_head"] = n_head;
    j["n_embd"] = n_embd;
    j["vocab_size"] = vocab_size;
    j["n_positions"] = n_positions;
    j["n_ctx"] = n_positions;
    j["layer_norm_epsilon"] = layer_norm_epsilon;
    // Hugging Face's GPT-2 reads the MLP's width from n_inner (null: 4 n_embd); written only
    // when it is not 4 n_embd (a pruned MLP), so that unpruned configs stay as they were.
    if (mlp_width() != 4 * int64_t(n_embd)) j["n_inner"] = mlp_width();
    // The head size when it is not n_embd / n_head (pruned heads): headroom's own field, which
    // Hugging Face's GPT2Config ignores (its GPT-2 derives head_dim and would refuse the smaller
    // c_attn / c_proj tensors). Absent otherwise, so that unpruned configs stay as they were.
    if (head_dim > 0) j["head_dim"] = head_dim;
    j["activation_function"] = "gelu_new";
    j["tie_word_embeddings"] = true;
    return dump_json(j, 2) + "\n";
  }
  const char* arch = model_type == "mistral" ? "MistralForCausalLM"
                     : model_type == "qwen2" ? "Qwen2ForCausalLM"
                                             : "LlamaForCausalLM";
  j["architectures"] = {arch};
  j["hidden_size"] = n_embd;
  j["intermediate_size"] = mlp_width();
  j["num_hidden_layers"] = n_layer;
  j["num_attention_heads"] = n_head;
  j["num_key_value_heads"] = kv_heads();
  j["head_dim"] = head_size();
  j["vocab_size"] = vocab_size;
  j["max_position_embeddings"] = n_positions;
  j["rms_norm_eps"] = layer_norm_epsilon;
  j["rope_theta"] = rope_theta;
  if (rope_scaling.kind == RopeScalingConfig::Kind::kLlama3) {
    j["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", rope_scaling.factor},
        {"low_freq_factor", rope_scaling.low_freq_factor},
        {"high_freq_factor", rope_scaling.high_freq_factor},
        {"original_max_position_embeddings", rope_scaling.original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = tied_head;
  if (model_type != "qwen2") {
    j["attention_bias"] = qkv_bias;
    j["mlp_bias"] = false;
  }
  j["torch_dtype"] = "float32";
  return dump_json(j, 2) + "\n";
}

namespace {
struct Preset {
  const char* name;
  TransformerConfig config;
};
TransformerConfig llama_family(TransformerConfig c, std::string type) {
  c.model_type = std::move(type);
  c.norm = NormKind::kRmsNorm;
  c.positions = PositionKind::kRope;
  c.mlp = MlpKind::kSwiGlu;
  c.qkv_bias = c.other_bias = false;
  return c;
}
TransformerConfig llama_tiny() {
  // A Llama with grouped-query attention small enough to train in minutes on two cores.
  TransformerConfig c = llama_family({4, 4, 128, 50257, 256, 1e-5f}, "llama");
  c.n_kv_head = 2;
  c.intermediate_size = 352;
  c.tied_head = true;
  return c;
}
// gpt2-tiny is small enough to train visibly in minutes on two cores.
const Preset kPresets[] = {
    {"gpt2-tiny", {4, 4, 128, 50257, 256, 1e-5f}},
    {"gpt2", {12, 12, 768, 50257, 1024, 1e-5f}},
    {"gpt2-medium", {24, 16, 1024, 50257, 1024, 1e-5f}},
    {"gpt2-large", {36, 20, 1280, 50257, 1024, 1e-5f}},
    {"gpt2-xl", {48, 25, 1600, 50257, 1024, 1e-5f}},
    {"llama-tiny", llama_tiny()},
    // The byte tokenizer's model (data/byte_tokenizer.h): vocabulary 257, so its FLOPs go to the
    // blocks, not to the LM head; 128 positions, the length it trains at, so that `generate`
    // slides a window of trained positions (docs/notes/first-run.md).
    {"bytes-tiny", {4, 4, 128, 257, 128, 1e-5f}},
};
}  // namespace

std::string preset_tokenizer(const std::string& name) {
  return name == "bytes-tiny" ? "bytes" : "";
}

RunDefaults preset_run_defaults(const std::string& name) {
  // bytes-tiny: 3000 steps of 16 x 128 bytes (6.1M bytes, about 2.5 passes over the fortunes) at
  // lr 3e-3, in about 100 s on two quiet cores; on a slower or busier host, as many as 3 minutes
  // allow (docs/notes/first-run.md).
  if (name == "bytes-tiny")
    return {.steps = 3000, .lr = 3e-3f, .global_batch = 16, .sample_tokens = 320, .minutes = 3};
  return {};
}

std::vector<std::string> preset_names() {
  std::vector<std::string> v;
  for (const Preset& p : kPresets) v.push_back(p.name);
  return v;
}

Result<TransformerConfig> preset_config(const std::string& name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) return p.config;
  }
  std::string names;
  for (const Preset& p : kPresets) names += std::string(names.empty() ? "" : ", ") + p.name;
  return Status::not_found(
      fmt::format("unknown model '{}': use one of {} or the path of a config.json", name, names));
}

namespace {

// Reads config.json fields with errors that name the file, the field and its value.
struct Fields {
  const nlohmann::json& j;
  const std::string& source;

  bool has(const char* name) const { return j.contains(name) && !j[name].is_null(); }
  Status integer(const char* name, const char* alt, int* out, bool required = true) const {
    const char* used = name;
    if (!has(name) && alt && has(alt)) used = alt;
    if (!has(used)) {
      if (!required) return Status::ok();
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
  }
  // A number in (lo, hi), checked as a double: a value outside float's range must not reach the
  // float conversion.
  Status number(const nlohmann::json& v, const std::string& name, double lo, double hi,
                float* out) const {
    const double x = v.is_number() ? v.get<double>() : 0;
    if (!v.is_number() || !(x > lo && x < hi) || (x != 0 && float(x) == 0)) {
      return Status::invalid_argument(fmt::format(
          "{}: field '{}' = {} must be a number in ({}, {})", source, name, describe(v), lo, hi));
    }
    *out = float(x);
    return Status::ok();
  }
  Status boolean(const char* name, bool* out) const {
    if (!has(name)) return Status::ok();
    if (!j[name].is_boolean()) {
      return Status::invalid_argument(fmt::format("{}: field '{}' = {} must be true or false",
                                                  source, name, describe(j[name])));
    }
    *out = j[name].get<bool>();
    return Status::ok();
  }
};

Status parse_gpt2(const Fields& f, TransformerConfig* c) {
  HR_RETURN_IF_ERROR(f.integer("n_layer", "num_hidden_layers", &c->n_layer));
  HR_RETURN_IF_ERROR(f.integer("n_head", "num_attention_heads", &c->n_head));
  HR_RETURN_IF_ERROR(f.integer("n_embd", "hidden_size", &c->n_embd));
  HR_RETURN_IF_ERROR(f.integer("vocab_size", nullptr, &c->vocab_size));
  HR_RETURN_IF_ERROR(f.integer("n_positions", "n_ctx", &c->n_positions));
  // n_inner: the MLP's width (absent or null: 4 n_embd), as Hugging Face's GPT2Config.
  HR_RETURN_IF_ERROR(f.integer("n_inner", nullptr, &c->intermediate_size, /*required=*/false));
  if (c->intermediate_size == 4 * c->n_embd) c->intermediate_size = 0;  // the default, spelt out
  int hd = 0;
  HR_RETURN_IF_ERROR(f.integer("head_dim", nullptr, &hd, /*required=*/false));
  c->set_head_dim(hd);
  if (f.j.contains("layer_norm_epsilon")) {
    HR_RETURN_IF_ERROR(
        f.number(f.j["layer_norm_epsilon"], "layer_norm_epsilon", 0, 1, &c->layer_norm_epsilon));
  }
  if (f.j.contains("activation_function") && f.j["activation_function"].is_string()) {
    std::string act = f.j["activation_function"];
    if (act != "gelu_new" && act != "gelu_pytorch_tanh") {
      return Status::unsupported(
          fmt::format("{}: activation_function '{}' is not supported (gelu_new, the tanh GELU, is)",
                      f.source, act));
    }
  }
  return Status::ok();
}

// Llama, Mistral and Qwen2: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.
Status parse_llama_family(const Fields& f, const std::string& type, TransformerConfig* c) {
  *c = llama_family(*c, type);
  const std::string& src = f.source;
  HR_RETURN_IF_ERROR(f.integer("num_hidden_layers", nullptr, &c->n_layer));
  HR_RETURN_IF_ERROR(f.integer("num_attention_heads", nullptr, &c->n_head));
  HR_RETURN_IF_ERROR(f.integer("hidden_size", nullptr, &c->n_embd));
  HR_RETURN_IF_ERROR(f.integer("intermediate_size", nullptr, &c->intermediate_size));
  HR_RETURN_IF_ERROR(f.integer("vocab_size", nullptr, &c->vocab_size));
  HR_RETURN_IF_ERROR(f.integer("max_position_embeddings", nullptr, &c->n_positions));
  c->n_kv_head = c->n_head;
  HR_RETURN_IF_ERROR(f.integer("num_key_value_heads", nullptr, &c->n_kv_head, false));
  // head_dim (absent or null: hidden_size / num_attention_heads, as transformers' LlamaConfig);
  // another value makes the attention n_head x head_dim wide (Note [Attention width]).
  int hd = 0;
  HR_RETURN_IF_ERROR(f.integer("head_dim", nullptr, &hd, /*required=*/false));
  c->set_head_dim(hd);
  c->layer_norm_epsilon = 1e-6f;  // transformers' LlamaConfig default
  if (f.has("rms_norm_eps")) {
    HR_RETURN_IF_ERROR(f.number(f.j["rms_norm_eps"], "rms_norm_eps", 0, 1, &c->layer_norm_epsilon));
  }
  if (f.has("rope_theta")) {
    HR_RETURN_IF_ERROR(f.number(f.j["rope_theta"], "rope_theta", 1, 1e12, &c->rope_theta));
  }
  if (f.has("rope_scaling")) {
    const nlohmann::json& rs = f.j["rope_scaling"];
    if (!rs.is_object()) {
      return Status::invalid_argument(fmt::format(
          "{}: field 'rope_scaling' = {} must be an object or null", src, describe(rs)));
    }
    std::string kind;
    for (const char* k : {"rope_type", "type"}) {
      if (rs.contains(k) && rs[k].is_string()) kind = rs[k].get<std::string>();
    }
    if (kind == "default" || kind.empty()) {
      // no scaling
    } else if (kind == "llama3") {
      RopeScalingConfig& s = c->rope_scaling;
      s.kind = RopeScalingConfig::Kind::kLlama3;
      auto num = [&](const char* name, float* out) -> Status {
        if (!rs.contains(name)) {
          return Status::invalid_argument(
              fmt::format("{}: field 'rope_scaling.{}' is missing (llama3 needs it)", src, name));
        }
        return f.number(rs[name], std::string("rope_scaling.") + name, 0, 1e6, out);
      };
      HR_RETURN_IF_ERROR(num("factor", &s.factor));
      HR_RETURN_IF_ERROR(num("low_freq_factor", &s.low_freq_factor));
      HR_RETURN_IF_ERROR(num("high_freq_factor", &s.high_freq_factor));
      Fields sub{rs, src};
      HR_RETURN_IF_ERROR(sub.integer("original_max_position_embeddings", nullptr,
                                     &s.original_max_position_embeddings));
      if (!(s.high_freq_factor > s.low_freq_factor)) {
        return Status::invalid_argument(
            fmt::format("{}: rope_scaling.high_freq_factor = {} must exceed low_freq_factor = {}",
                        src, s.high_freq_factor, s.low_freq_factor));
      }
    } else {
      return Status::unsupported(fmt::format(
          "{}: field 'rope_scaling.rope_type' = \"{}\" is not supported (none and \"llama3\" are)",
          src, kind));
    }
  }
  if (f.has("hidden_act")) {
    const nlohmann::json& a = f.j["hidden_act"];
    if (!a.is_string() || a.get<std::string>() != "silu") {
      return Status::unsupported(fmt::format(
          "{}: field 'hidden_act' = {} is not supported (\"silu\", SwiGLU, is)", src, describe(a)));
    }
  }
  // transformers' defaults: Llama and Mistral untied, no biases; Qwen2 has q, k, v biases.
  c->tied_head = false;
  HR_RETURN_IF_ERROR(f.boolean("tie_word_embeddings", &c->tied_head));
  c->qkv_bias = type == "qwen2";
  HR_RETURN_IF_ERROR(f.boolean("attention_bias", &c->qkv_bias));
  bool mlp_bias = false;
  HR_RETURN_IF_ERROR(f.boolean("mlp_bias", &mlp_bias));
  if (mlp_bias) {
    return Status::unsupported(fmt::format(
        "{}: field 'mlp_bias' = true is not supported (Llama-family MLPs have no biases)", src));
  }
  // Sliding-window attention equals full causal attention over windows at least as long as the
  // sequence: such a model trains here with its context capped at the window.
  bool use_window = type != "qwen2";
  HR_RETURN_IF_ERROR(f.boolean("use_sliding_window", &use_window));
  if (use_window && f.has("sliding_window")) {
    int window = 0;
    HR_RETURN_IF_ERROR(f.integer("sliding_window", nullptr, &window));
    c->n_positions = std::min(c->n_positions, window);
  }
  return Status::ok();
}

}  // namespace

Result<TransformerConfig> parse_config_json(const std::string& text, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return Status::invalid_argument(fmt::format("{}: not valid JSON: {}", source, e.what()));
  }
  if (!j.is_object()) return Status::invalid_argument(source + ": expected a JSON object");
  std::string type = "gpt2";
  if (j.contains("model_type")) {
    if (!j["model_type"].is_string()) {
      return Status::invalid_argument(fmt::format("{}: field 'model_type' = {} must be a string",
                                                  source, describe(j["model_type"])));
    }
    type = j["model_type"].get<std::string>();
  }
  TransformerConfig c;
  const Fields f{j, source};
  if (type == "gpt2") {
    HR_RETURN_IF_ERROR(parse_gpt2(f, &c));
  } else if (type == "llama" || type == "mistral" || type == "qwen2") {
    HR_RETURN_IF_ERROR(parse_llama_family(f, type, &c));
  } else {
    std::string shown = describe(j["model_type"]);
    return Status::unsupported(fmt::format(
        "{}: field 'model_type' = {} is not supported (gpt2, llama, mistral and qwen2 are)", source,
        shown));
  }
  Status s = c.validate();
  if (!s.is_ok()) return s.with_context(source);
  return c;
}

Result<TransformerConfig> load_config_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return Status::not_found(fmt::format("cannot open model config '{}'", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_config_json(ss.str(), path);
}

Result<TransformerConfig> resolve_model(const std::string& name_or_path) {
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
