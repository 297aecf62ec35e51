// Candidate enumeration, pricing and the choice.
#include "plan/search.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>

#include <fmt/format.h>

#include "core/units.h"

namespace headroom::plan {

std::string recompute_summary(const model::ExecOptions& e) {
  int counts[3] = {0, 0, 0};
  for (model::Recompute r : e.recompute) counts[int(r)]++;
  if (e.recompute.empty() || counts[0] == int(e.recompute.size())) return "none";
  if (counts[1] == int(e.recompute.size())) return "selective";
  if (counts[2] == int(e.recompute.size())) return "full";
  return "mixed";
}

std::string describe_exec(const model::ExecOptions& e) {
  std::string s = e.tiled_attention ? "tiled attention" : "plain attention";
  s += e.head_chunk > 0 ? fmt::format(", fused LM head (chunk {})", e.head_chunk) : ", full logits";
  std::string rc = recompute_summary(e);
  if (rc == "mixed") {
    int counts[3] = {0, 0, 0};
    for (model::Recompute r : e.recompute) counts[int(r)]++;
    s +=
        fmt::format(", recompute: {} full, {} selective, {} none", counts[2], counts[1], counts[0]);
  } else {
    s += ", recompute " + rc;
  }
  return s;
}

namespace {

Candidate evaluate(const SearchRequest& r, const MemoryPlan& mp) {
  Candidate c;
  c.policy = mp.policy;
  c.peak_bytes = mp.peak_bytes;
  c.lower_bound_bytes = mp.lower_bound_bytes;
  c.by_category = mp.by_category;
  c.cost = estimate_step(r.config, mp, r.device);
  c.fits = mp.peak_bytes <= r.device_memory;
  if (!c.fits) {
    c.rejected_because =
        fmt::format("needs {}, {} over the {} budget", format_bytes(mp.peak_bytes),
                    format_bytes(mp.peak_bytes - r.device_memory), format_bytes(r.device_memory));
  }
  return c;
}

Policy policy_for(const SearchRequest& r, int b, int k) {
  Policy p;
  p.micro_batch = b;
  p.accumulation = k;
  p.seq = r.seq;
  p.precision = r.precision;
  return p;
}

// What the techniques not built yet would bring, from the leanest plan the engine can run
// (micro-batch 1, every activation technique on).
std::string advise(const SearchRequest& r, const MemoryPlan& lean) {
  const uint64_t budget = r.device_memory;
  const uint64_t need = lean.peak_bytes;
  const double P = double(lean.params.total_floats);
  const double N = r.devices;
  const double step = double(lean.step_bytes);
  const double other = double(lean.persistent_bytes) - 16.0 * P;  // token staging
  std::string s = fmt::format(
      "nothing fits: even micro-batch 1 with full recomputation, tiled attention and the fused LM "
      "head needs {} per device ({} persistent: weights, gradients, optimizer state; {} for one "
      "micro-batch), {} more than the {} budget.\n",
      format_bytes(need), format_bytes(lean.persistent_bytes), format_bytes(lean.step_bytes),
      format_bytes(need - budget), format_bytes(budget));
  s += "techniques that would close the gap (estimates at micro-batch 1; offload and ZeRO are not "
       "built yet):\n";
  auto line = [&](const std::string& what, double bytes) {
    uint64_t b = uint64_t(bytes);
    s += fmt::format("  - {:<66} ~{:>10} per device  {}\n", what, format_bytes(b),
                     b <= budget ? "fits" : fmt::format("still {} over", format_bytes(b - budget)));
  };
  if (r.precision == "fp32") {
    line("bf16 mixed precision (built: --precision bf16; +2 bytes per parameter, bf16 activations)",
         18.0 * P + other + step / 2.0);
  }
  line("optimizer offload (fp32 moments on the host)", 8.0 * P + other + step);
  line("bf16 + optimizer offload (fp32 master and moments on the host)",
       4.0 * P + other + step / 2.0);
  if (r.devices > 1) {
    line(fmt::format("ZeRO-1 over {} devices (optimizer state sharded)", r.devices),
         8.0 * P + 8.0 * P / N + other + step);
    line(fmt::format("ZeRO-2 over {} devices (+ gradients)", r.devices),
         4.0 * P + 12.0 * P / N + other + step);
    line(fmt::format("ZeRO-3 over {} devices (+ parameters)", r.devices),
         16.0 * P / N + other + step);
    line(fmt::format("ZeRO-3 over {} + bf16", r.devices), 16.0 * P / N + other + step / 2.0);
    line(fmt::format("ZeRO-3 over {} + bf16 + optimizer offload", r.devices),
         4.0 * P / N + other + step / 2.0);
  } else {
    line("ZeRO-3 over 4 devices (parameters, gradients, optimizer sharded)",
         16.0 * P / 4.0 + other + step);
  }
  return s;
}

}  // namespace

namespace {
// `auto` precision: the searches for fp32 and bf16 side by side; the faster choice wins, and the
// candidates of both are listed.
SearchResult merge_precisions(SearchResult fp32, SearchResult bf16) {
  const auto speed = [](const SearchResult& s) {
    return s.chosen ? s.chosen->cost.tokens_per_s : -1.0;
  };
  const bool bf16_wins = bf16.chosen ? speed(bf16) > speed(fp32) : !fp32.chosen;
  SearchResult out = bf16_wins ? bf16 : fp32;
  const SearchResult& other = bf16_wins ? fp32 : bf16;
  out.candidates.insert(out.candidates.end(), other.candidates.begin(), other.candidates.end());
  std::stable_sort(out.candidates.begin(), out.candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     return a.cost.tokens_per_s > b.cost.tokens_per_s;
                   });
  out.rejected.insert(out.rejected.end(), other.rejected.begin(), other.rejected.end());
  out.plans_placed += other.plans_placed;
  out.max_micro_batch = std::max(out.max_micro_batch, other.max_micro_batch);
  out.planning_ms += other.planning_ms;
  return out;
}
}  // namespace

