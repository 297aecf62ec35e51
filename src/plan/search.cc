// Candidate enumeration, pricing and the choice.
#include "plan/search.h"

#include <algorithm>
#include <chrono>
#include <future>
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

int offloaded_blocks(const model::ExecOptions& e) {
  return int(std::count(e.offload.begin(), e.offload.end(), true));
}

std::vector<std::string> schedule_per_block(const model::ExecOptions& e, int n_layer) {
  std::vector<std::string> out;
  for (int l = 0; l < n_layer; l++) {
    const model::Recompute r = e.recompute_at(l);
    if (e.offload_at(l)) {
      out.push_back(r == model::Recompute::kSelective ? "selective+offload" : "offload");
    } else {
      out.push_back(std::string(model::recompute_name(r)));
    }
  }
  return out;
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
  if (const int n = offloaded_blocks(e); n > 0) {
    s += n == int(e.offload.size()) ? ", activations offloaded"
                                    : fmt::format(", activations of {} blocks offloaded", n);
  }
  if (!e.bf16_weight_copy) s += ", bf16 weights cast per layer";
  return s;
}

ZeroSpec planned_zero_spec(const model::ParamTable& params, const Policy& p, bool windows) {
  ZeroSpec z;
  z.stage = p.zero_stage;
  z.ranks = p.ranks;
  z.param_floats = params.total_floats;
  const bool bf16 = p.precision == "bf16";
  z.param_bytes = bf16 ? 2 : 4;  // the working copy the GEMMs read
  z.grad_bytes = 4;              // gradients stay fp32 (docs/notes/mixed-precision.md)
  z.master = bf16;
  z.micro_batches = p.accumulation;
  // Units as train/zero.h's gpt2_zero_units: per group (embeddings, block l, the rest) its
  // decayed and its other tensors, each padded to 16 floats. The search asks for the same table
  // thousands of times: the last answer is kept per thread (a GPT-2 table is identified by its
  // sizes and tensor count).
  struct Units {
    std::array<int64_t, 5> key{};
    int64_t largest = 0, largest_block = 0, embedding = 0, shard = 0;
  };
  thread_local Units last;
  const std::array<int64_t, 5> key = {params.total_floats, params.num_parameters,
                                      params.decay_floats, int64_t(params.params.size()), p.ranks};
  if (last.key != key) {
    std::map<std::pair<int, bool>, std::pair<int64_t, int64_t>> units;
    for (const model::ParamDesc& d : params.params) {
      const bool emb = d.name.rfind("wte.", 0) == 0 || d.name.rfind("wpe.", 0) == 0;
      const int group = emb                          ? 0
                        : d.name.rfind("h.", 0) == 0 ? 1 + std::stoi(d.name.substr(2))
                                                     : INT32_MAX;
      const int64_t end = d.offset + (d.shape.numel() + 15) / 16 * 16;
      auto [it, fresh] = units.try_emplace({group, d.decay}, std::make_pair(d.offset, end));
      if (!fresh) {
        it->second.first = std::min(it->second.first, d.offset);
        it->second.second = std::max(it->second.second, end);
      }
    }
    Units u;
    u.key = key;
    for (const auto& [group, range] : units) {
      const int64_t n = range.second - range.first;
      u.largest = std::max(u.largest, n);
      if (group.first == 0) u.embedding += n;
      if (group.first != 0 && group.first != INT32_MAX) {
        u.largest_block = std::max(u.largest_block, n);
      }
      u.shard += ((n + p.ranks - 1) / p.ranks + 15) / 16 * 16;  // the largest rank's piece
    }
    last = u;
  }
  const int64_t largest = last.largest, largest_block = last.largest_block,
                embedding = last.embedding, shard = last.shard;
  if (z.stage == 3) z.shard_floats = shard;
  if (windows && z.stage >= 2) z.grad_window_floats = embedding + 2 * largest_block;
  if (z.stage == 3) z.gather_window_floats = windows ? 2 * largest : params.total_floats;
  return z;
}

