// The memory of generation (headroom generate, and the sample at the end of training): the
// weights, the KV cache and one pass's working buffers, planned before the first token as
// everything else (docs/notes/generation.md).
#pragma once

#include <array>
#include <cstdint>

#include "memory/arena.h"
#include "memory/resource.h"
#include "model/config.h"
#include "model/decode.h"

namespace headroom::plan {

// The cache's positions and a pass's rows for a prompt of `prompt_tokens` and `max_new_tokens`
// to sample: the context is the model's window (n_positions) or less when the whole history
// fits; a pass holds the prompt's prefill, or the whole window when the history outgrows it (the
// window then slides: every later token refills the cache from the last n_positions tokens,
// whose positions have shifted).
struct GenerationShape {
  int context = 0, rows = 0;
};
// `window` > 0 caps the context below n_positions (a model trained on shorter sequences than
// its position table: positions past them were never trained).
GenerationShape generation_shape(const model::TransformerConfig& config, int prompt_tokens,
                                 int max_new_tokens, int window = 0);

struct GenerationPlan {
  GenerationShape shape;
  model::DecodeTable table;
  memory::Layout cache_layout, work_layout;  // sequential, as the arenas are made
  uint64_t weights_bytes = 0;                // the fp32 parameter buffer
  std::array<uint64_t, memory::kNumCategories> by_category{};
  uint64_t peak_bytes = 0;  // weights + cache + work: everything is live for the whole run
};
// REQUIRES: prompt_tokens >= 1, max_new_tokens >= 0.
GenerationPlan plan_generation(const model::TransformerConfig& config, int prompt_tokens,
                               int max_new_tokens, int window = 0);

}  // namespace headroom::plan
