// Saving and loading GPT-2 weights in the Hugging Face layout: a directory with config.json and
// model.safetensors whose tensor names are those of Hugging Face's GPT-2 checkpoints.
#pragma once

#include <string>

#include "core/status.h"
#include "model/config.h"
#include "model/gpt2.h"

namespace headroom::model {

// Writes DIR/config.json and DIR/model.safetensors (F32), each atomically; creates DIR.
Status save_pretrained(const std::string& dir, const Gpt2Config& config, const ParamTable& table,
                       const float* params);

// Loads every parameter of `table` from a safetensors file into the flat buffer `params`.
// Accepts F32, BF16 and F16 tensors; ignores the attention mask buffers that some Hugging Face
// files carry (".attn.bias", ".attn.masked_bias") and a "transformer." name prefix. A missing
// tensor or a wrong shape is an error naming the file, the tensor, and the shapes.
Status load_weights(const std::string& safetensors_path, const ParamTable& table, float* params);

}  // namespace headroom::model
