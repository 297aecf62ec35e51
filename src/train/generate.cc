// Sampling loop: the prompt through the model once (filling the KV cache), then one pass per
// sampled token over the cache; temperature and top-k on the last position's logits.
#include "train/generate.h"

#include <algorithm>
#include <cmath>
#include <random>

#include <fmt/format.h>

#include "model/decode.h"
#include "plan/generation_plan.h"

namespace headroom::train {

Result<std::vector<int32_t>> sample_tokens(const model::Gpt2Config& config, const float* params,
                                           const std::vector<int32_t>& prompt,
                                           const SampleOptions& o, memory::MemoryResource* resource,
                                           const std::function<void(int32_t)>& on_token) {
  if (prompt.empty())
    return Status::invalid_argument("the prompt is empty: give at least one token");
  if (o.max_new_tokens < 0) {
    return Status::invalid_argument(
        fmt::format("--max-new-tokens {} is negative", o.max_new_tokens));
  }
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature)) {
    return Status::invalid_argument(fmt::format("--temperature {} must be >= 0", o.temperature));
  }
  if (o.top_k < 0) return Status::invalid_argument(fmt::format("--top-k {} is negative", o.top_k));
  for (int32_t t : prompt) {
    if (t < 0 || t >= config.vocab_size) {
      return Status::invalid_argument(
          fmt::format("prompt token {} is outside the vocabulary [0, {})", t, config.vocab_size));
    }
  }
  if (o.window < 0) return Status::invalid_argument(fmt::format("window {} is negative", o.window));
  const int positions = o.window > 0 ? std::min(o.window, config.n_positions) : config.n_positions;
  const int P = int(std::min<size_t>(prompt.size(), size_t(positions)));
  const plan::GenerationPlan gp = plan::plan_generation(config, P, o.max_new_tokens, positions);
  const int window = gp.shape.context;
  const model::ParamTable table = model::gpt2_param_table(config);
  HR_ASSIGN_OR_RETURN(
      memory::Arena cache,
      memory::Arena::create(resource, gp.table.cache, gp.cache_layout, memory::Category::kKvCache));
  HR_ASSIGN_OR_RETURN(memory::Arena work,
                      memory::Arena::create(resource, gp.table.work, gp.work_layout,
                                            memory::Category::kActivations));
  model::Decoder net(config, &table, params, &gp.table, &cache, &work);

  std::vector<int32_t> tokens = prompt;
  std::vector<int32_t> out;
  std::mt19937_64 rng(o.seed);
  std::vector<std::pair<float, int32_t>> cand;
  const int V = config.vocab_size;
  // The window's last tokens: the prompt's at first, and again each time the history outgrows
  // the window (positions shift, so the cache is refilled).
  auto refill = [&] {
    const int len = std::min<int>(int(tokens.size()), window);
    return net.prefill(tokens.data() + tokens.size() - size_t(len), len);
  };
  const float* logits = o.max_new_tokens > 0 ? refill() : nullptr;
  for (int i = 0; i < o.max_new_tokens; i++) {
    if (i > 0) logits = net.position() < window ? net.step(tokens.back()) : refill();
    int32_t next = 0;
    if (o.temperature == 0) {
      next = int32_t(std::max_element(logits, logits + V) - logits);
    } else {
      cand.clear();
      for (int v = 0; v < V; v++) cand.push_back({logits[v] / o.temperature, v});
      int k = (o.top_k > 0 && o.top_k < V) ? o.top_k : V;
      std::partial_sort(cand.begin(), cand.begin() + k, cand.end(),
                        [](auto& a, auto& b) { return a.first > b.first; });
      double mx = cand[0].first, sum = 0;
      for (int j = 0; j < k; j++) sum += std::exp(double(cand[size_t(j)].first) - mx);
      double r = std::uniform_real_distribution<double>(0.0, sum)(rng), acc = 0;
      next = cand[size_t(k - 1)].second;
      for (int j = 0; j < k; j++) {
        acc += std::exp(double(cand[size_t(j)].first) - mx);
        if (r < acc) {
          next = cand[size_t(j)].second;
          break;
        }
      }
    }
    tokens.push_back(next);
    out.push_back(next);
    if (on_token) on_token(next);
    if (next == o.stop_token) break;
  }
  return out;
}

}  // namespace headroom::train
