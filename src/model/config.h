// GPT-2 model configuration: Hugging Face config.json fields and the built-in presets.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace headroom::model {

struct Gpt2Config {
  int n_layer = 0;
  int n_head = 0;
  int n_embd = 0;
  int vocab_size = 0;
  int n_positions = 0;
  float layer_norm_epsilon = 1e-5f;

  int head_size() const { return n_embd / n_head; }
  // Checks the fields against each other; names the field and value that is wrong.
  Status validate() const;
  // Hugging Face config.json text (model_type gpt2).
  std::string to_json() const;
};

// Presets: gpt2-tiny, gpt2 (124M), gpt2-medium, gpt2-large, gpt2-xl.
std::vector<std::string> preset_names();
Result<Gpt2Config> preset_config(const std::string& name);

// Parses a Hugging Face style config.json. Unknown fields are ignored (HF files carry many);
// the required ones (n_layer, n_head, n_embd, vocab_size, n_positions) must be positive integers.
Result<Gpt2Config> parse_config_json(const std::string& text, const std::string& source_name);
Result<Gpt2Config> load_config_file(const std::string& path);

// A preset name, a config.json path, or a directory holding config.json.
Result<Gpt2Config> resolve_model(const std::string& name_or_path);

}  // namespace headroom::model
