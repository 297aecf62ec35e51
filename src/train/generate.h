// Autoregressive sampling from a GPT-2 (temperature, top-k). Plans its own inference arena for
// (1, context) from the model's activation table.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/status.h"
#include "memory/resource.h"
#include "model/gpt2.h"

namespace headroom::train {

struct SampleOptions {
  int max_new_tokens = 64;
  float temperature = 1.0f;  // 0 = greedy
  int top_k = 40;            // 0 = the whole vocabulary
  uint64_t seed = 42;
  int32_t stop_token = -1;  // stop after emitting this token (e.g. end of text); -1 = never
  // The context window, tokens: 0 = n_positions. A model trained on sequences shorter than its
  // position table samples within what it was trained on (train's sample passes --seq).
  int window = 0;
};

// Continues `prompt` (at least one token). The context window is the model's n_positions (or
// SampleOptions::window); longer histories keep their last window tokens. `on_token` (optional)
// sees each new token as it is sampled. Allocates its buffers from `resource`.
Result<std::vector<int32_t>> sample_tokens(const model::Gpt2Config& config, const float* params,
                                           const std::vector<int32_t>& prompt,
                                           const SampleOptions& options,
                                           memory::MemoryResource* resource,
                                           const std::function<void(int32_t)>& on_token = {});

}  // namespace headroom::train
