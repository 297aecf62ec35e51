// `headroom generate`: samples text from a trained model directory.
#include "cli/common.h"

#include <algorithm>
#include <cstdio>
#include <span>

#include <fmt/format.h>

#include "core/units.h"
#include "core/utf8.h"
#include "memory/adaptors.h"
#include "memory/host_resource.h"
#include "model/weights.h"
#include "plan/generation_plan.h"
#include "train/generate.h"

namespace headroom::cli {

int run_generate(GenerateFlags& f) {
  set_threads(f.threads);
  Result<model::Gpt2Config> cfg = model::load_config_file(f.model_dir + "/config.json");
  if (!cfg.is_ok()) return fail(cfg.status());
  Result<std::unique_ptr<data::Tokenizer>> loaded =
      run_tokenizer(model_dir_tokenizer(f.model_dir), f.vocab);
  if (!loaded.is_ok()) return fail(loaded.status());
  const std::unique_ptr<data::Tokenizer>& tok = *loaded;
  if (tok->vocab_size() > cfg->vocab_size) {
    return fail(Status::invalid_argument(
        fmt::format("{}/config.json: vocab_size {} is smaller than the tokenizer's {}", f.model_dir,
                    cfg->vocab_size, tok->vocab_size())));
  }
  const model::ParamTable table = model::gpt2_param_table(*cfg);
  memory::HostResource host_upstream;
  memory::TrackingResource host(&host_upstream);  // measured against the generation plan
  Result<memory::Arena> params = memory::Arena::create(
      &host, {{"parameters", DType::kF32, Shape{table.total_floats}, memory::Category::kWeights}},
      memory::sequential_layout(
          {{"parameters", DType::kF32, Shape{table.total_floats}, memory::Category::kWeights}}),
      memory::Category::kWeights);
  if (!params.is_ok()) return fail(params.status());
  if (Status s = model::load_pretrained(f.model_dir, table, params->f32(0)); !s.is_ok()) {
    return fail(s);
  }
  std::vector<int32_t> prompt = tok->encode(f.prompt);
  // An empty prompt starts a new document: after the end-of-document token, or the bos token.
  if (prompt.empty())
    prompt.push_back(tok->eos_token() >= 0 ? tok->eos_token() : std::max(tok->bos_token(), 0));
  train::SampleOptions so;
  so.max_new_tokens = f.max_new_tokens;
  so.temperature = f.temperature;
  so.top_k = f.top_k;
  so.seed = f.seed;
  so.stop_token = tok->eos_token();
  // The plan sample_tokens allocates by (docs/notes/generation.md): printed before the first
  // token, on stderr so that stdout is the text.
  const plan::GenerationPlan gp = plan::plan_generation(
      *cfg, int(std::min<size_t>(prompt.size(), size_t(cfg->n_positions))), f.max_new_tokens);
  if (!f.json) {
    std::fprintf(stderr,
                 "memory (planned): weights %s, KV cache %s (%d positions x %d layers x %d kv "
                 "heads), activations and logits %s (a pass of up to %d tokens); peak %s\n",
                 format_bytes(gp.weights_bytes).c_str(), format_bytes(gp.cache_layout.size).c_str(),
                 gp.shape.context, cfg->n_layer, cfg->kv_heads(),
                 format_bytes(gp.work_layout.size).c_str(), gp.shape.rows,
                 format_bytes(gp.peak_bytes).c_str());
    std::printf("%s", f.prompt.c_str());
  }
  Result<std::vector<int32_t>> ids =
      train::sample_tokens(*cfg, params->f32(0), prompt, so, &host, [&](int32_t t) {
        if (!f.json && t != tok->eos_token()) {
          std::printf("%s", tok->decode(std::span<const int32_t>(&t, 1)).c_str());
          std::fflush(stdout);
        }
      });
  if (!ids.is_ok()) return fail(ids.status());
  if (f.json) {
    // A byte-level BPE completion may stop inside a multi-byte character, and a prompt may be any
    // bytes: the text fields are lossy where they are not UTF-8 (U+FFFD; docs/notes/json-text.md),
    // the token ids exact. `tokens` are the completion's ids (the end-of-text token included when
    // sampling stopped on it), `prompt_tokens` the prompt's as the model saw them.
    std::vector<int32_t> out = *ids;
    if (!out.empty() && out.back() == tok->eos_token()) out.pop_back();
    const std::string completion = tok->decode(out);
    json j = {{"prompt", f.prompt},
              {"completion", completion},
              {"tokens", *ids},
              {"prompt_tokens", prompt},
              {"text_is_exact", is_valid_utf8(f.prompt) && is_valid_utf8(completion)},
              {"memory",
               {{"weights_bytes", gp.weights_bytes},
                {"kv_cache_bytes", gp.cache_layout.size},
                {"activations_bytes", gp.work_layout.size},
                {"context", gp.shape.context},
                {"planned_peak_bytes", gp.peak_bytes},
                {"measured_peak_bytes", host.stats().peak}}}};
    std::printf("%s\n", dump_json(j, 2).c_str());
  } else {
    std::printf("\n");
    std::fprintf(stderr, "measured peak %s (planned %s)\n", format_bytes(host.stats().peak).c_str(),
                 format_bytes(gp.peak_bytes).c_str());
  }
  return 0;
}

}  // namespace headroom::cli
