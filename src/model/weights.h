// Saving and loading the transformer's weights in the Hugging Face layout: a directory with
// config.json and model.safetensors (or shards model-0000K-of-0000N.safetensors with
// model.safetensors.index.json), tensor names those of Hugging Face's checkpoints.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"
#include "model/config.h"
#include "model/gpt2.h"

namespace headroom::model {

// Writes DIR/config.json and DIR/model.safetensors (F32), each atomically; creates DIR. With
// max_shard_bytes > 0 and more bytes than that, shards of at most that size (a larger tensor
// alone in its shard) and model.safetensors.index.json instead.
Status save_pretrained(const std::string& dir, const Gpt2Config& config, const ParamTable& table,
                       const float* params, uint64_t max_shard_bytes = 0);

// Loads every parameter of `table` from a safetensors file into the flat buffer `params`.
// Accepts F32, BF16 and F16 tensors; ignores the attention mask buffers that some Hugging Face
// files carry (".attn.bias", ".attn.masked_bias") and a "transformer." name prefix. A missing
// tensor or a wrong shape is an error naming the file, the tensor, and the shapes.
Status load_weights(const std::string& safetensors_path, const ParamTable& table, float* params);
// From a model directory: the shards its model.safetensors.index.json names (weight_map), or
// its model.safetensors. Errors name the index or shard, the tensor, and what is wrong.
Status load_pretrained(const std::string& dir, const ParamTable& table, float* params);

}  // namespace headroom::model
