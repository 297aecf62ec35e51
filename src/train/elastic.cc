// Elastic micro-batching: the pool-served step region and re-planning (see elastic.h).
#include "train/elastic.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/units.h"
#include "plan/cost_model.h"

namespace headroom::train {

namespace {
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

uint64_t round64(uint64_t x) { return (x + 63) / 64 * 64; }

std::string head_name(const model::ExecOptions& e) {
  return e.head_chunk > 0 ? "fused LM head" : "full logits";
}
}  // namespace

Result<uint64_t> read_budget_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return Status::io_error(
        fmt::format("--device-memory-file {}: cannot read it: {}", path, std::strerror(errno)));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  const char* ws = " \t\r\n";
  const size_t b = text.find_first_not_of(ws);
  text = b == std::string::npos ? "" : text.substr(b, text.find_last_not_of(ws) - b + 1);
  if (text.empty()) {
    return Status::invalid_argument(fmt::format(
        "--device-memory-file {}: the file is empty; write one size such as 2GiB", path));
  }
  Result<uint64_t> v = parse_bytes(text);
  if (!v.is_ok()) {
    return Status::invalid_argument(
        fmt::format("--device-memory-file {}: '{}' is not a size such as 2GiB or 512MiB ({})", path,
                    text.size() > 40 ? text.substr(0, 40) + "..." : text, v.status().message()));
  }
  if (*v == 0) {
    return Status::invalid_argument(
        fmt::format("--device-memory-file {}: the budget '{}' must be positive", path, text));
  }
  return *v;
}

std::string budget_file_for_rank(const std::string& path, int rank) {
  static constexpr std::string_view kPlaceholder = "{rank}";
  std::string out;
  size_t from = 0;
  for (size_t at; (at = path.find(kPlaceholder, from)) != std::string::npos;
       from = at + kPlaceholder.size()) {
    out += path.substr(from, at - from) + std::to_string(rank);
  }
  return out + path.substr(from);
}

plan::DeviceSpec nominal_cpu_spec() {
  plan::DeviceSpec d;
  d.name = "cpu";
  d.kind = "cpu";
  d.flops_fp32 = 50e9;
  d.mem_bandwidth = 10e9;
  d.host_link_bandwidth = 5e9;
  d.host_memory_bandwidth = 10e9;
  d.gemm_efficiency = 1;
  d.source = "nominal (no calibration given)";
  return d;
}

ElasticStep::ElasticStep(Setup setup, memory::MemoryResource* upstream, plan::MemoryPlan initial)
    : setup_(std::move(setup)),
      // No size classes: the step region is one large block, held at exactly its planned size.
      pool_(upstream, memory::PoolOptions{0, 0}),
      failing_(&pool_),
      plan_(std::move(initial)) {
  if (setup_.device.flops_fp32 <= 0 || setup_.device.mem_bandwidth <= 0) {
    setup_.device = nominal_cpu_spec();
  }
  failing_.fail_at(setup_.fail_acquisitions);
  persistent_bytes_ = plan_.persistent_bytes;
  for (const plan::Region& r : plan_.persistent) {
    for (const memory::BufferDesc& b : r.buffers) {
      persistent_buffers_.push_back({b.name, r.name + " region", b.category, b.bytes()});
    }
  }
  std::stable_sort(persistent_buffers_.begin(), persistent_buffers_.end(),
                   [](const LiveBuffer& a, const LiveBuffer& b) { return a.bytes > b.bytes; });
  predicted_ms_ = plan::estimate_step(setup_.config, plan_, setup_.device).step_seconds * 1e3;
}

void ElasticStep::set_device(const plan::DeviceSpec& device) {
  setup_.device = device;
  predicted_ms_ = plan::estimate_step(setup_.config, plan_, setup_.device).step_seconds * 1e3;
}

Result<memory::Arena> ElasticStep::acquire() {
  return memory::Arena::create(&failing_, plan_.step.buffers, plan_.step.layout,
                               memory::Category::kActivations);
}

