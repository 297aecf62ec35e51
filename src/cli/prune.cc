// `headroom prune` (cli/prune.h): loads a model directory, prunes it (model/prune.h), writes a
// valid Hugging Face model directory and reports what changed: parameters, planned memory and
// validation loss before and after.
#include "cli/prune.h"

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "backend/cpu/device.h"
#include "cli/flag_rules.h"
#include "core/units.h"
#include "core/utf8.h"
#include "data/batcher.h"
#include "data/token_file.h"
#include "model/config.h"
#include "model/prune.h"
#include "model/weights.h"
#include "plan/memory_plan.h"
#include "train/run_request.h"

namespace headroom::cli {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

int prune_fail(const Status& s) {
  std::fprintf(stderr, "headroom: error: %s\n", s.message().c_str());
  return 1;
}

// The validation windows of `data` as `train` cuts them (data::split_train_val with the same
// fraction; eval_batches batches of B sequences of T tokens from the held-out range's start):
// the same loss train reports for its final validation at that micro-batch.
struct ValSet {
  std::vector<int32_t> inputs, targets;
  int64_t sequences = 0;
};
Result<ValSet> validation_set(const std::string& path, double fraction, int B, int T, int batches,
                              int vocab) {
  HR_ASSIGN_OR_RETURN(data::TokenFile file, data::TokenFile::open(path));
  if (file.vocab_size() > vocab) {
    return Status::invalid_argument(
        fmt::format("--data {}: its tokens go up to {}, the model's vocab_size is {}; use the "
                    "token file of this model's tokenizer",
                    path, file.vocab_size(), vocab));
  }
  const auto split = data::split_train_val(file, fraction, T + 1);
  if (split.second.size() < T + 1) {
    return Status::invalid_argument(fmt::format(
        "--data {}: the held-out share {} has {} tokens, fewer than one window of --seq {} + 1; "
        "raise --val-fraction or lower --seq",
        path, fraction, split.second.size(), T));
  }
  HR_ASSIGN_OR_RETURN(data::PackedBatcher vb,
                      data::PackedBatcher::create(file, split.second, B, T));
  ValSet v;
  v.sequences = int64_t(batches) * B;
  v.inputs.resize(size_t(v.sequences * T));
  v.targets.resize(size_t(v.sequences * T));
  for (int i = 0; i < batches; i++) {
    vb.next(v.inputs.data() + int64_t(i) * B * T, v.targets.data() + int64_t(i) * B * T);
  }
  return v;
}

struct Figures {
  int64_t parameters = 0, nonzero = 0;
  uint64_t weight_bytes = 0;  // fp32, as saved
  uint64_t planned_peak = 0;  // training plan (fp32, micro-batch B, seq T)
  uint64_t mask_bytes = 0;    // the sparsity mask in that plan (0: none)
  std::optional<double> val_loss;
};

Result<Figures> figures(const model::TransformerConfig& c, const model::ParamTable& t,
                        const float* params, bool with_mask, int B, int T, const ValSet* val) {
  Figures f;
  f.parameters = t.num_parameters;
  for (const model::ParamDesc& p : t.params) {
    for (int64_t i = p.offset; i < p.offset + p.shape.numel(); i++) f.nonzero += params[i] != 0;
  }
  f.weight_bytes = uint64_t(t.num_parameters) * 4;
  plan::Policy policy;
  policy.micro_batch = B;
  policy.seq = T;
  policy.sparsity_mask = with_mask;
  HR_ASSIGN_OR_RETURN(const plan::MemoryPlan mp, plan::plan_training_memory(c, policy));
  f.planned_peak = mp.peak_bytes;
  if (with_mask) f.mask_bytes = mp.persistent.back().layout.size;
  if (val) {
    HR_ASSIGN_OR_RETURN(const double l,
                        model::mean_loss(c, t, params, val->inputs.data(), val->targets.data(),
                                         val->sequences, B, T));
    f.val_loss = l;
  }
  return f;
}

json figures_json(const Figures& f) {
  json j = {{"parameters", f.parameters},
            {"nonzero_parameters", f.nonzero},
            {"weight_bytes", f.weight_bytes},
            {"planned_training_peak_bytes", f.planned_peak},
            {"sparsity_mask_bytes", f.mask_bytes}};
  j["val_loss"] = f.val_loss ? json(*f.val_loss) : json(nullptr);
  return j;
}

// Copies the files of `in` other than the weights and config (the tokenizer's) into `out`.
void copy_side_files(const std::string& in, const std::string& out) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(in, ec)) {
    if (!e.is_regular_file()) continue;
    const std::string name = e.path().filename().string();
    if (name == "config.json" || name.rfind("model", 0) == 0) continue;  // model*.safetensors*
    fs::copy_file(e.path(), fs::path(out) / name, fs::copy_options::overwrite_existing, ec);
    if (ec)
      std::fprintf(stderr, "warning: could not copy %s: %s\n", name.c_str(), ec.message().c_str());
  }
}

}  // namespace

