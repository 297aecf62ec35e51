// Candidate enumeration, pricing and the choice.
#include "plan/search.h"

#include <algorithm>
#include <chrono>
#include <future>
#include <limits>
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
  if (e.precision == model::Precision::kFp16) {
    s += ", f16 weights cast per layer";
  } else if (!e.bf16_weight_copy) {
    s += ", bf16 weights cast per layer";
  }
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
  z.offload_optimizer = p.offload_optimizer;
  // Updated weights come back in the working copy's dtype: bf16 where the device holds bf16
  // weights only (windows: the GPU layout), fp32 for the CPU executor (it casts its bf16 copy).
  z.offload_return_bytes = windows && bf16 ? 2 : 4;
  // Units as train/zero.h's gpt2_zero_units: per group (embeddings, block l, the rest) its
  // decayed and its other tensors, each padded to 16 floats. The search asks for the same table
  // thousands of times: the last answer is kept per thread (a GPT-2 table is identified by its
  // sizes and tensor count).
  struct Units {
    std::array<int64_t, 5> key{};
    int64_t largest = 0, largest_block = 0, embedding = 0, head = 0, shard = 0;
  };
  thread_local Units last;
  const std::array<int64_t, 5> key = {params.total_floats, params.num_parameters,
                                      params.decay_floats, int64_t(params.params.size()), p.ranks};
  if (last.key != key) {
    std::map<std::pair<int, bool>, std::pair<int64_t, int64_t>> units;
    for (const model::ParamDesc& d : params.params) {
      const int g = params.group_of(d);
      const int group = g == INT32_MAX ? INT32_MAX : g + 1;
      const int64_t end = model::ParamTable::end_of(d);
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
      // The embeddings' window; an untied head (the head's decayed unit) shares it.
      if (group.first == 0) u.embedding += n;
      if (group.first == INT32_MAX && group.second) u.head = n;
      if (group.first != 0 && group.first != INT32_MAX) {
        u.largest_block = std::max(u.largest_block, n);
      }
      u.shard += ((n + p.ranks - 1) / p.ranks + 15) / 16 * 16;  // the largest rank's piece
    }
    u.embedding = std::max(u.embedding, u.head);
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
  // The CPU executor reads whole fp32 parameters in stages 0-2 (with bf16 too): the master
  // weights, or with optimizer offload working weights (the master is the offload tier's).
  int64_t fp32_working = 0;
  if (executor_layout && z.master && z.stage <= 2) {
    if (z.offload_optimizer) {
      fp32_working = z.param_floats * 4;
    } else if (z.stage >= 1) {
      m.master = z.param_floats * 4;
    }
  }
  const int64_t gathered = z.stage == 3 ? z.gather_window_floats * z.param_bytes : 0;
  mp->by_category[size_t(Category::kWeights)] += uint64_t(m.params - gathered + fp32_working);
  mp->by_category[size_t(Category::kComm)] += uint64_t(gathered);
  mp->by_category[size_t(Category::kMaster)] += uint64_t(m.master);
  mp->by_category[size_t(Category::kGrads)] += uint64_t(m.grads + m.grad_shard);
  mp->by_category[size_t(Category::kOptimizer)] += uint64_t(m.optimizer);
  mp->persistent_bytes += uint64_t(m.total() + fp32_working);
  // The offload tier: this rank's optimizer state, next to the offloaded activations (a
  // micro-batch's, whatever the stage).
  if (mp->policy.offload_optimizer) {
    mp->offload_bytes = uint64_t(m.offloaded) + offloaded_activation_bytes(*mp);
  }
  mp->peak_bytes = mp->persistent_bytes + mp->step_bytes;
  mp->lower_bound_bytes = mp->persistent_bytes + mp->step_lower_bound;
  mp->policy.ranks = z.ranks;
  mp->policy.zero_stage = z.stage;
}

StepCost price(const SearchRequest& r, const MemoryPlan& mp) {
  if (r.devices <= 1) return estimate_step(r.config, mp, r.device);
  const ZeroSpec z = planned_zero_spec(mp.params, mp.policy, r.zero_windows || r.executor_layout);
  return estimate_step(r.config, mp, r.device, &z);
}