namespace {

// One rank's bytes: plan_training_memory plans a full replica; the model state (weights,
// master, gradients, optimizer) is replaced by this rank's share (zero_memory), the step region
// stays as planned. Stage 3's gathered-unit slots are communication buffers (category comm).
// `executor_layout` (SearchRequest::zero_windows false): the buffers the CPU trainer allocates,
// which keeps the fp32 parameters (the master weights with bf16) whole in stages 1-2: the
// all-gather moves them (plan_training_memory's regions; docs/notes/zero.md).
void shard_plan(MemoryPlan* mp, const ZeroSpec& z, bool executor_layout) {
  using memory::Category;
  const auto state = [](Category c) {
    return c == Category::kWeights || c == Category::kMaster || c == Category::kGrads ||
           c == Category::kOptimizer;
  };
  for (const Region& region : mp->persistent) {
    if (!state(region.category)) continue;
    mp->persistent_bytes -= region.layout.size;
    for (const memory::BufferDesc& b : region.buffers) {
      mp->by_category[size_t(b.category)] -= b.bytes();
    }
  }
  ZeroMemory m = zero_memory(z);
  if (executor_layout && z.master && (z.stage == 1 || z.stage == 2)) m.master = z.param_floats * 4;
  const int64_t gathered = z.stage == 3 ? z.gather_window_floats * z.param_bytes : 0;
  mp->by_category[size_t(Category::kWeights)] += uint64_t(m.params - gathered);
  mp->by_category[size_t(Category::kComm)] += uint64_t(gathered);
  mp->by_category[size_t(Category::kMaster)] += uint64_t(m.master);
  mp->by_category[size_t(Category::kGrads)] += uint64_t(m.grads + m.grad_shard);
  mp->by_category[size_t(Category::kOptimizer)] += uint64_t(m.optimizer);
  mp->persistent_bytes += uint64_t(m.total());
  mp->peak_bytes = mp->persistent_bytes + mp->step_bytes;
  mp->lower_bound_bytes = mp->persistent_bytes + mp->step_lower_bound;
  mp->policy.ranks = z.ranks;
  mp->policy.zero_stage = z.stage;
}

StepCost price(const SearchRequest& r, const MemoryPlan& mp) {
  if (r.devices <= 1) return estimate_step(r.config, mp, r.device);
  const ZeroSpec z = planned_zero_spec(mp.params, mp.policy, r.zero_windows);
  return estimate_step(r.config, mp, r.device, &z);
}

Candidate evaluate(const SearchRequest& r, const MemoryPlan& mp) {
  Candidate c;
  c.policy = mp.policy;
  c.peak_bytes = mp.peak_bytes;
  c.lower_bound_bytes = mp.lower_bound_bytes;
  c.by_category = mp.by_category;
  c.offload_bytes = mp.offload_bytes;
  c.cost = price(r, mp);
  c.fits = mp.peak_bytes <= r.device_memory;
  if (!c.fits) {
    c.rejected_because =
        fmt::format("needs {}, {} over the {} budget", format_bytes(mp.peak_bytes),
                    format_bytes(mp.peak_bytes - r.device_memory), format_bytes(r.device_memory));
  } else if (mp.offload_bytes > r.offload_memory) {
    c.fits = false;
    c.rejected_because = fmt::format(
        "offloads {} of activations, {} over the {} offload tier (--offload-memory)",
        format_bytes(mp.offload_bytes), format_bytes(mp.offload_bytes - r.offload_memory),
        format_bytes(r.offload_memory));
  }
  return c;
}

Policy policy_for(const SearchRequest& r, int b, int k) {
  Policy p;
  p.micro_batch = b;
  p.accumulation = k;
  p.seq = r.seq;
  p.precision = r.precision;
  p.ranks = r.devices;
  p.zero_stage = 0;  // planned as a full replica; shard_plan makes it one rank's share
  return p;
}

// What the techniques not built yet would bring, from the leanest plan the engine can run
// (micro-batch 1, every activation technique on).
std::string advise(const SearchRequest& r, const MemoryPlan& lean) {
  const uint64_t budget = r.device_memory;
  const uint64_t need = lean.peak_bytes;
  const double P = double(lean.params.total_floats);
  const double step = double(lean.step_bytes);
  const double other = double(lean.persistent_bytes) - 16.0 * P;  // token staging
  const int stage = lean.policy.zero_stage;
  std::string s = fmt::format(
      "nothing fits: even micro-batch 1 with full recomputation, tiled attention and the fused LM "
      "head needs {} per device ({} persistent: weights, gradients, optimizer state{}; {} for one "
      "micro-batch), {} more than the {} budget.\n",
      format_bytes(need), format_bytes(lean.persistent_bytes),
      r.devices > 1
          ? fmt::format(", {} precision, ZeRO-{} over {} devices", r.precision, stage, r.devices)
          : std::string(),
      format_bytes(lean.step_bytes), format_bytes(need - budget), format_bytes(budget));
  s += "techniques that would close the gap (estimates at micro-batch 1; activation offload, "
       "--offload-activations, is searched already; optimizer offload is not built "
       "yet):\n";
  auto line = [&](const std::string& what, double bytes) {
    uint64_t b = uint64_t(bytes);
    s += fmt::format("  - {:<66} ~{:>10} per device  {}\n", what, format_bytes(b),
                     b <= budget ? "fits" : fmt::format("still {} over", format_bytes(b - budget)));
  };
  if (r.devices > 1) {
    // From this rank's bytes: what leaves the device, or shrinks with more ranks.
    const auto cat = [&](memory::Category c) { return double(lean.by_category[size_t(c)]); };
    const double optimizer = cat(memory::Category::kOptimizer);
    const double master = cat(memory::Category::kMaster);
    line(fmt::format("ZeRO-{} + optimizer offload (Adam moments on the host)", stage),
         double(need) - optimizer);
    if (master > 0) {
      line(fmt::format("ZeRO-{} + optimizer offload with the fp32 master weights", stage),
           double(need) - optimizer - master);
    }
    Policy wider = lean.policy;
    wider.ranks = 2 * r.devices;
    const double now =
        double(zero_memory(planned_zero_spec(lean.params, lean.policy, r.zero_windows)).total());
    const double then =
        double(zero_memory(planned_zero_spec(lean.params, wider, r.zero_windows)).total());
    line(fmt::format("ZeRO-{} over {} devices (built: --devices {})", stage, 2 * r.devices,
                     2 * r.devices),
         double(need) - now + then);
    return s;
  }
  if (r.precision == "fp32") {
    line("bf16 mixed precision (built: --precision bf16; +2 bytes per parameter, bf16 activations)",
         18.0 * P + other + step / 2.0);
  }
  line("optimizer offload (fp32 moments on the host)", 8.0 * P + other + step);
  line("bf16 + optimizer offload (fp32 master and moments on the host)",
       4.0 * P + other + step / 2.0);
  line("ZeRO-3 over 4 devices (built in the planner: --devices 4; all model state sharded)",
       16.0 * P / 4.0 + other + step);
  return s;
}

}  // namespace