void add_prune_flags(CLI::App* cmd, PruneFlags& f) {
  cmd->add_option("--model-dir", f.model_dir, "the model to prune (config.json, model.safetensors)")
      ->required();
  cmd->add_option("--out", f.out, "directory for the pruned model")->required();
  cmd->add_option("--method", f.method,
                  "magnitude (unstructured: the smallest |w|), n:m (semi-structured, --nm), an "
                  "N:M pattern such as 2:4, or structured (removes MLP channels and/or attention "
                  "heads, --what: a smaller model)")
      ->required();
  f.sparsity_option = cmd->add_option("--sparsity", f.sparsity,
                                      "share in [0, 1) of the prunable weights (magnitude) or of "
                                      "the MLP channels / heads (structured) to remove; not for "
                                      "N:M")
                          ->capture_default_str();
  f.what_option = cmd->add_option("--what", f.what,
                                  "structured: what to remove: mlp (hidden channels), heads "
                                  "(attention heads; whole KV groups with grouped-query "
                                  "attention), or both (each by --sparsity)")
                      ->capture_default_str();
  cmd->add_option("--nm", f.nm, "the N:M pattern of --method n:m: keep N of every M weights")
      ->capture_default_str();
  cmd->add_flag("--per-layer", f.per_layer,
                "magnitude: rank each block's weights alone (default: one global ranking)");
  cmd->add_option("--data", f.data,
                  "token file for the validation loss before and after, or `default` (the "
                  "default corpus in the model's tokenizer); none: no validation");
  add_int_flag(cmd, "--seq", f.seq,
               {.max = 1 << 20, .what = "tokens", .auto_means = "min(128, n_positions)"},
               "validation and plan sequence length (default, or auto: min(128, n_positions))");
  add_int_flag(cmd, "--batch", f.batch, {.max = 1 << 20, .what = "sequences"},
               "validation micro-batch and the plan's (as train's --batch)", true);
  add_int_flag(cmd, "--eval-batches", f.eval_batches, {.max = 1 << 20, .what = "batches"},
               "validation batches of --batch sequences (train's are 4)", true);
  cmd->add_option("--val-fraction", f.val_fraction, "held-out share, as train's")
      ->capture_default_str();
  add_int_flag(cmd, "--threads", f.threads,
               {.max = 1 << 16, .what = "OpenMP threads", .auto_means = "the cores available"},
               "OpenMP threads (default, or auto: the cores available)");
  cmd->add_flag("--json", f.json, "print the report as one JSON object");
}