Result<memory::Arena> ElasticStep::acquire_uninjected() {
  return memory::Arena::create(&pool_, plan_.step.buffers, plan_.step.layout,
                               memory::Category::kActivations);
}

Result<memory::Arena> ElasticStep::acquire_shape(const plan::MemoryPlan& shape, bool inject) {
  memory::MemoryResource* from = inject ? static_cast<memory::MemoryResource*>(&failing_) : &pool_;
  return memory::Arena::create(from, shape.step.buffers, shape.step.layout,
                               memory::Category::kActivations);
}

std::string ElasticStep::describe_policy(const plan::Policy& p) const {
  return fmt::format("micro-batch {} x {} (recompute {}, {})", p.micro_batch, p.accumulation,
                     plan::recompute_summary(p.exec), head_name(p.exec));
}

Result<ElasticStep::Replan> ElasticStep::replan(uint64_t ceiling, int remaining) {
  const int G = setup_.global_batch;
  // The planner's plans hold a validation micro-batch of b sequences in their staging region;
  // this run's staging (allocated once) holds max_micro_batch. The difference to the leanest
  // staging comes off the budget the search sees, so whatever it calls fitting fits here.
  // The search plans one device (ranks 1, no ZeRO sharding): with several ranks its persistent
  // regions are those of a whole replica, so what it sees is that replica's leanest persistent
  // bytes plus the room this rank has for the step region. (One process: the run's own.)
  plan::Policy lean_policy = plan_.policy;
  lean_policy.micro_batch = 1;
  lean_policy.accumulation = G;
  lean_policy.ranks = 1;
  lean_policy.zero_stage = 0;
  HR_ASSIGN_OR_RETURN(plan::MemoryPlan lean,
                      plan::plan_training_memory(setup_.config, lean_policy, nullptr, false));
  if (ceiling <= persistent_bytes_) {
    return Status::out_of_memory(fmt::format(
        "nothing fits: the {} budget does not even hold the weights, gradients, optimizer state "
        "and token staging ({}) that this run keeps for its whole length",
        format_bytes(ceiling), format_bytes(persistent_bytes_)));
  }
  plan::SearchRequest req;
  req.config = setup_.config;
  req.device = setup_.device;
  req.device_memory = lean.persistent_bytes + (ceiling - persistent_bytes_);
  req.seq = setup_.seq;
  req.global_batch = G;
  req.precision = plan_.policy.precision;
  // The offload tier's regions are allocated for the run: re-plans keep the run's choice.
  req.offload_optimizer = plan_.policy.offload_optimizer;
  req.head_chunk = setup_.head_chunk;
  req.distill = plan_.policy.exec.distill;  // the teacher stays
  // The bf16 weight copy is a persistent region (or its absence, per-use casts): it stays.
  req.bf16_weight_copy = plan_.policy.exec.bf16_weight_copy;
  req.ops = plan_.policy.ops;  // the backend's scratch sizes and strides
  HR_ASSIGN_OR_RETURN(plan::SearchResult res, plan::search_plan(req));

  Replan out;
  std::optional<plan::MemoryPlan> best;
  double best_ms = 0;
  const plan::Policy& cur = plan_.policy;
  for (const plan::Candidate& c : res.candidates) {  // fastest first
    const int b = c.policy.micro_batch;
    // This rank's plan of the candidate: the run's ranks and ZeRO stage (its step region).
    plan::Policy policy = c.policy;
    policy.ranks = cur.ranks;
    policy.zero_stage = cur.zero_stage;
    HR_ASSIGN_OR_RETURN(plan::MemoryPlan mp, plan::plan_training_memory(setup_.config, policy));
    const uint64_t peak = persistent_bytes_ + mp.step_bytes;
    const double ms = c.cost.step_seconds * 1e3;
    std::vector<std::string> parts;
    if (b != cur.micro_batch)
      parts.push_back(fmt::format("micro-batch {} -> {}", cur.micro_batch, b));
    if (plan::recompute_summary(c.policy.exec) != plan::recompute_summary(cur.exec)) {
      parts.push_back(fmt::format("recompute {} -> {}", plan::recompute_summary(cur.exec),
                                  plan::recompute_summary(c.policy.exec)));
    }
    if ((c.policy.exec.head_chunk > 0) != (cur.exec.head_chunk > 0)) {
      parts.push_back(head_name(c.policy.exec));
    }
    std::string what;
    for (const std::string& part : parts) what += (what.empty() ? "" : ", ") + part;
    if (what.empty()) what = "the same plan";
    // (Validation runs its batch of max_micro_batch sequences in pieces of any size.)
    const bool usable = remaining % b == 0;
    out.alternatives += fmt::format(
        "  - {} fits (micro-batch {} x {}): peak {}, predicted {:.0f} ms/step ({:+.0f}% time){}\n",
        what, b, c.policy.accumulation, format_bytes(peak), ms,
        predicted_ms_ > 0 ? 100.0 * (ms / predicted_ms_ - 1.0) : 0.0,
        usable ? ""
               : fmt::format("; not used: {} does not divide the {} sequences left in the step", b,
                             remaining));
    if (usable && !best && peak <= ceiling) {
      best = std::move(mp);
      best_ms = ms;
    }
  }
  if (!best) {
    std::string why = res.chosen ? fmt::format(
                                       "no micro-batch that divides the {} sequences left in the "
                                       "step fits under {}.\n",
                                       remaining, format_bytes(ceiling))
                                 : res.advice;
    return Status::out_of_memory(
        why + (out.alternatives.empty() ? std::string() : "plans that fit:\n" + out.alternatives));
  }
  out.changed = !(best->policy.micro_batch == cur.micro_batch && best->policy.exec == cur.exec);
  out.change =
      fmt::format("{} -> {}, planned peak {} -> {}, predicted {:.0f} -> {:.0f} ms/step",
                  describe_policy(cur), describe_policy(best->policy), format_bytes(planned_peak()),
                  format_bytes(persistent_bytes_ + best->step_bytes), predicted_ms_, best_ms);
  plan_ = std::move(*best);
  predicted_ms_ = best_ms;
  // Between micro-batches the pool holds only the free step region. Keep it when it is exactly
  // the new one; otherwise hand it back now, so that the budget counts only what the plan holds
  // (and the measured peak stays the planned one).
  const memory::PoolStats ps = pool_.stats();
  if (ps.reserved != round64(plan_.step.layout.size) || ps.in_use != 0) pool_.release_unused();
  return out;
}

