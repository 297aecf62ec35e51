// Plan truth (issue #27): how far the cost model's step time is from the measured one, per cell of
// model x precision x micro-batch x recomputation, before and after self-correction. Prediction
// and measurement run in one process, cell after cell, in alternated rounds (every cell once per
// round), so that each cell's measurements are spread over the run; medians over rounds.
//
//   plan_truth_bench [--models gpt2-tiny,gpt2] [--precisions fp32,bf16] [--batches 1,8,32]
//                    [--recompute none,full] [--rounds 3] [--steps 3] [--min-seconds 1]
//                    [--seq-tiny 256] [--seq-large 32] [--json FILE]
//
// Each run is at least --steps steps, more for a short step: enough that the timed steps (all but
// the first) take about --min-seconds by the prediction, at most 40.
//
// Round 1 is the runs' "first steps": each (model, precision) learns its correction there, from
// its micro-batch-8 cell without recomputation (the trainer's default plan), and from every cell
// itself; rounds 2.. compare the uncorrected and both corrected predictions with the measurement.
// See docs/benchmarks.md ("Plan truth") and docs/notes/cost-model.md.
#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/units.h"
#include "data/token_file.h"
#include "model/config.h"
#include "plan/calibrate.h"
#include "plan/cost_model.h"
#include "plan/cost_terms.h"
#include "plan/memory_plan.h"
#include "plan/search.h"
#include "train/trainer.h"

namespace hr = headroom;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) v.push_back(item);
  }
  return v;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Cell {
  std::string model, precision, recompute;
  int batch = 0, seq = 0, steps = 0;  // steps per run
  hr::model::Gpt2Config config;
  hr::plan::MemoryPlan plan;
  // Per round: the uncorrected prediction and the measurement (ms), and per kind (seconds).
  std::vector<double> predicted_ms, measured_ms;
  std::vector<std::array<double, hr::plan::kCostKinds>> measured_kinds;
  hr::plan::StepCost cost;       // uncorrected
  hr::plan::CostCorrection own;  // learned on this cell in round 1
  std::string group() const { return model + " " + precision; }
};

