// Sampling loop: a full forward over the current window per token (no KV cache yet; the models
// trained here are small), then temperature and top-k on the last position's logits.
#include "train/generate.h"

#include <algorithm>
#include <cmath>
#include <random>

#include <fmt/format.h>

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
  const int window = std::min<int>(config.n_positions, int(prompt.size()) + o.max_new_tokens);
  const model::ParamTable table = model::gpt2_param_table(config);
  const model::ActivationTable acts =
      model::gpt2_activation_table(config, 1, std::max(window, 1), /*training=*/false,
                                   model::ExecOptions{});  // plain head: sampling reads logits
  memory::Layout layout = memory::sequential_layout(acts.buffers);
  HR_ASSIGN_OR_RETURN(memory::Arena arena,
                      memory::Arena::create(resource, acts.buffers, std::move(layout),
                                            memory::Category::kActivations));
  model::Gpt2 net(config, &table);
  net.bind_params(const_cast<float*>(params), nullptr);  // forward only: never written
  net.bind_activations(&arena, &acts, 1, window);

  std::vector<int32_t> tokens = prompt;
  std::vector<int32_t> out;
  std::mt19937_64 rng(o.seed);
  std::vector<std::pair<float, int32_t>> cand;
  const int V = config.vocab_size;
  for (int i = 0; i < o.max_new_tokens; i++) {
    const int len = std::min<int>(int(tokens.size()), window);
    const int32_t* ctx = tokens.data() + tokens.size() - size_t(len);
    net.forward(ctx, nullptr, nullptr, len);
    const float* logits = net.logits() + int64_t(len - 1) * net.logits_row_stride();
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
