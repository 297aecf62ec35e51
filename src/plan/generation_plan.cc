// Generation's memory plan (generation_plan.h).
#include "plan/generation_plan.h"

#include <algorithm>

#include "core/check.h"
#include "model/gpt2.h"

namespace headroom::plan {

GenerationShape generation_shape(const model::TransformerConfig& c, int prompt_tokens,
                                 int max_new_tokens, int window) {
  HR_CHECK(prompt_tokens >= 1 && max_new_tokens >= 0 && window >= 0);
  const int64_t history = int64_t(prompt_tokens) + max_new_tokens;
  const int64_t positions = window > 0 ? std::min(window, c.n_positions) : c.n_positions;
  GenerationShape s;
  s.context = int(std::min<int64_t>(positions, history));
  s.rows = history > positions ? s.context : prompt_tokens;
  return s;
}

GenerationPlan plan_generation(const model::TransformerConfig& c, int prompt_tokens,
                               int max_new_tokens, int window) {
  GenerationPlan p;
  p.shape = generation_shape(c, prompt_tokens, max_new_tokens, window);
  p.table = model::decode_table(c, p.shape.context, p.shape.rows);
  p.cache_layout = memory::sequential_layout(p.table.cache);
  p.work_layout = memory::sequential_layout(p.table.work);
  const model::ParamTable params = model::gpt2_param_table(c);
  const std::vector<memory::BufferDesc> weights = {
      {"parameters", DType::kF32, Shape{params.total_floats}, memory::Category::kWeights}};
  p.weights_bytes = memory::sequential_layout(weights).size;
  // One arena per table, tagged as its buffers (Arena::create's category): the cache kv_cache,
  // the work activations.
  p.by_category[size_t(memory::Category::kWeights)] = p.weights_bytes;
  p.by_category[size_t(memory::Category::kKvCache)] = p.cache_layout.size;
  p.by_category[size_t(memory::Category::kActivations)] = p.work_layout.size;
  p.peak_bytes = p.weights_bytes + p.cache_layout.size + p.work_layout.size;
  return p;
}

}  // namespace headroom::plan
