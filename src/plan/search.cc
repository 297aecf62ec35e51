// Candidate enumeration, pricing and the choice.
#include "plan/search.h"

#include <algorithm>
#include <chrono>
#include <map>

#include <fmt/format.h>

#include "core/units.h"

namespace headroom::plan {

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

// What each technique of the later issues would bring, from the smallest plan (micro-batch 1).
std::string advise(const SearchRequest& r, const MemoryPlan& smallest) {
  const uint64_t budget = r.device_memory;
  const uint64_t need = smallest.peak_bytes;
  const double P = double(smallest.params.total_floats);
  const double N = r.devices;
  const uint64_t persistent = smallest.persistent_bytes;
  const uint64_t step = smallest.step_bytes;
  std::string s = fmt::format(
      "nothing fits: even micro-batch 1 needs {} per device ({} persistent: weights, gradients, "
      "optimizer state; {} for one micro-batch), {} more than the {} budget.\n",
      format_bytes(need), format_bytes(persistent), format_bytes(step), format_bytes(need - budget),
      format_bytes(budget));
  s += "techniques that would close the gap (not built yet; estimates at micro-batch 1):\n";
  auto line = [&](const std::string& what, double bytes) {
    uint64_t b = uint64_t(bytes);
    s += fmt::format("  - {:<58} ~{:>10} per device  {}\n", what, format_bytes(b),
                     b <= budget ? "fits" : fmt::format("still {} over", format_bytes(b - budget)));
  };
  const double other = double(persistent) - 16.0 * P;  // staging
  const double logits = double(smallest.by_category[size_t(memory::Category::kLogits)]);
  double att = 0;  // the T x T attention probabilities that tiled attention never stores
  for (const memory::BufferDesc& buf : smallest.step.buffers) {
    if (buf.name.ends_with(".att")) att += double(buf.bytes());
  }
  const double C = r.config.n_embd, L = r.config.n_layer, T = r.seq;
  const double step_d = double(step);
  // Full recomputation keeps each block's input and one block's internals at a time.
  auto recomputed = [&](double step_bytes, double att_bytes, double logit_bytes) {
    double internals = (step_bytes - att_bytes - logit_bytes) / std::max(1.0, L);
    return std::min(step_bytes,
                    L * T * C * 4.0 + internals + att_bytes / std::max(1.0, L) + logit_bytes);
  };
  const double chunk = 1024.0 * r.config.vocab_size * 4.0;  // a fused LM head's logits chunk
  line("activation recomputation (full)", double(persistent) + recomputed(step_d, att, logits));
  line("tiled attention (no T x T probabilities kept)", double(persistent) + step_d - att);
  line("fused LM head + cross-entropy (logits in chunks)",
       double(persistent) + step_d - logits + std::min(logits, chunk));
  line("bf16 mixed precision (2+2 bytes + 12 bytes fp32 state/param)",
       16.0 * P + other + step_d / 2.0);
  line("optimizer offload (Adam moments on the host)", 8.0 * P + other + step_d);
  const double lean_step =
      recomputed(step_d - att - logits + std::min(logits, chunk), 0, std::min(logits, chunk)) / 2.0;
  if (r.devices > 1) {
    line(fmt::format("ZeRO-1 over {} devices (optimizer state sharded)", r.devices),
         8.0 * P + 8.0 * P / N + other + step_d);
    line(fmt::format("ZeRO-2 over {} devices (+ gradients)", r.devices),
         4.0 * P + 12.0 * P / N + other + step_d);
    line(fmt::format("ZeRO-3 over {} devices (+ parameters)", r.devices),
         16.0 * P / N + other + step_d);
    line(fmt::format("ZeRO-3 over {} + bf16 + all three activation techniques", r.devices),
         16.0 * P / N + other + lean_step);
    line(fmt::format("the same + optimizer offload (fp32 master and moments on the host)"),
         4.0 * P / N + other + lean_step);
  } else {
    line("ZeRO-3 over 4 devices (parameters, gradients, optimizer sharded)",
         16.0 * P / 4.0 + other + step_d);
    line("optimizer offload + bf16 + all three activation techniques", 4.0 * P + other + lean_step);
  }
  return s;
}

}  // namespace

Result<SearchResult> search_plan(const SearchRequest& r) {
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
  // Plans by micro-batch: the step region depends on (b, T) only, so each is placed once.
  std::map<int, MemoryPlan> by_batch;
  auto plan_for = [&](int b, int k) -> Result<MemoryPlan> {
    auto it = by_batch.find(b);
    HR_ASSIGN_OR_RETURN(MemoryPlan mp,
                        plan_training_memory(r.config, policy_for(r, b, k),
                                             it == by_batch.end() ? nullptr : &it->second));
    if (it == by_batch.end()) by_batch.emplace(b, mp);
    return mp;
  };
  // Candidates: every micro-batch that divides the per-device batch (or the one given).
  std::vector<int> sizes;
  for (int b = 1; b <= per_device; b++) {
    if (per_device % b == 0 && (!r.micro_batch || *r.micro_batch == b)) sizes.push_back(b);
  }
  std::optional<MemoryPlan> smallest;
  for (int b : sizes) {
    HR_ASSIGN_OR_RETURN(MemoryPlan mp, plan_for(b, per_device / b));
    Candidate c = evaluate(r, mp);
    if (c.fits) {
      res.candidates.push_back(c);
      if (!res.chosen || c.cost.tokens_per_s > res.chosen->cost.tokens_per_s) {
        res.chosen = c;
        res.chosen_plan = std::move(mp);
      }
    } else {
      res.rejected.push_back(c);
    }
  }
  std::stable_sort(res.candidates.begin(), res.candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     return a.cost.tokens_per_s > b.cost.tokens_per_s;
                   });

  // The largest micro-batch that fits, whatever the global batch: the plan grows with b, so a
  // doubling then a bisection finds it with few plans.
  auto fits = [&](int b) -> Result<bool> {
    HR_ASSIGN_OR_RETURN(MemoryPlan mp, plan_for(b, 1));
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
    for (int b = 1; b <= std::max(1, res.max_micro_batch) * 2 && b <= (1 << 20); b *= 2)
      bs.push_back(b);
    if (res.max_micro_batch > 0) bs.push_back(res.max_micro_batch);
    std::sort(bs.begin(), bs.end());
    bs.erase(std::unique(bs.begin(), bs.end()), bs.end());
    for (int b : bs) {
      HR_ASSIGN_OR_RETURN(MemoryPlan mp, plan_for(b, 1));
      res.sweep.push_back(evaluate(r, mp));
    }
  }
  if (!res.chosen) {
    HR_ASSIGN_OR_RETURN(MemoryPlan mp, plan_for(1, per_device));
    if (mp.peak_bytes > r.device_memory) {
      res.advice = advise(r, mp);
    } else {
      res.advice = fmt::format(
          "no micro-batch that divides the per-device batch {} fits{}; the largest that fits is {}",
          per_device, r.micro_batch ? fmt::format(" (--batch {} was given)", *r.micro_batch) : "",
          res.max_micro_batch);
    }
  }
  res.planning_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace headroom::plan
