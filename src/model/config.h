// The decoder-only transformer's configuration: its architecture (GPT-2 and the Llama family are
// two settings of the same fields), Hugging Face config.json fields, and the built-in presets.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace headroom::model {

enum class NormKind : uint8_t { kLayerNorm, kRmsNorm };  // LayerNorm with bias | RMSNorm
enum class PositionKind : uint8_t { kLearned, kRope };   // wpe table | rotary embeddings
enum class MlpKind : uint8_t { kGelu, kSwiGlu };         // fc-GELU-proj | down(silu(gate) * up)

// Rotary embeddings' frequency scaling (config.json's rope_scaling): none, or Llama 3's.
struct RopeScalingConfig {
  enum class Kind : uint8_t { kNone, kLlama3 } kind = Kind::kNone;
  float factor = 1, low_freq_factor = 1, high_freq_factor = 4;
  int original_max_position_embeddings = 8192;
  bool operator==(const RopeScalingConfig&) const = default;
};

struct TransformerConfig {
  // The first six fields are GPT-2's (the presets initialise them in this order).
  int n_layer = 0;
  int n_head = 0;
  int n_embd = 0;
  int vocab_size = 0;
  int n_positions = 0;
  float layer_norm_epsilon = 1e-5f;  // LayerNorm's or RMSNorm's eps

  // The architecture; the defaults are GPT-2's.
  std::string model_type = "gpt2";  // gpt2 | llama | mistral | qwen2 (what config.json says)
  NormKind norm = NormKind::kLayerNorm;
  PositionKind positions = PositionKind::kLearned;
  MlpKind mlp = MlpKind::kGelu;
  int n_kv_head = 0;          // key/value heads (grouped-query attention); 0: n_head
  int intermediate_size = 0;  // the MLP's width; 0: 4 n_embd
  // Each attention head's width; 0: n_embd / n_head. Explicit where the attention is not
  // n_embd wide (config.json's head_dim; a model whose heads were pruned): the attention's width
  // A = n_head x head_dim is then the q projection's output and the output projection's input,
  // while the residual stream stays n_embd wide (Note [Attention width] in docs/notes/pruning.md).
  int head_dim = 0;
  bool qkv_bias = true;    // biases on the q, k, v projections
  bool other_bias = true;  // biases on the output projections and the MLP (and LayerNorm)
  bool tied_head = true;   // the LM head is the token embedding
  float rope_theta = 10000.0f;
  RopeScalingConfig rope_scaling;

  int head_size() const { return head_dim > 0 ? head_dim : n_embd / n_head; }
  int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  // The attention's width A = n_head x head_size: the attention's output [B, T, A] and the output
  // projection's input (n_embd unless head_dim says otherwise).
  int64_t attn_width() const { return int64_t(n_head) * head_size(); }
  // Sets head_dim, as 0 where it is the default n_embd / n_head (so configs compare equal
  // however the head size was given).
  void set_head_dim(int hd) { head_dim = n_head > 0 && int64_t(hd) * n_head == n_embd ? 0 : hd; }
  int64_t mlp_width() const {
    return intermediate_size > 0 ? intermediate_size : 4 * int64_t(n_embd);
  }
  // Columns of the fused q | k | v projection's output: (n_head + 2 kv_heads) head_size.
  int64_t qkv_width() const { return (int64_t(n_head) + 2 * int64_t(kv_heads())) * head_size(); }
  // Columns of the MLP's first GEMM: its width (GELU), or gate | up (SwiGLU).
  int64_t fc_width() const { return mlp == MlpKind::kSwiGlu ? 2 * mlp_width() : mlp_width(); }
  bool is_gpt2() const { return model_type == "gpt2"; }
  // Parameters of one block and of the whole model (gpt2_param_table's count, padding excluded).
  int64_t block_parameters() const;
  int64_t num_parameters() const;
  // Weights of one block's GEMMs (12 C^2 in GPT-2), and of the position table (0 with RoPE).
  int64_t block_gemm_weights() const {
    return int64_t(n_embd) * (qkv_width() + attn_width() + fc_width() + mlp_width());
  }
  int64_t position_parameters() const {
    return positions == PositionKind::kLearned ? int64_t(n_positions) * n_embd : 0;
  }
  // Parameters that a token only looks up (no FLOPs): the position table, and the token table
  // when the head is untied (tied, its FLOPs are the head's).
  int64_t lookup_parameters() const {
    return position_parameters() + (tied_head ? 0 : int64_t(vocab_size) * n_embd);
  }

  // Checks the fields against each other; names the field and value that is wrong.
  Status validate() const;
  // Whether sequences of `seq` tokens keep every activation index within the kernels' 32 bits.
  Status check_seq(int seq) const;
  // Hugging Face config.json text (model_type gpt2, or llama / mistral / qwen2).
  std::string to_json() const;
  bool operator==(const TransformerConfig&) const = default;
};
// GPT-2 is one configuration of the transformer; the name stays for the code written for it.
using Gpt2Config = TransformerConfig;

// Presets: gpt2-tiny, gpt2 (124M), gpt2-medium, gpt2-large, gpt2-xl, llama-tiny.
std::vector<std::string> preset_names();
Result<TransformerConfig> preset_config(const std::string& name);
// The tokenizer a preset trains with when none is given: "bytes" for bytes-tiny
// (data/byte_tokenizer.h), "" (GPT-2's) for the others and for anything that is not a preset.
std::string preset_tokenizer(const std::string& name);
// What `train` uses for a preset when the flags leave it unset: bytes-tiny's are measured for the
// first run (docs/notes/first-run.md); every other model gets the general defaults.
struct RunDefaults {
  int steps = 200;
  float lr = 0;            // 0: by size (1e-3 under 50M parameters, else 6e-4)
  int global_batch = 0;    // sequences a step; 0: the planner's micro-batch, no accumulation
  int sample_tokens = 48;  // the sample printed at the end
  // A time budget in minutes that bounds `steps` when neither --steps nor --minutes is given
  // (train --minutes: the count is fixed after the first steps); 0: none.
  double minutes = 0;
};
RunDefaults preset_run_defaults(const std::string& name);

// Parses a Hugging Face style config.json: model_type gpt2 (the default when absent), llama,
// mistral or qwen2. Unknown fields are ignored (HF files carry many); the required ones must be
// positive integers; a setting headroom does not implement (another activation, MLP biases, a
// rope_scaling type, ...) is refused with the field and value. head_dim is read for
// both families (GPT-2's is headroom's own field: Hugging Face's GPT2Config has none).
Result<TransformerConfig> parse_config_json(const std::string& text,
                                            const std::string& source_name);
Result<TransformerConfig> load_config_file(const std::string& path);

// A preset name, a config.json path, or a directory holding config.json.
Result<TransformerConfig> resolve_model(const std::string& name_or_path);

}  // namespace headroom::model