std::string ElasticStep::oom_report(const Status& cause, const std::string& where, uint64_t budget,
                                    const memory::MemoryStats& live) const {
  std::string s = fmt::format("out of memory {}\n", where);
  s += fmt::format("  asked for {}: the step region of {}\n  cause: {}\n",
                   format_bytes(round64(plan_.step.layout.size)), describe_policy(plan_.policy),
                   first_line(cause.message()));
  s += fmt::format("  budget {}, {} in use; {}\n", format_bytes(budget), format_bytes(live.current),
                   pool_.stats().describe());
  s += "  live device memory by category:\n";
  std::string table = live.table();
  std::istringstream lines(table);
  for (std::string line; std::getline(lines, line);) s += "  " + line + "\n";
  s += "  largest live buffers:\n";
  const memory::PoolStats ps = pool_.stats();
  std::vector<LiveBuffer> bufs = persistent_buffers_;
  if (ps.reserved) {
    bufs.push_back({"step region", "the pool (reserved, free between micro-batches)",
                    memory::Category::kActivations, ps.reserved});
  }
  std::stable_sort(bufs.begin(), bufs.end(),
                   [](const LiveBuffer& a, const LiveBuffer& b) { return a.bytes > b.bytes; });
  for (size_t i = 0; i < bufs.size() && i < 6; i++) {
    s += fmt::format("    {:<16} {:<12} {:>12}  {}\n", bufs[i].name,
                     memory::category_name(bufs[i].category), format_bytes(bufs[i].bytes),
                     bufs[i].owner);
  }
  return s;
}

}  // namespace headroom::train