Result<SearchResult> search_plan(const SearchRequest& r) {
  if (r.precision == "auto") {
    SearchRequest f = r;
    f.precision = "fp32";
    HR_ASSIGN_OR_RETURN(SearchResult fp32, search_plan(f));
    if (!(r.device.flops_bf16 > 0)) return fp32;
    SearchRequest h = r;
    h.precision = "bf16";
    HR_ASSIGN_OR_RETURN(SearchResult bf16, search_plan(h));
    return merge_precisions(std::move(fp32), std::move(bf16));
  }
  if (r.precision != "fp32" && r.precision != "bf16") {
    return Status::invalid_argument(fmt::format(
        "--precision {}: expected auto, fp32 or bf16 (fp16 is not built yet)", r.precision));
  }
  auto t0 = std::chrono::steady_clock::now();
  HR_RETURN_IF_ERROR(r.config.validate());
  if (r.devices <= 0)
    return Status::invalid_argument(fmt::format("--devices {} must be positive", r.devices));
  if (r.seq <= 0 || r.seq > r.config.n_positions) {
    return Status::invalid_argument(
        fmt::format("--seq {} must be between 1 and the model's n_positions ({})", r.seq,
                    r.config.n_positions));
  }
  if (r.global_batch <= 0 || r.global_batch % r.devices != 0) {
    return Status::invalid_argument(
        fmt::format("--global-batch {} must be a positive multiple of --devices {}", r.global_batch,
                    r.devices));
  }
  if (r.device_memory == 0) return Status::invalid_argument("the device memory budget is zero");
  const int per_device = r.global_batch / r.devices;
  if (r.micro_batch && (*r.micro_batch <= 0 || per_device % *r.micro_batch != 0)) {
    return Status::invalid_argument(fmt::format(
        "--batch {} must divide the per-device batch {} (--global-batch {} / --devices {})",
        *r.micro_batch, per_device, r.global_batch, r.devices));
  }

  SearchResult res;
  const int L = r.config.n_layer;
  // The technique options, uniform over blocks.
  std::vector<model::ExecOptions> options;
  std::vector<int> heads;
  if (!r.fused_head || !*r.fused_head) heads.push_back(0);
  if (!r.fused_head || *r.fused_head) heads.push_back(r.head_chunk);
  std::vector<model::Recompute> modes = {model::Recompute::kNone, model::Recompute::kSelective,
                                         model::Recompute::kFull};
  if (r.recompute) modes = {*r.recompute};
  for (int head : heads) {
    for (model::Recompute m : modes) {
      model::ExecOptions e;
      e.tiled_attention = true;
      e.head_chunk = head;
      if (m != model::Recompute::kNone) e.recompute.assign(size_t(L), m);
      options.push_back(e);
    }
  }
  // The leanest option allowed: the last one (fused head if allowed, the most recomputation).
  const model::ExecOptions lean = options.back();

  // Placed plans, by micro-batch and technique; the step region does not depend on k.
  std::map<std::pair<int, std::string>, MemoryPlan> placed;
  auto policy = [&](int b, int k, const model::ExecOptions& e) {
    Policy p = policy_for(r, b, k);
    p.exec = e;
    return p;
  };
  auto place = [&](int b, int k, const model::ExecOptions& e) -> Result<MemoryPlan> {
    auto key = std::make_pair(b, describe_exec(e));
    auto it = placed.find(key);
    if (it == placed.end()) res.plans_placed++;
    HR_ASSIGN_OR_RETURN(MemoryPlan mp,
                        plan_training_memory(r.config, policy(b, k, e),
                                             it == placed.end() ? nullptr : &it->second));
    if (it == placed.end()) placed.emplace(key, mp);
    return mp;
  };
  struct Choice {
    std::optional<Candidate> best;  // fastest that fits
    std::optional<MemoryPlan> plan;
    Candidate leanest;  // when nothing fits
  };
  // Tries `opts` fastest first (priced on the unplaced tables), rejecting on the lower bound
  // before placing; the first that fits is the fastest that fits.
  auto try_options = [&](int b, int k, const std::vector<model::ExecOptions>& opts,
                         Choice* ch) -> Status {
    std::vector<std::pair<Candidate, model::ExecOptions>> priced;
    for (const model::ExecOptions& e : opts) {
      HR_ASSIGN_OR_RETURN(MemoryPlan rough, plan_training_memory(r.config, policy(b, k, e), nullptr,
                                                                 /*place=*/false));
      Candidate c = evaluate(r, rough);
      c.placed = false;
      priced.push_back({c, e});
    }
    std::stable_sort(priced.begin(), priced.end(), [](const auto& x, const auto& y) {
      return x.first.cost.tokens_per_s > y.first.cost.tokens_per_s;
    });
    for (auto& [rough, e] : priced) {
      if (ch->best && rough.cost.tokens_per_s <= ch->best->cost.tokens_per_s) break;
      if (!rough.fits) {
        rough.rejected_because = fmt::format(
            "needs at least {}, {} over the {} budget", format_bytes(rough.peak_bytes),
            format_bytes(rough.peak_bytes - r.device_memory), format_bytes(r.device_memory));
        continue;
      }
      HR_ASSIGN_OR_RETURN(MemoryPlan mp, place(b, k, e));
      Candidate c = evaluate(r, mp);
      if (c.fits) {
        ch->best = c;
        ch->plan = std::move(mp);
        break;
      }
    }
    return Status::ok();
  };
  auto choose = [&](int b, int k) -> Result<Choice> {
    Choice ch;
    HR_RETURN_IF_ERROR(try_options(b, k, options, &ch));
    // An optimal per-block mix: blocks are identical, so a schedule is a count of fully and
    // selectively recomputed blocks. Memory and time are linear in the counts (measured from the
    // uniform plans); every count pair under the budget is priced, the fastest few are placed.
    if (!r.recompute && L > 1 && ch.best && recompute_summary(ch.best->policy.exec) != "none") {
      for (int head : heads) {
        std::array<MemoryPlan*, 3> uni{};
        std::array<std::optional<MemoryPlan>, 3> rough;
        std::array<double, 3> secs{};
        for (int m = 0; m < 3; m++) {
          model::ExecOptions e;
          e.head_chunk = head;
          if (m) e.recompute.assign(size_t(L), model::Recompute(m));
          HR_ASSIGN_OR_RETURN(MemoryPlan mp,
                              plan_training_memory(r.config, policy(b, k, e), nullptr, false));
          secs[size_t(m)] = estimate_step(r.config, mp, r.device).step_seconds;
          rough[size_t(m)] = std::move(mp);
          uni[size_t(m)] = &*rough[size_t(m)];
        }
        const double m0 = double(uni[0]->peak_bytes);
        const double d_sel = (m0 - double(uni[1]->peak_bytes)) / L;
        const double d_full = (m0 - double(uni[2]->peak_bytes)) / L;
        const double t_sel = (secs[1] - secs[0]) / L, t_full = (secs[2] - secs[0]) / L;
        std::vector<std::tuple<double, int, int>> mixes;  // (extra seconds, full, selective)
        for (int nf = 0; nf <= L; nf++) {
          for (int ns = 0; nf + ns <= L; ns++) {
            if ((nf == L) || (ns == L) || (nf == 0 && ns == 0)) continue;  // uniform: done above
            if (m0 - nf * d_full - ns * d_sel > double(r.device_memory)) continue;
            mixes.push_back({nf * t_full + ns * t_sel, nf, ns});
          }
        }
        std::sort(mixes.begin(), mixes.end());
        std::vector<model::ExecOptions> tries;
        for (size_t i = 0; i < mixes.size() && i < 4; i++) {
          model::ExecOptions e;
          e.head_chunk = head;
          auto [t, nf, ns] = mixes[i];
          // Full recomputation on the first blocks, then selective, then none.
          for (int l = 0; l < L; l++) {
            e.recompute.push_back(l < nf        ? model::Recompute::kFull
                                  : l < nf + ns ? model::Recompute::kSelective
                                                : model::Recompute::kNone);
          }
          tries.push_back(e);
        }
        HR_RETURN_IF_ERROR(try_options(b, k, tries, &ch));
      }
    }
    if (!ch.best) {
      HR_ASSIGN_OR_RETURN(MemoryPlan mp,
                          plan_training_memory(r.config, policy(b, k, lean), nullptr, false));
      ch.leanest = evaluate(r, mp);
      ch.leanest.placed = false;
      ch.leanest.rejected_because =
          fmt::format("needs at least {} even with {}, {} over the {} budget",
                      format_bytes(mp.peak_bytes), describe_exec(lean),
                      format_bytes(mp.peak_bytes - r.device_memory), format_bytes(r.device_memory));
    }
    return ch;
  };

  // Candidates: every micro-batch that divides the per-device batch (or the one given).
  for (int b = 1; b <= per_device; b++) {
    if (per_device % b != 0 || (r.micro_batch && *r.micro_batch != b)) continue;
    HR_ASSIGN_OR_RETURN(Choice ch, choose(b, per_device / b));
    if (ch.best) {
      res.candidates.push_back(*ch.best);
      if (!res.chosen || ch.best->cost.tokens_per_s > res.chosen->cost.tokens_per_s) {
        res.chosen = ch.best;
        res.chosen_plan = std::move(ch.plan);
      }
    } else {
      res.rejected.push_back(ch.leanest);
    }
  }
  std::stable_sort(res.candidates.begin(), res.candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     return a.cost.tokens_per_s > b.cost.tokens_per_s;
                   });

  // The largest micro-batch that fits with the leanest technique allowed, whatever the global
  // batch: the plan grows with b, so a doubling then a bisection finds it with few plans.
  auto fits = [&](int b) -> Result<bool> {
    HR_ASSIGN_OR_RETURN(MemoryPlan rough,
                        plan_training_memory(r.config, policy(b, 1, lean), nullptr, false));
    if (rough.peak_bytes > r.device_memory) return false;
    HR_ASSIGN_OR_RETURN(MemoryPlan mp, place(b, 1, lean));
    return mp.peak_bytes <= r.device_memory;
  };
  HR_ASSIGN_OR_RETURN(bool one_fits, fits(1));
  if (one_fits) {
    int lo = 1, hi = 2;
    while (true) {
      HR_ASSIGN_OR_RETURN(bool f, fits(hi));
      if (!f || hi >= (1 << 20)) break;
      lo = hi;
      hi *= 2;
    }
    while (hi - lo > 1) {
      int mid = lo + (hi - lo) / 2;
      HR_ASSIGN_OR_RETURN(bool f, fits(mid));
      (f ? lo : hi) = mid;
    }
    res.max_micro_batch = lo;
  }
  if (r.sweep) {
    std::vector<int> bs;
    for (int b = 1; b <= std::max(1, res.max_micro_batch) * 2 && b <= (1 << 20); b *= 2) {
      bs.push_back(b);
    }
    if (res.max_micro_batch > 0) bs.push_back(res.max_micro_batch);
    std::sort(bs.begin(), bs.end());
    bs.erase(std::unique(bs.begin(), bs.end()), bs.end());
    for (int b : bs) {
      HR_ASSIGN_OR_RETURN(Choice ch, choose(b, 1));
      res.sweep.push_back(ch.best ? *ch.best : ch.leanest);
    }
  }
  if (!res.chosen) {
    HR_ASSIGN_OR_RETURN(MemoryPlan mp, place(1, per_device, lean));
    if (mp.peak_bytes > r.device_memory) {
      res.advice = advise(r, mp);
    } else {
      res.advice = fmt::format(
          "nothing fits with the constraints given{}{}; the largest micro-batch that fits is {}.\n",
          r.micro_batch ? fmt::format(" (--batch {})", *r.micro_batch) : "",
          r.recompute ? fmt::format(" (--recompute {})", model::recompute_name(*r.recompute)) : "",
          res.max_micro_batch);
      // Concrete alternatives: the same search with one constraint lifted at a time.
      auto alternative = [&](SearchRequest relaxed, const std::string& change) -> Status {
        relaxed.sweep = false;
        HR_ASSIGN_OR_RETURN(SearchResult alt, search_plan(relaxed));
        if (alt.chosen) {
          const Candidate& c = *alt.chosen;
          res.advice += fmt::format(
              "  - {}: micro-batch {} x {} accumulation with {} fits (peak {}, predicted {:.0f} "
              "tokens/s)\n",
              change, c.policy.micro_batch, c.policy.accumulation, describe_exec(c.policy.exec),
              format_bytes(c.peak_bytes), c.cost.tokens_per_s);
        }
        return Status::ok();
      };
      if (r.recompute) {
        SearchRequest relaxed = r;
        relaxed.recompute.reset();
        HR_RETURN_IF_ERROR(alternative(relaxed, "--recompute auto"));
      }
      if (r.micro_batch) {
        SearchRequest relaxed = r;
        relaxed.micro_batch.reset();
        HR_RETURN_IF_ERROR(alternative(
            relaxed, fmt::format("micro-batch {} -> the planner's choice (leave out --batch)",
                                 *r.micro_batch)));
      }
    }
  }
  res.planning_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace headroom::plan