Candidate evaluate(const SearchRequest& r, const MemoryPlan& mp) {
  Candidate c;
  c.policy = mp.policy;
  c.peak_bytes = mp.peak_bytes;
  c.lower_bound_bytes = mp.lower_bound_bytes;
  c.by_category = mp.by_category;
  c.offload_bytes = mp.offload_bytes;
  c.offload_activation_bytes = offloaded_activation_bytes(mp);
  c.cost = price(r, mp);
  const bool offload_fits = r.offload_memory == 0 || mp.offload_bytes <= r.offload_memory;
  c.fits = mp.peak_bytes <= r.device_memory && offload_fits;
  if (mp.peak_bytes > r.device_memory) {
    c.rejected_because =
        fmt::format("needs {}, {} over the {} budget", format_bytes(mp.peak_bytes),
                    format_bytes(mp.peak_bytes - r.device_memory), format_bytes(r.device_memory));
  } else if (!offload_fits) {
    c.rejected_because = fmt::format(
        "the offload tier needs {} ({}), {} over the {} offload budget (--offload-memory)",
        format_bytes(mp.offload_bytes), offload_parts(mp),
        format_bytes(mp.offload_bytes - r.offload_memory), format_bytes(r.offload_memory));
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
  p.backend_fixed = r.device.backend_fixed;  // the context, workspaces (and NCCL's buffers)
  p.ops = r.ops;
  p.exec.distill = r.distill;
  return p;
}

// What the techniques not used by `lean` would bring, from the leanest plan the engine can run
// (micro-batch 1, every activation technique on, and optimizer offload when it was allowed).
std::string advise(const SearchRequest& r, const MemoryPlan& lean) {
  const uint64_t budget = r.device_memory;
  const uint64_t need = lean.peak_bytes;
  const double P = double(lean.params.total_floats);
  const double step = double(lean.step_bytes);
  const bool offloaded = lean.policy.offload_optimizer;
  const int stage = lean.policy.zero_stage;
  std::string s = fmt::format(
      "nothing fits: even micro-batch 1 with full recomputation, tiled attention and the fused LM "
      "head needs {} per device ({} persistent: {}{}; {} for one micro-batch), {} more than the {} "
      "budget.\n",
      format_bytes(need), format_bytes(lean.persistent_bytes),
      offloaded ? fmt::format("weights and gradients, with the optimizer state ({}) in the "
                              "offload tier",
                              format_bytes(lean.offload_bytes))
                : std::string("weights, gradients, optimizer state"),
      r.devices > 1
          ? fmt::format(", {} precision, ZeRO-{} over {} devices", r.precision, stage, r.devices)
          : std::string(),
      format_bytes(lean.step_bytes), format_bytes(need - budget), format_bytes(budget));
  s += "techniques that would close the gap (estimates at micro-batch 1; activation offload, "
       "--offload-activations, is searched already):\n";
  auto line = [&](const std::string& what, double bytes) {
    uint64_t b = uint64_t(bytes);
    s += fmt::format("  - {:<66} ~{:>10} per device  {}\n", what, format_bytes(b),
                     b <= budget ? "fits" : fmt::format("still {} over", format_bytes(b - budget)));
  };
  if (r.devices > 1) {
    // From this rank's bytes: what leaves the device, or shrinks with more ranks. The CPU
    // executor keeps whole fp32 parameters with bf16 in stages 0-2 (as shard_plan counts).
    const auto rank_state = [&](const Policy& p) {
      const ZeroMemory m = zero_memory(planned_zero_spec(lean.params, p, r.zero_windows));
      double bytes = double(m.total());
      if (!r.zero_windows && p.precision == "bf16" && p.zero_stage <= 2) {
        bytes += 4.0 * P - double(m.master);
      }
      return bytes;
    };
    const double now = rank_state(lean.policy);
    if (!offloaded) {
      Policy off = lean.policy;
      off.offload_optimizer = true;
      line(fmt::format("ZeRO-{} + optimizer offload (built: --offload-optimizer on)", stage),
           double(need) - now + rank_state(off));
    }
    Policy wider = lean.policy;
    wider.ranks = 2 * r.devices;
    line(fmt::format("ZeRO-{} over {} devices{} (built: --devices {})", stage, 2 * r.devices,
                     offloaded ? " with optimizer offload" : "", 2 * r.devices),
         double(need) - now + rank_state(wider));
    return s;
  }
  const double other = double(lean.by_category[size_t(memory::Category::kStaging)]);
  if (r.precision == "fp32") {
    line("bf16 mixed precision (built: --precision bf16; +2 bytes per parameter, bf16 activations)",
         double(need) + 2.0 * P - step / 2.0);
  }
  if (!offloaded) {
    MemoryPlan alt = lean;
    offload_optimizer_state(&alt);
    line("optimizer offload (built: --offload-optimizer on; master, m, v in the offload tier)",
         double(alt.peak_bytes));
  }
  line(fmt::format("ZeRO-3 over 4 devices (built in the planner: --devices 4; all model state "
                   "sharded{})",
                   offloaded ? ", optimizer offload" : ""),
       (offloaded ? 8.0 : 16.0) * P / 4.0 + other + step);
  return s;
}

}  // namespace