namespace {
// Two searches side by side (fp32 and bf16; ZeRO stages): the faster choice wins, ties go to the
// first (the simpler technique), and when neither fits the second (the leaner: bf16, a higher
// stage) gives the advice. The candidates of both are listed.
SearchResult merge_results(SearchResult first, SearchResult second) {
  const auto speed = [](const SearchResult& s) {
    return s.chosen ? s.chosen->cost.tokens_per_s : -1.0;
  };
  const bool second_wins = second.chosen ? speed(second) > speed(first) : !first.chosen;
  SearchResult out = second_wins ? second : first;
  const SearchResult& other = second_wins ? first : second;
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

namespace {

// Replica plans (before shard_plan) by precision, micro-batch, accumulation, placement and
// technique: the step region does not depend on the ZeRO stage, so the searches of the four
// stages share them.
using PlanCache = std::map<std::string, MemoryPlan>;

Result<SearchResult> search_leaf(const SearchRequest& r, PlanCache& cache);

}  // namespace

Result<SearchResult> search_plan(const SearchRequest& r) {
  if (r.zero_stage && (*r.zero_stage < 0 || *r.zero_stage > 3)) {
    return Status::invalid_argument(
        fmt::format("--zero {}: expected auto, 0, 1, 2 or 3", *r.zero_stage));
  }
  if (r.zero_stage && *r.zero_stage > 0 && r.devices == 1) {
    return Status::invalid_argument(fmt::format(
        "--zero {} shards over data-parallel ranks: it needs --devices 2 or more", *r.zero_stage));
  }
  if (r.devices > 1 && !(r.device.interconnect_bandwidth > 0)) {
    return Status::invalid_argument(
        fmt::format("--devices {}: device {} has no interconnect bandwidth to price "
                    "communication with",
                    r.devices, r.device.name));
  }
  if (r.precision == "auto" || (r.devices > 1 && !r.zero_stage)) {
    // Searched side by side: precisions (fp32, and bf16 where the device has bf16 GEMMs), then
    // ZeRO stages 0-3 for several devices; the fastest fitting choice wins.
    auto t0 = std::chrono::steady_clock::now();
    std::vector<SearchRequest> leaves;
    for (const char* precision : {"fp32", "bf16"}) {
      if (r.precision != "auto" && r.precision != precision) continue;
      if (std::string(precision) == "bf16" && r.precision == "auto" && !(r.device.flops_bf16 > 0)) {
        continue;
      }
      for (int z = 0; z <= 3; z++) {
        if (r.devices > 1 ? (r.zero_stage ? *r.zero_stage != z : z > r.max_zero_stage) : z > 0) {
          continue;
        }
        SearchRequest leaf = r;
        leaf.precision = r.precision == "auto" ? precision : r.precision;
        leaf.zero_stage = r.devices > 1 ? z : 0;
        leaves.push_back(std::move(leaf));
      }
    }
    if (r.precision != "auto" && leaves.empty()) {  // an unknown precision: the leaf says so
      SearchRequest leaf = r;
      leaf.zero_stage = 0;
      leaves.push_back(leaf);
    }
    // One thread per precision (their plans share nothing; the stages of one precision share
    // a cache), merged in a fixed order, so the result does not depend on timing.
    auto group = [&leaves](const std::string& precision) -> Result<std::optional<SearchResult>> {
      std::optional<SearchResult> out;
      PlanCache cache;
      for (const SearchRequest& leaf : leaves) {
        if (leaf.precision != precision) continue;
        HR_ASSIGN_OR_RETURN(SearchResult one, search_leaf(leaf, cache));
        out = out ? merge_results(std::move(*out), std::move(one)) : std::move(one);
      }
      return out;
    };
    std::vector<std::string> precisions;
    for (const SearchRequest& leaf : leaves) {
      if (std::find(precisions.begin(), precisions.end(), leaf.precision) == precisions.end()) {
        precisions.push_back(leaf.precision);
      }
    }
    std::vector<std::future<Result<std::optional<SearchResult>>>> others;
    for (size_t i = 1; i < precisions.size(); i++) {
      others.push_back(std::async(std::launch::async, group, precisions[i]));
    }
    Result<std::optional<SearchResult>> first = group(precisions[0]);
    std::optional<SearchResult> out;
    for (size_t i = 0; i < precisions.size(); i++) {
      Result<std::optional<SearchResult>> part = i == 0 ? std::move(first) : others[i - 1].get();
      if (!part.is_ok()) {
        for (size_t j = i; j < others.size(); j++) others[j].wait();
        return part.status();
      }
      if (!*part) continue;
      out = out ? merge_results(std::move(*out), std::move(**part)) : std::move(**part);
    }
    out->planning_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return std::move(*out);
  }
  PlanCache cache;
  return search_leaf(r, cache);
}

namespace {

Result<SearchResult> search_leaf(const SearchRequest& r, PlanCache& cache) {
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
  // Activation offload: searched (auto) where there is an offload tier and a bandwidth to price
  // the transfers with; forced on every block that keeps something (on); never (off).
  const double offload_bw =
      r.device.offload_bandwidth > 0 ? r.device.offload_bandwidth : r.device.host_link_bandwidth;
  const bool offload_on = r.offload_activations.value_or(false);
  const bool offload_auto = !r.offload_activations && r.offload_memory > 0 && offload_bw > 0;
  if (offload_on) {
    if (!(offload_bw > 0)) {
      return Status::invalid_argument(fmt::format(
          "--offload-activations on: device {} has no offload bandwidth to price transfers with",
          r.device.name));
    }
    if (r.recompute == model::Recompute::kFull) {
      return Status::invalid_argument(
          "--offload-activations on with --recompute full: a fully recomputed block keeps "
          "nothing to offload; use --recompute none or selective, or --offload-activations auto");
    }
    std::erase(modes, model::Recompute::kFull);
  }
  std::vector<bool> offload_choices = {offload_on};
  // Offloading options first, so that the last option stays the leanest without offload.
  if (offload_auto) offload_choices = {true, false};
  // bf16: keep a persistent bf16 copy of the weights, or cast each layer's before use (leaner,
  // a cast pass per use): both priced.
  std::vector<bool> copies = {true};
  if (r.precision == "bf16") copies.push_back(false);
  for (bool copy : copies) {
    for (int head : heads) {
      for (bool off : offload_choices) {
        for (model::Recompute m : modes) {
          if (off && m == model::Recompute::kFull) continue;  // nothing kept to offload
          model::ExecOptions e;
          e.tiled_attention = true;
          e.head_chunk = head;
          e.bf16_weight_copy = copy;
          if (m != model::Recompute::kNone) e.recompute.assign(size_t(L), m);
          if (off) e.offload.assign(size_t(L), true);
          options.push_back(e);
        }
      }
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
  // Every plan of this search: a full replica from plan_training_memory, then (devices > 1)
  // this rank's share of the model state at the requested stage.
  // The plans are kept (std::map: stable addresses) and handed out by pointer: the search asks
  // for the same few dozen many times, and a copy of a large model's plan costs more than the
  // pricing.
  const int stage = r.zero_stage.value_or(0);
  std::map<std::string, MemoryPlan> sharded;  // this stage's share of the replicas in `cache`
  auto plan_mem = [&](int b, int k, const model::ExecOptions& e, const MemoryPlan* same,
                      bool do_place) -> Result<const MemoryPlan*> {
    const std::string key =
        fmt::format("{} {} {} {} {}", r.precision, b, k, do_place, describe_exec(e));
    if (r.devices > 1) {
      auto own = sharded.find(key);
      if (own != sharded.end()) return &own->second;
    }
    auto hit = cache.find(key);
    if (hit == cache.end()) {
      HR_ASSIGN_OR_RETURN(MemoryPlan fresh,
                          plan_training_memory(r.config, policy(b, k, e), same, do_place));
      hit = cache.emplace(key, std::move(fresh)).first;
    }
    if (r.devices <= 1) return &hit->second;
    MemoryPlan mp = hit->second;
    Policy zp = mp.policy;
    zp.zero_stage = stage;
    shard_plan(&mp, planned_zero_spec(mp.params, zp, r.zero_windows), !r.zero_windows);
    return &sharded.emplace(key, std::move(mp)).first->second;
  };
  auto place = [&](int b, int k, const model::ExecOptions& e) -> Result<MemoryPlan> {
    auto key = std::make_pair(b, describe_exec(e));
    auto it = placed.find(key);
    if (it == placed.end()) res.plans_placed++;
    HR_ASSIGN_OR_RETURN(const MemoryPlan* mp,
                        plan_mem(b, k, e, it == placed.end() ? nullptr : &it->second, true));
    if (it == placed.end()) placed.emplace(key, *mp);
    return *mp;
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
      HR_ASSIGN_OR_RETURN(const MemoryPlan* rough, plan_mem(b, k, e, nullptr, /*do_place=*/false));
      Candidate c = evaluate(r, *rough);
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
    // An optimal per-block schedule (see docs/notes/recompute.md and offload-activations.md):
    // blocks are identical, so a schedule is a count of fully recomputed, offloaded and
    // selectively recomputed blocks. Memory and time are linear in the counts (slopes measured
    // from the uniform plans; an offloaded block's exposed transfer time is its own); every count
    // triple under the budgets is priced, the fastest few are placed and priced exactly.
    const bool any_technique = ch.best && (recompute_summary(ch.best->policy.exec) != "none" ||
                                           offloaded_blocks(ch.best->policy.exec) > 0);
    if (!r.recompute && !offload_on && L > 1 && any_technique) {
      for (int head : heads) {
        const int uniforms = offload_auto ? 4 : 3;  // none, selective, full, offload
        std::array<const MemoryPlan*, 4> uni{};
        std::array<double, 4> secs{};
        for (int m = 0; m < uniforms; m++) {
          model::ExecOptions e;
          e.head_chunk = head;
          e.bf16_weight_copy = ch.best->policy.exec.bf16_weight_copy;
          if (m == 1 || m == 2) e.recompute.assign(size_t(L), model::Recompute(m));
          if (m == 3) e.offload.assign(size_t(L), true);
          HR_ASSIGN_OR_RETURN(const MemoryPlan* mp, plan_mem(b, k, e, nullptr, false));
          secs[size_t(m)] = price(r, *mp).step_seconds;
          uni[size_t(m)] = mp;
        }
        const double m0 = double(uni[0]->peak_bytes);
        const double d_sel = (m0 - double(uni[1]->peak_bytes)) / L;
        const double d_full = (m0 - double(uni[2]->peak_bytes)) / L;
        const double t_sel = (secs[1] - secs[0]) / L, t_full = (secs[2] - secs[0]) / L;
        const double d_off = offload_auto ? (m0 - double(uni[3]->peak_bytes)) / L : 0.0;
        const double t_off = offload_auto ? (secs[3] - secs[0]) / L : 0.0;
        const double tier_off = offload_auto ? double(uni[3]->offload_bytes) / L : 0.0;
        const int max_off = offload_auto ? L : 0;
        // (extra seconds, full, offloaded, selective)
        std::vector<std::tuple<double, int, int, int>> mixes;
        for (int nf = 0; nf <= L; nf++) {
          for (int no = 0; nf + no <= std::min(L, nf + max_off); no++) {
            for (int ns = 0; nf + no + ns <= L; ns++) {
              if (nf == L || ns == L || no == L || (nf == 0 && ns == 0 && no == 0)) continue;
              if (m0 - nf * d_full - ns * d_sel - no * d_off > double(r.device_memory)) continue;
              if (no * tier_off > double(r.offload_memory)) continue;
              mixes.push_back({nf * t_full + ns * t_sel + no * t_off, nf, no, ns});
            }
          }
        }
        std::sort(mixes.begin(), mixes.end());
        std::vector<model::ExecOptions> tries;
        for (size_t i = 0; i < mixes.size() && i < 4; i++) {
          model::ExecOptions e;
          e.head_chunk = head;
          e.bf16_weight_copy = ch.best->policy.exec.bf16_weight_copy;
          auto [t, nf, no, ns] = mixes[i];
          // Full recomputation on the first blocks, then offload, then selective, then none.
          for (int l = 0; l < L; l++) {
            e.recompute.push_back(l < nf             ? model::Recompute::kFull
                                  : l < nf + no      ? model::Recompute::kNone
                                  : l < nf + no + ns ? model::Recompute::kSelective
                                                     : model::Recompute::kNone);
            if (no > 0) e.offload.push_back(l >= nf && l < nf + no);
          }
          tries.push_back(e);
        }
        HR_RETURN_IF_ERROR(try_options(b, k, tries, &ch));
      }
    }
    if (!ch.best) {
      HR_ASSIGN_OR_RETURN(const MemoryPlan* mp, plan_mem(b, k, lean, nullptr, false));
      ch.leanest = evaluate(r, *mp);
      ch.leanest.placed = false;
      ch.leanest.rejected_because = fmt::format(
          "needs at least {} even with {}, {} over the {} budget", format_bytes(mp->peak_bytes),
          describe_exec(lean), format_bytes(mp->peak_bytes - r.device_memory),
          format_bytes(r.device_memory));
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
    HR_ASSIGN_OR_RETURN(const MemoryPlan* rough, plan_mem(b, 1, lean, nullptr, false));
    if (rough->peak_bytes > r.device_memory) return false;
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

}  // namespace

}  // namespace headroom::plan