hr::train::TrainOptions options_for(const Cell& c, const std::string& data, int steps) {
  hr::train::TrainOptions o;
  o.config = c.config;
  o.model_name = c.model;
  o.data = data;
  o.seq = c.seq;
  o.micro_batch = c.batch;
  o.accumulation = 1;
  o.steps = steps;
  o.warmup_steps = 1;
  o.adamw.lr = 6e-4f;
  o.val_fraction = 0;
  o.eval_batches = 0;
  o.breakdown = true;
  o.exec.precision =
      c.precision == "bf16" ? hr::model::Precision::kBf16 : hr::model::Precision::kFp32;
  if (c.recompute == "full")
    o.exec.recompute.assign(size_t(c.config.n_layer), hr::model::Recompute::kFull);
  o.device_memory = uint64_t(64) << 30;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> a = {{"--models", "gpt2-tiny,gpt2"},
                                          {"--precisions", "fp32,bf16"},
                                          {"--batches", "1,8,32"},
                                          {"--recompute", "none,full"},
                                          {"--rounds", "3"},
                                          {"--steps", "3"},
                                          {"--min-seconds", "1"},
                                          {"--seq-tiny", "256"},
                                          {"--seq-large", "32"},
                                          {"--json", ""}};
  for (int i = 1; i < argc; i++) {
    const std::string k = argv[i];
    if (!a.count(k) || i + 1 >= argc) {
      std::fprintf(stderr, "plan_truth_bench: unknown flag or missing value: %s\n", k.c_str());
      return 2;
    }
    a[k] = argv[++i];
  }
  const int rounds = std::stoi(a["--rounds"]), steps = std::stoi(a["--steps"]);
  const double min_seconds = std::stod(a["--min-seconds"]);
  if (rounds < 2 || steps < 2) {
    std::fprintf(stderr, "plan_truth_bench: --rounds and --steps must be at least 2\n");
    return 2;
  }
  hr::Result<hr::plan::Calibration> cal = hr::plan::load_or_calibrate(
      hr::plan::default_calibration_path(),
      [](const std::string& line) { std::fprintf(stderr, "calibrate: %s\n", line.c_str()); });
  if (!cal.is_ok()) {
    std::fprintf(stderr, "%s\n", cal.status().to_string().c_str());
    return 1;
  }
  const hr::plan::DeviceSpec device = hr::plan::cpu_device_spec(*cal, uint64_t(64) << 30);
  if (!device.terms.fitted) {
    std::fprintf(stderr, "plan_truth_bench: the calibration has no fitted terms\n");
    return 1;
  }

  std::vector<Cell> cells;
  int64_t max_steps_tokens = 0;  // the token file: every run's steps of tokens
  for (const std::string& m : split(a["--models"])) {
    hr::Result<hr::model::Gpt2Config> cfg = hr::model::resolve_model(m);
    if (!cfg.is_ok()) {
      std::fprintf(stderr, "%s\n", cfg.status().to_string().c_str());
      return 1;
    }
    const bool tiny = cfg->n_embd <= 256;
    for (const std::string& p : split(a["--precisions"])) {
      for (const std::string& b : split(a["--batches"])) {
        for (const std::string& r : split(a["--recompute"])) {
          Cell c;
          c.model = m;
          c.precision = p;
          c.recompute = r;
          c.batch = std::stoi(b);
          c.seq = std::min(std::stoi(a[tiny ? "--seq-tiny" : "--seq-large"]), cfg->n_positions);
          c.config = *cfg;
          // The trainer's own plan for these options (train/trainer.cc).
          const hr::train::TrainOptions o = options_for(c, "", steps);
          hr::plan::Policy policy;
          policy.micro_batch = c.batch;
          policy.accumulation = 1;
          policy.seq = c.seq;
          policy.exec = o.exec;
          policy.precision = p;
          hr::Result<hr::plan::MemoryPlan> mp = hr::plan::plan_training_memory(c.config, policy);
          if (!mp.is_ok()) {
            std::fprintf(stderr, "%s\n", mp.status().to_string().c_str());
            return 1;
          }
          c.plan = *mp;
          c.cost = hr::plan::estimate_step(c.config, c.plan, device);
          c.steps = std::clamp(1 + int(std::ceil(min_seconds / c.cost.step_seconds)), steps, 40);
          max_steps_tokens = std::max(max_steps_tokens, int64_t(c.steps + 2) * c.batch * c.seq);
          cells.push_back(std::move(c));
        }
      }
    }
  }
  // Random tokens (the largest vocabulary's range) for every run.
  const std::string data =
      (fs::temp_directory_path() / fmt::format("plan-truth-{}.tokens", ::getpid())).string();
  {
    std::mt19937 rng(7);
    std::vector<int32_t> toks(size_t(max_steps_tokens) + 1);
    for (int32_t& t : toks) t = int32_t(rng() % 50257u);
    if (!hr::data::write_token_file(data, toks, 50257, 50256, 1).is_ok()) return 1;
  }

  for (int round = 0; round < rounds; round++) {
    for (Cell& c : cells) {
      hr::train::TrainOptions o = options_for(c, data, c.steps);
      o.device = device;
      std::vector<double> ms;
      std::array<double, hr::plan::kCostKinds> kinds{};
      double predicted = 0;
      hr::train::TrainCallbacks cb;
      cb.on_step = [&](const hr::train::StepStats& s) {
        predicted = s.predicted_step_ms;
        if (s.step < 2) return;  // the first step faults pages in
        ms.push_back(s.step_ms);
        for (size_t k = 0; k < size_t(hr::model::OpKind::kCount); k++)
          kinds[k] += s.op_ms.ms[k] / 1e3;
        kinds[size_t(hr::plan::CostKind::kOptimizer)] += s.optimizer_ms / 1e3;
      };
      hr::Result<hr::train::TrainResult> r = hr::train::run_training(o, cb);
      if (!r.is_ok()) {
        std::fprintf(stderr, "%s b%d %s: %s\n", c.group().c_str(), c.batch, c.recompute.c_str(),
                     r.status().to_string().c_str());
        return 1;
      }
      for (double& k : kinds) k /= double(ms.size());
      if (std::abs(predicted - c.cost.step_seconds * 1e3) > 1e-6 * predicted) {
        std::fprintf(stderr, "warning: the trainer predicted %.3f ms, this bench %.3f ms\n",
                     predicted, c.cost.step_seconds * 1e3);
      }
      c.predicted_ms.push_back(c.cost.step_seconds * 1e3);
      c.measured_ms.push_back(median(ms));
      c.measured_kinds.push_back(kinds);
      std::fprintf(stderr, "round %d: %s b%d %s: predicted %.1f ms, measured %.1f ms (%.2fx)\n",
                   round + 1, c.group().c_str(), c.batch, c.recompute.c_str(),
                   c.cost.step_seconds * 1e3, median(ms), c.cost.step_seconds * 1e3 / median(ms));
      if (round == 0) {
        c.own =
            hr::plan::correction_from(c.cost.uncorrected_by_kind, kinds, median(ms) / 1e3,
                                      double(c.batch) * c.seq, 1, c.cost.fused_head_gemm_seconds);
      }
    }
  }
  fs::remove(data);

  // The corrections as a run learns them: each group's micro-batch-8 cell without recomputation.
  std::map<std::string, hr::plan::CostCorrection> learned;
  for (const Cell& c : cells) {
    if (c.batch == 8 && c.recompute == "none") learned[c.group()] = c.own;
  }
  auto ratio = [](double p, double m) { return m > 0 ? p / m : 0.0; };
  json out = {{"threads", omp_get_max_threads()},
              {"calibration", hr::plan::describe_calibration(*cal)},
              {"rounds", rounds},
              {"steps", steps},
              {"min_seconds", min_seconds},
              {"cells", json::array()}};
  std::vector<double> dev_before, dev_after, dev_own;
  std::printf(
      "| model | precision | micro-batch x seq | recompute | predicted ms | measured ms | "
      "ratio before | ratio after (mb-8 correction) | ratio after (own) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  std::map<std::string, std::vector<std::pair<const Cell*, std::array<double, 3>>>> by_group;
  for (const Cell& c : cells) {
    hr::plan::DeviceSpec corrected = device;
    auto it = learned.find(c.group());
    if (it != learned.end()) corrected.correction = it->second;
    const double after_ms = hr::plan::estimate_step(c.config, c.plan, corrected).step_seconds * 1e3;
    hr::plan::DeviceSpec own = device;
    own.correction = c.own;
    const double own_ms = hr::plan::estimate_step(c.config, c.plan, own).step_seconds * 1e3;
    // Rounds 2..: the ones no correction was learned from.
    const std::vector<double> later(c.measured_ms.begin() + 1, c.measured_ms.end());
    const double m = median(later), p = c.predicted_ms.front();
    const double rb = ratio(p, m), ra = ratio(after_ms, m), ro = ratio(own_ms, m);
    dev_before.push_back(std::abs(rb - 1));
    dev_after.push_back(std::abs(ra - 1));
    dev_own.push_back(std::abs(ro - 1));
    std::printf("| %s | %s | %d x %d | %s | %.1f | %.1f | %.3f | %.3f | %.3f |\n", c.model.c_str(),
                c.precision.c_str(), c.batch, c.seq, c.recompute.c_str(), p, m, rb, ra, ro);
    // Within one precision, and across them (the model's group: --precision auto's choice,
    // each precision priced with its own correction, as SearchRequest::corrections does).
    const std::array<double, 3> per_token = {p / (c.batch * c.seq), after_ms / (c.batch * c.seq),
                                             m / (c.batch * c.seq)};
    by_group[c.group()].push_back({&c, per_token});
    by_group[c.model + " auto"].push_back({&c, per_token});
    json kinds_pred = json::object(), kinds_meas = json::object();
    std::array<double, hr::plan::kCostKinds> mk{};
    for (size_t r = 1; r < c.measured_kinds.size(); r++)
      for (size_t k = 0; k < hr::plan::kCostKinds; k++)
        mk[k] += c.measured_kinds[r][k] / double(c.measured_kinds.size() - 1);
    for (size_t k = 0; k < hr::plan::kCostKinds; k++) {
      const std::string name(hr::plan::cost_kind_name(hr::plan::CostKind(k)));
      kinds_pred[name] = c.cost.uncorrected_by_kind[k] * 1e3;
      kinds_meas[name] = mk[k] * 1e3;
    }
    out["cells"].push_back({{"model", c.model},
                            {"precision", c.precision},
                            {"micro_batch", c.batch},
                            {"seq", c.seq},
                            {"recompute", c.recompute},
                            {"steps", c.steps},
                            {"predicted_ms", p},
                            {"predicted_after_ms", after_ms},
                            {"predicted_own_ms", own_ms},
                            {"measured_ms", c.measured_ms},
                            {"measured_median_ms", m},
                            {"ratio_before", rb},
                            {"ratio_after", ra},
                            {"ratio_own", ro},
                            {"predicted_ms_by_kind", kinds_pred},
                            {"measured_ms_by_kind", kinds_meas}});
  }
  auto worst = [](const std::vector<double>& v) {
    return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end());
  };
  std::printf(
      "\nmedian |predicted/measured - 1|: before %.1f%% (worst %.1f%%), after the mb-8 "
      "correction %.1f%% (worst %.1f%%), after each cell's own %.1f%% (worst %.1f%%)\n",
      100 * median(dev_before), 100 * worst(dev_before), 100 * median(dev_after),
      100 * worst(dev_after), 100 * median(dev_own), 100 * worst(dev_own));
  out["median_abs_error_before"] = median(dev_before);
  out["median_abs_error_after"] = median(dev_after);
  out["median_abs_error_own"] = median(dev_own);
  out["worst_abs_error_before"] = worst(dev_before);
  out["worst_abs_error_after"] = worst(dev_after);
  out["worst_abs_error_own"] = worst(dev_own);

  // The planner's choice among a group's cells (the fastest per token that fits), under every
  // budget at which the set of fitting cells changes: by the uncorrected model, by the corrected
  // one, and by the measurement.
  out["choices"] = json::array();
  std::printf("\nchoice among the cells (fastest per token that fits the budget):\n");
  for (auto& [group, list] : by_group) {
    std::vector<uint64_t> budgets;
    for (const auto& [c, t] : list) budgets.push_back(c->plan.peak_bytes);
    std::sort(budgets.begin(), budgets.end());
    budgets.erase(std::unique(budgets.begin(), budgets.end()), budgets.end());
    for (uint64_t budget : budgets) {
      std::array<const Cell*, 3> best{};
      std::array<double, 3> best_t{};
      for (const auto& [c, t] : list) {
        if (c->plan.peak_bytes > budget) continue;
        for (size_t i = 0; i < 3; i++) {
          if (!best[i] || t[i] < best_t[i]) best[i] = c, best_t[i] = t[i];
        }
      }
      auto name = [](const Cell* c) {
        return fmt::format("{} b{} {}", c->precision, c->batch, c->recompute);
      };
      // What a wrong choice costs: its measured time per token over the measured best's.
      auto measured_per_token = [&](const Cell* c) {
        for (const auto& [x, t] : list)
          if (x == c) return t[2];
        return 0.0;
      };
      auto loss = [&](size_t i) {
        return best[i] == best[2]
                   ? std::string()
                   : fmt::format(" ({} measured {:+.1f}% a token)",
                                 i == 0 ? "before's" : "corrected's",
                                 100 * (measured_per_token(best[i]) / best_t[2] - 1));
      };
      std::printf("  %s, budget %s: before %s, corrected %s, measured %s%s%s%s\n", group.c_str(),
                  hr::format_bytes(budget).c_str(), name(best[0]).c_str(), name(best[1]).c_str(),
                  name(best[2]).c_str(),
                  best[0] == best[1]   ? ""
                  : best[1] == best[2] ? "  <- the correction changes it, to the measured best"
                                       : "  <- the correction changes it",
                  loss(0).c_str(), best[1] != best[0] ? loss(1).c_str() : "");
      out["choices"].push_back(
          {{"group", group},
           {"before_measured_over_best", measured_per_token(best[0]) / best_t[2]},
           {"corrected_measured_over_best", measured_per_token(best[1]) / best_t[2]},
           {"budget_bytes", budget},
           {"before", name(best[0])},
           {"corrected", name(best[1])},
           {"measured", name(best[2])}});
    }
  }
  if (!a["--json"].empty()) {
    std::ofstream f(a["--json"]);
    f << out.dump(2) << "\n";
  }
  return 0;
}