namespace {
// Whether optimizer offload makes every plan slower than the same plan without it: its copies
// (4 bytes a float out, at least 2 back) and host pass (36 bytes a float at host bandwidth) cost
// more than the device's optimizer pass it replaces (36 bytes a float at device bandwidth).
bool offload_never_faster(const DeviceSpec& d) {
  const double host = d.host_memory_bandwidth > 0 ? d.host_memory_bandwidth : d.mem_bandwidth;
  const double link = offload_link_bandwidth(d);
  return link > 0 && host > 0 && 6.0 / link + 36.0 / host >= 36.0 / d.mem_bandwidth;
}

// Two searches side by side (fp32 and bf16; ZeRO stages): the faster choice wins, ties go to the
// first (the simpler technique), and when neither fits the second (the leaner: bf16, a higher
// stage) gives the advice. The candidates of both are listed.
SearchResult merge_results(SearchResult first, SearchResult second) {
  const auto speed = [](const SearchResult& s) {
    return s.chosen ? s.chosen->cost.tokens_per_s : -1.0;
  };
  const bool second_wins = second.chosen ? speed(second) > speed(first) : !first.chosen;
  // Moved, not copied: a large model's chosen plan is costly to copy.
  SearchResult out = second_wins ? std::move(second) : std::move(first);
  const SearchResult& other = second_wins ? first : second;
  out.candidates.insert(out.candidates.end(), other.candidates.begin(), other.candidates.end());
  std::stable_sort(out.candidates.begin(), out.candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     return a.cost.tokens_per_s > b.cost.tokens_per_s;
                   });
  out.rejected.insert(out.rejected.end(), other.rejected.begin(), other.rejected.end());
  out.plans_placed += other.plans_placed;
  out.max_micro_batch = std::max(out.max_micro_batch, other.max_micro_batch);
  out.fastest_rejected_tokens_per_s =
      std::max(out.fastest_rejected_tokens_per_s, other.fastest_rejected_tokens_per_s);
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

Result<SearchResult> search_plan(const SearchRequest& request) {
  const SearchRequest& r = request;
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
  if (r.offload_optimizer.value_or(false) && !(offload_link_bandwidth(r.device) > 0)) {
    return Status::invalid_argument(
        fmt::format("--offload-optimizer on: device {} has no host link bandwidth to price the "
                    "offload copies with",
                    r.device.name));
  }
  if (r.devices > 1 && r.device.kind == "gpu" && r.device.backend_fixed.collective == 0) {
    // Several ranks on GPUs: NCCL's buffers in every candidate (an estimate unless the spec has
    // a figure), added once here rather than per candidate.
    SearchRequest with_nccl = r;
    with_nccl.device.backend_fixed = with_collective_buffers(r.device.backend_fixed);
    return search_plan(with_nccl);
  }
  if (r.precision == "auto" || (r.devices > 1 && !r.zero_stage) || !r.offload_optimizer) {
    // Searched side by side: precisions (fp32, and bf16 where the device has bf16 GEMMs), then
    // ZeRO stages 0-3 for several devices, then optimizer offload off and on; the fastest
    // fitting choice wins (ties: the earlier, simpler one).
    auto t0 = std::chrono::steady_clock::now();
    std::vector<SearchRequest> leaves;
    for (const char* precision : {"fp32", "bf16", "fp16"}) {
      if (r.precision != "auto" && r.precision != precision) continue;
      // fp16 is an explicit choice: on the CPU its GEMMs are fp32 ones on widened operands
      // (never faster than fp32), and it needs loss scaling (docs/notes/mixed-precision.md).
      if (std::string(precision) == "fp16" && r.precision == "auto") continue;
      if (std::string(precision) == "bf16" && r.precision == "auto" && !(r.device.flops_bf16 > 0)) {
        continue;
      }
      for (int z = 0; z <= 3; z++) {
        if (r.devices > 1 ? (r.zero_stage ? *r.zero_stage != z : z > r.max_zero_stage) : z > 0) {
          continue;
        }
        for (bool offload : {false, true}) {
          if (r.offload_optimizer && *r.offload_optimizer != offload) continue;
          // No host link figure: offload cannot be priced (an explicit request is refused below).
          if (offload && !r.offload_optimizer && !(offload_link_bandwidth(r.device) > 0)) continue;
          SearchRequest leaf = r;
          leaf.precision = r.precision == "auto" ? precision : r.precision;
          leaf.zero_stage = r.devices > 1 ? z : 0;
          leaf.offload_optimizer = offload;
          // With optimizer offload the leaf still searches activation offload per block: both
          // share the offload tier and its budget (docs/notes/offload.md, "Both kinds").
          leaves.push_back(std::move(leaf));
        }
      }
    }
    if (r.precision != "auto" && leaves.empty()) {  // an unknown precision: the leaf says so
      SearchRequest leaf = r;
      leaf.zero_stage = 0;
      leaf.offload_optimizer = r.offload_optimizer.value_or(false);
      leaves.push_back(leaf);
    }
    // One thread per precision (their plans share nothing; the stages of one precision share
    // a cache), merged in a fixed order, so the result does not depend on timing.
    auto group = [&leaves,
                  &r](const std::string& precision) -> Result<std::optional<SearchResult>> {
      std::optional<SearchResult> out;
      PlanCache cache;
      // The plan without offload of the previous leaf (the same stage), to skip offload where it
      // cannot win: with offload every plan is slower than the same plan without it
      // (offload_never_faster), so it wins only through a plan that does not fit without it.
      bool skip_offload = false;
      for (const SearchRequest& leaf : leaves) {
        if (leaf.precision != precision) continue;
        const bool offload = leaf.offload_optimizer.value_or(false);
        if (offload && !r.offload_optimizer && skip_offload) continue;
        HR_ASSIGN_OR_RETURN(SearchResult one, search_leaf(leaf, cache));
        skip_offload = !offload && one.chosen && offload_never_faster(leaf.device) &&
                       one.fastest_rejected_tokens_per_s <= one.chosen->cost.tokens_per_s;
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
  if (r.precision != "fp32" && r.precision != "bf16" && r.precision != "fp16") {
    return Status::invalid_argument(
        fmt::format("--precision {}: expected auto, fp32, bf16 or fp16", r.precision));
  }
  if (!r.corrections.empty()) {  // this precision's own correction prices its candidates
    SearchRequest own = r;
    own.corrections.clear();
    if (auto it = r.corrections.find(r.precision); it != r.corrections.end()) {
      own.device.correction = it->second;
    }
    return search_leaf(own, cache);
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
  HR_RETURN_IF_ERROR(r.config.check_seq(r.seq));
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
  // Distillation fuses its loss into the chunked head: full logits are no candidate.
  if ((!r.fused_head || !*r.fused_head) && !r.distill) heads.push_back(0);
  if (!r.fused_head || *r.fused_head || r.distill) heads.push_back(r.head_chunk);
  std::vector<model::Recompute> modes = {model::Recompute::kNone, model::Recompute::kSelective,
                                         model::Recompute::kFull};
  if (r.recompute) modes = {*r.recompute};
  // Activation offload: searched (auto) where there is an offload tier and a bandwidth to price
  // the transfers with; forced on every block that keeps something (on); never (off).
  const double offload_bw = offload_link_bandwidth(r.device);
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
  if (r.precision == "bf16" && r.bf16_weight_copy) copies = {*r.bf16_weight_copy};
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
  // (Pointers into the plan maps below, which keep every plan for the whole search.)
  std::map<std::pair<int, std::string>, const MemoryPlan*> placed;
  auto policy = [&](int b, int k, const model::ExecOptions& e) {
    Policy p = policy_for(r, b, k);
    p.exec = e;
    p.exec.distill = r.distill;
    return p;
  };
  // Every plan of this search: a full replica from plan_training_memory, then (devices > 1)
  // this rank's share of the model state at the requested stage.
  // The plans are kept (std::map: stable addresses) and handed out by pointer: the search asks
  // for the same few dozen many times, and a copy of a large model's plan costs more than the
  // pricing.
  const int stage = r.zero_stage.value_or(0);
  // Optimizer offload moves only model state: the replicas in `cache` (planned without it) are
  // shared by the offload-off and offload-on searches, which derive their own copies.
  const bool offload = r.offload_optimizer.value_or(false);
  // This stage's share of the replicas in `cache`, with or without offload: derived plans without
  // the op list, the activation table and the step offsets (the search reads byte counts, the
  // step buffers and the parameter table; copying a large model's whole plan for each of them
  // cost more than the search). `replica_of` maps each back to its replica, which serves as the
  // step layout to reuse and completes the chosen plan (complete()).
  std::map<std::string, MemoryPlan> sharded;
  std::map<const MemoryPlan*, const MemoryPlan*> replica_of;
  const auto light_copy = [](const MemoryPlan& full) {
    MemoryPlan mp;
    mp.policy = full.policy;
    mp.params = full.params;
    mp.persistent = full.persistent;
    mp.step.name = full.step.name;
    mp.step.category = full.step.category;
    mp.step.buffers = full.step.buffers;
    mp.step.layout.size = full.step.layout.size;
    mp.persistent_bytes = full.persistent_bytes;
    mp.step_bytes = full.step_bytes;
    mp.step_lower_bound = full.step_lower_bound;
    mp.peak_bytes = full.peak_bytes;
    mp.lower_bound_bytes = full.lower_bound_bytes;
    mp.peak_op = full.peak_op;
    mp.by_category = full.by_category;
    mp.step_strategy = full.step_strategy;
    mp.placed = full.placed;
    mp.offload = full.offload;
    mp.offload_bytes = full.offload_bytes;
    // The offloaded blocks and their bytes: the cost model prices their transfers.
    mp.activations.offloaded = full.activations.offloaded;
    return mp;
  };
  const auto full_of = [&replica_of](const MemoryPlan* mp) {
    auto it = replica_of.find(mp);
    return it == replica_of.end() ? mp : it->second;
  };
  // The whole plan of `mp`: its replica's op list, activation table and step layout, with the
  // derived model state, bytes and policy.
  const auto complete = [&full_of](const MemoryPlan* mp) {
    const MemoryPlan* full = full_of(mp);
    if (full == mp) return *mp;
    MemoryPlan out = *mp;
    out.activations = full->activations;
    out.ops = full->ops;
    out.first_op = full->first_op;
    out.last_op = full->last_op;
    out.step = full->step;
    return out;
  };
  auto plan_mem = [&](int b, int k, const model::ExecOptions& e, const MemoryPlan* same,
                      bool do_place) -> Result<const MemoryPlan*> {
    const std::string key =
        fmt::format("{} {} {} {} {}", r.precision, b, k, do_place, describe_exec(e));
    if (r.devices > 1 || offload) {
      auto own = sharded.find(key);
      if (own != sharded.end()) return &own->second;
    }
    if (r.devices > 1 && r.executor_layout) {
      // The trainer's own plan of one rank (its regions are what the rank allocates).
      Policy zp = policy(b, k, e);
      zp.zero_stage = stage;
      // ZeRO-3 keeps no persistent bf16 copy of the whole model: weights are cast per layer.
      if (stage == 3) zp.exec.bf16_weight_copy = false;
      zp.offload_optimizer = offload;  // moved to the offload tier by plan_training_memory
      HR_ASSIGN_OR_RETURN(MemoryPlan mp, plan_training_memory(r.config, zp, same, do_place));
      return &sharded.emplace(key, std::move(mp)).first->second;
    }
    auto hit = cache.find(key);
    if (hit == cache.end()) {
      HR_ASSIGN_OR_RETURN(MemoryPlan fresh,
                          plan_training_memory(r.config, policy(b, k, e), same, do_place));
      hit = cache.emplace(key, std::move(fresh)).first;
    }
    if (r.devices <= 1 && !offload) return &hit->second;
    MemoryPlan mp = light_copy(hit->second);
    if (offload) offload_optimizer_state(&mp);
    if (r.devices > 1) {
      Policy zp = mp.policy;
      zp.zero_stage = stage;
      shard_plan(&mp, planned_zero_spec(mp.params, zp, r.zero_windows), !r.zero_windows);
    }
    const MemoryPlan* derived = &sharded.emplace(key, std::move(mp)).first->second;
    replica_of.emplace(derived, &hit->second);
    return derived;
  };
  auto place = [&](int b, int k, const model::ExecOptions& e) -> Result<const MemoryPlan*> {
    auto key = std::make_pair(b, describe_exec(e));
    auto it = placed.find(key);
    if (it == placed.end()) res.plans_placed++;
    HR_ASSIGN_OR_RETURN(const MemoryPlan* mp,
                        plan_mem(b, k, e, it == placed.end() ? nullptr : it->second, true));
    if (it == placed.end()) placed.emplace(key, full_of(mp));  // the step layout to reuse
    return mp;
  };
  struct Choice {
    std::optional<Candidate> best;     // fastest that fits
    const MemoryPlan* plan = nullptr;  // copied out only when chosen
    Candidate leanest;                 // when nothing fits
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
        res.fastest_rejected_tokens_per_s =
            std::max(res.fastest_rejected_tokens_per_s, rough.cost.tokens_per_s);
        rough.rejected_because = fmt::format(
            "needs at least {}, {} over the {} budget", format_bytes(rough.peak_bytes),
            format_bytes(rough.peak_bytes - r.device_memory), format_bytes(r.device_memory));
        continue;
      }
      HR_ASSIGN_OR_RETURN(const MemoryPlan* mp, place(b, k, e));
      Candidate c = evaluate(r, *mp);
      if (c.fits) {
        ch->best = c;
        ch->plan = mp;
        break;
      }
      res.fastest_rejected_tokens_per_s =
          std::max(res.fastest_rejected_tokens_per_s, c.cost.tokens_per_s);
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
        // The tier's optimizer state (with optimizer offload) is there whatever the mix; each
        // offloaded block adds its activations.
        const double tier_base = double(uni[0]->offload_bytes);
        const double tier_off =
            offload_auto ? (double(uni[3]->offload_bytes) - tier_base) / L : 0.0;
        const int max_off = offload_auto ? L : 0;
        // (extra seconds, full, offloaded, selective)
        std::vector<std::tuple<double, int, int, int>> mixes;
        for (int nf = 0; nf <= L; nf++) {
          for (int no = 0; nf + no <= std::min(L, nf + max_off); no++) {
            for (int ns = 0; nf + no + ns <= L; ns++) {
              if (nf == L || ns == L || no == L || (nf == 0 && ns == 0 && no == 0)) continue;
              if (m0 - nf * d_full - ns * d_sel - no * d_off > double(r.device_memory)) continue;
              if (r.offload_memory && tier_base + no * tier_off > double(r.offload_memory)) {
                continue;
              }
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
      // Past the device (the offload tier's refusal, from evaluate, stands otherwise).
      if (mp->peak_bytes > r.device_memory)
        ch.leanest.rejected_because = fmt::format(
            "needs at least {} even with {}, {} over the {} budget", format_bytes(mp->peak_bytes),
            describe_exec(lean), format_bytes(mp->peak_bytes - r.device_memory),
            format_bytes(r.device_memory));
    }
    return ch;
  };

  // Memory grows with the micro-batch for every technique (the lower bound strictly: every
  // buffer is as large or larger, with the same lifetimes): once no technique fits a
  // micro-batch even on the lower bound, none fits any larger one, and each of those gets its
  // leanest plan, as choose() would find after pricing everything. This saves most of the work
  // of searches that cannot succeed (ZeRO stages and offload choices too small for the model).
  const MemoryPlan* chosen_plan = nullptr;  // copied into res once the choice is made
  bool any_fits = true;
  // Candidates: every micro-batch that divides the per-device batch (or the one given).
  for (int b = 1; b <= per_device; b++) {
    if (per_device % b != 0 || (r.micro_batch && *r.micro_batch != b)) continue;
    if (any_fits) {
      any_fits = false;
      for (const model::ExecOptions& e : options) {
        HR_ASSIGN_OR_RETURN(const MemoryPlan* rough,
                            plan_mem(b, per_device / b, e, nullptr, false));
        if (evaluate(r, *rough).fits) {
          any_fits = true;
          break;
        }
      }
    }
    Choice ch;
    if (any_fits) {
      HR_ASSIGN_OR_RETURN(ch, choose(b, per_device / b));
    } else {
      // Not priced: as fast as anything, for all the search knows.
      res.fastest_rejected_tokens_per_s = std::numeric_limits<double>::infinity();
      HR_ASSIGN_OR_RETURN(const MemoryPlan* mp, plan_mem(b, per_device / b, lean, nullptr, false));
      ch.leanest = evaluate(r, *mp);
      ch.leanest.placed = false;
      if (mp->peak_bytes > r.device_memory) {
        ch.leanest.rejected_because = fmt::format(
            "needs at least {} even with {}, {} over the {} budget", format_bytes(mp->peak_bytes),
            describe_exec(lean), format_bytes(mp->peak_bytes - r.device_memory),
            format_bytes(r.device_memory));
      }
    }
    if (ch.best) {
      res.candidates.push_back(*ch.best);
      if (!res.chosen || ch.best->cost.tokens_per_s > res.chosen->cost.tokens_per_s) {
        res.chosen = ch.best;
        chosen_plan = ch.plan;
      }
    } else {
      res.rejected.push_back(ch.leanest);
    }
  }
  if (chosen_plan) res.chosen_plan = complete(chosen_plan);
  std::stable_sort(res.candidates.begin(), res.candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     return a.cost.tokens_per_s > b.cost.tokens_per_s;
                   });

  // The largest micro-batch that fits with the leanest technique allowed, whatever the global
  // batch: the plan grows with b, so a doubling then a bisection finds it with few plans.
  auto fits = [&](int b) -> Result<bool> {
    HR_ASSIGN_OR_RETURN(const MemoryPlan* rough, plan_mem(b, 1, lean, nullptr, false));
    if (rough->peak_bytes > r.device_memory) return false;
    if (r.offload_memory && rough->offload_bytes > r.offload_memory) return false;
    HR_ASSIGN_OR_RETURN(const MemoryPlan* mp, place(b, 1, lean));
    return mp->peak_bytes <= r.device_memory;
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
    HR_ASSIGN_OR_RETURN(const MemoryPlan* lean_plan, place(1, per_device, lean));
    const MemoryPlan& mp = *lean_plan;
    if (mp.peak_bytes > r.device_memory) {
      res.advice = advise(r, mp);
    } else if (r.offload_memory && mp.offload_bytes > r.offload_memory) {
      res.advice = fmt::format(
          "nothing fits: with offload the device holds micro-batch 1 ({} of {}), but the offload "
          "tier needs {} ({}), {} more than its {} budget: raise --offload-memory, or shard the "
          "optimizer state over more devices (ZeRO-1 or higher)\n",
          format_bytes(mp.peak_bytes), format_bytes(r.device_memory),
          format_bytes(mp.offload_bytes), offload_parts(mp),
          format_bytes(mp.offload_bytes - r.offload_memory), format_bytes(r.offload_memory));
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