int run_prune(PruneFlags& f,
              const std::function<Result<std::string>(const std::string&)>& default_corpus) {
  omp_set_num_threads(f.threads > 0 ? f.threads : cpu::query_cpu_device().cores);
  Result<model::TransformerConfig> cfg = model::load_config_file(f.model_dir + "/config.json");
  if (!cfg.is_ok()) return prune_fail(cfg.status());
  const model::ParamTable table = model::gpt2_param_table(*cfg);
  std::vector<float> params(size_t(table.total_floats), 0.0f);
  if (Status s = model::load_pretrained(f.model_dir, table, params.data()); !s.is_ok()) {
    return prune_fail(s);
  }
  const bool structured = f.method == "structured";
  const bool sparsity_given = f.sparsity_option && f.sparsity_option->count() > 0;
  std::optional<model::MaskSpec> spec;
  if (!structured) {
    Result<model::MaskSpec> s =
        model::parse_mask_spec(f.method, f.nm, f.sparsity, f.per_layer, "--method");
    if (!s.is_ok()) {
      if (f.method != "magnitude" && f.method.find(':') == std::string::npos) {
        return prune_fail(Status::invalid_argument(fmt::format(
            "--method '{}': use magnitude, n:m (with --nm N:M), an N:M pattern such as 2:4, or "
            "structured",
            f.method)));
      }
      return prune_fail(s.status());
    }
    spec = *s;
    if (spec->kind == model::MaskSpec::Kind::kNM && sparsity_given) {
      return prune_fail(Status::invalid_argument(fmt::format(
          "--sparsity {} does not apply to --method {}: an N:M pattern prunes 1 - N/M of the "
          "weights ({}:{} prunes {:g}%)",
          f.sparsity, f.method, spec->n, spec->m, 100.0 * (spec->m - spec->n) / spec->m)));
    }
  }
  const bool what_given = f.what_option && f.what_option->count() > 0;
  if (what_given && !structured) {
    return prune_fail(Status::invalid_argument(fmt::format(
        "--what {} applies to --method structured only (masks prune single weights)", f.what)));
  }
  if (structured && f.what != "mlp" && f.what != "heads" && f.what != "both") {
    return prune_fail(Status::invalid_argument(
        fmt::format("--what '{}': use mlp (MLP channels), heads (attention heads or KV groups) "
                    "or both",
                    f.what)));
  }
  if (f.per_layer && (structured || spec->kind != model::MaskSpec::Kind::kMagnitude)) {
    return prune_fail(Status::invalid_argument(
        "--per-layer applies to --method magnitude only (N:M is per group, structured removes "
        "the same count of channels or heads in every block)"));
  }
  const int T = f.seq > 0 ? f.seq : std::min(128, cfg->n_positions);
  if (T > cfg->n_positions) {
    return prune_fail(Status::invalid_argument(
        fmt::format("--seq {} is longer than the model's n_positions {}", T, cfg->n_positions)));
  }
  if (!(f.val_fraction > 0 && f.val_fraction < 1)) {
    return prune_fail(Status::invalid_argument(
        fmt::format("--val-fraction {}: use a share in (0, 1), e.g. 0.05", f.val_fraction)));
  }
  std::optional<ValSet> val;
  std::string data_path = f.data;
  if (!f.data.empty()) {
    if (f.data == "default") {
      // The model's own tokenizer (its tokenizer.json / .model, or the byte tokenizer its
      // tokenizer_config.json names), as generate finds it; else GPT-2's.
      Result<std::string> p = default_corpus(train::model_dir_tokenizer(f.model_dir));
      if (!p.is_ok()) return prune_fail(p.status());
      data_path = *p;
    }
    Result<ValSet> v =
        validation_set(data_path, f.val_fraction, f.batch, T, f.eval_batches, cfg->vocab_size);
    if (!v.is_ok()) return prune_fail(v.status());
    val = std::move(*v);
  }
  const ValSet* vp = val ? &*val : nullptr;

  Result<Figures> before = figures(*cfg, table, params.data(), false, f.batch, T, vp);
  if (!before.is_ok()) return prune_fail(before.status());

  // Prune.
  model::TransformerConfig out_cfg = *cfg;
  model::ParamTable out_table = table;
  std::vector<float> out_params;
  std::string what;
  json detail;
  if (structured) {
    // Heads first, then the MLP (they own disjoint tensors, so the order changes nothing).
    out_params = params;
    std::vector<std::string> parts;
    if (f.what == "heads" || f.what == "both") {
      Result<model::StructuredPrune> sp =
          model::prune_attention_heads(out_cfg, out_table, out_params.data(), f.sparsity);
      if (!sp.is_ok()) return prune_fail(sp.status());
      const bool gqa = cfg->kv_heads() < cfg->n_head;
      const int groups_after = sp->config.kv_heads();
      parts.push_back(
          gqa ? fmt::format("{} of {} KV groups ({} query heads each) removed in every block "
                            "(heads {} -> {}, kv heads {} -> {})",
                            cfg->kv_heads() - groups_after, cfg->kv_heads(),
                            cfg->n_head / cfg->kv_heads(), cfg->n_head, sp->config.n_head,
                            cfg->kv_heads(), groups_after)
              : fmt::format("{} of {} attention heads removed in every block ({} -> {})",
                            cfg->n_head - sp->config.n_head, cfg->n_head, cfg->n_head,
                            sp->config.n_head));
      detail["heads_before"] = cfg->n_head;
      detail["heads_after"] = sp->config.n_head;
      detail["kv_heads_before"] = cfg->kv_heads();
      detail["kv_heads_after"] = groups_after;
      detail["head_dim"] = cfg->head_size();
      detail["attention_width_before"] = cfg->attn_width();
      detail["attention_width_after"] = sp->config.attn_width();
      detail["removed_heads"] = sp->removed;  // per block: KV groups (heads in MHA)
      detail["heads_importance"] =
          "L2 norm of each KV group's q, k, v rows and biases and its output-projection columns";
      out_cfg = sp->config;
      out_table = sp->table;
      out_params = std::move(sp->params);
    }
    if (f.what == "mlp" || f.what == "both") {
      Result<model::StructuredPrune> sp =
          model::prune_mlp_channels(out_cfg, out_table, out_params.data(), f.sparsity);
      if (!sp.is_ok()) return prune_fail(sp.status());
      parts.push_back(fmt::format("{} of {} MLP channels removed in every block ({} -> {})",
                                  cfg->mlp_width() - sp->config.mlp_width(), cfg->mlp_width(),
                                  cfg->mlp_width(), sp->config.mlp_width()));
      detail["mlp_width_before"] = cfg->mlp_width();
      detail["mlp_width_after"] = sp->config.mlp_width();
      detail["importance"] =
          "L2 norm of each channel's weights and bias across the MLP's projections";
      detail["removed_channels"] = sp->removed;
      out_cfg = sp->config;
      out_table = sp->table;
      out_params = std::move(sp->params);
    }
    what = "structured: " + parts[0] + (parts.size() > 1 ? "; " + parts[1] : "");
    detail["what"] = f.what;
  } else {
    Result<model::SparsityMask> mask = model::make_mask(*cfg, table, params.data(), *spec);
    if (!mask.is_ok()) return prune_fail(mask.status());
    out_params = params;
    model::apply_mask(*mask, out_params.data(), table.total_floats);
    const model::MaskCounts mc = model::count_mask(table, *mask);
    what = fmt::format("{}: {} of {} prunable weights zeroed ({:.2f}%)", spec->describe(),
                       mc.pruned, mc.prunable, 100.0 * double(mc.pruned) / double(mc.prunable));
    detail = {{"pruned_weights", mc.pruned},
              {"prunable_weights", mc.prunable},
              {"importance", "|w|"},
              {"pattern", spec->describe()}};
  }
  Result<Figures> after =
      figures(out_cfg, out_table, out_params.data(), !structured, f.batch, T, vp);
  if (!after.is_ok()) return prune_fail(after.status());
  if (Status s = model::save_pretrained(f.out, out_cfg, out_table, out_params.data()); !s.is_ok()) {
    return prune_fail(s);
  }
  copy_side_files(f.model_dir, f.out);

  if (f.json) {
    json j = {{"model_dir", f.model_dir},
              {"out", f.out},
              {"method", structured ? "structured" : spec->describe()},
              {"summary", what},
              {"detail", detail},
              {"seq", T},
              {"batch", f.batch},
              {"data", data_path.empty() ? json(nullptr) : json(data_path)},
              {"before", figures_json(*before)},
              {"after", figures_json(*after)}};
    std::printf("%s\n", dump_json(j, 2).c_str());
    return 0;
  }
  std::printf("headroom prune: %s -> %s\n  %s\n", f.model_dir.c_str(), f.out.c_str(), what.c_str());
  auto row = [](const char* name, const std::string& a, const std::string& b) {
    std::printf("  %-34s %16s %16s\n", name, a.c_str(), b.c_str());
  };
  row("", "before", "after");
  row("parameters", fmt::format("{}", before->parameters), fmt::format("{}", after->parameters));
  row("nonzero parameters", fmt::format("{}", before->nonzero), fmt::format("{}", after->nonzero));
  row("weights (fp32)", format_bytes(before->weight_bytes), format_bytes(after->weight_bytes));
  row(fmt::format("training plan (b {}, T {}, fp32)", f.batch, T).c_str(),
      format_bytes(before->planned_peak), format_bytes(after->planned_peak));
  if (after->mask_bytes) {
    row("  of which the sparsity mask", "-", format_bytes(after->mask_bytes) + " (1 B/weight)");
  }
  if (before->val_loss) {
    row("validation loss", fmt::format("{:.4f}", *before->val_loss),
        fmt::format("{:.4f}", *after->val_loss));
  } else {
    std::printf("  validation loss: not measured (give --data FILE or --data default)\n");
  }
  std::printf("model saved to %s/ (config.json, model.safetensors)\n", f.out.c_str());
  return 0;
}

}  // namespace headroom::cli
