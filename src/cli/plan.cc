// `headroom plan`: plans a training configuration's memory and prints the choice, the runners-up
// and the rejected (or one JSON object).
#include "cli/common.h"

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

#include "core/units.h"
#include "core/utf8.h"

namespace headroom::cli {

int run_plan(PlanFlags& pf) {
  TrainFlags& f = pf.t;
  set_threads(f.threads);
  Result<model::Gpt2Config> cfg = model::resolve_model(f.model);
  if (!cfg.is_ok()) return fail(cfg.status());
  Result<plan::DeviceSpec> dev = resolve_device(f.device, f.device_memory, f.json);
  if (!dev.is_ok()) return fail(dev.status());
  if (Status st = check_precision(f.precision, *dev); !st.is_ok()) return fail(st);
  plan::SearchRequest req;
  req.precision = f.precision;
  req.config = *cfg;
  req.device = *dev;
  req.device_memory = dev->memory_bytes;
  req.devices = pf.devices;
  req.seq = f.seq > 0 ? f.seq : std::min(128, cfg->n_positions);
  req.global_batch = f.global_batch > 0 ? f.global_batch : (f.batch > 0 ? f.batch * pf.devices : 8);
  if (f.batch > 0) req.micro_batch = f.batch;
  req.sweep = pf.sweep;
  Result<std::optional<model::Recompute>> rc = parse_recompute(f.recompute);
  if (!rc.is_ok()) return fail(rc.status());
  req.recompute = *rc;
  Result<std::optional<bool>> off = parse_offload(f.offload_optimizer, "--offload-optimizer");
  if (!off.is_ok()) return fail(off.status());
  req.offload_optimizer = *off;
  Result<uint64_t> off_budget = offload_budget(f.offload_memory, dev->kind == "cpu");
  if (!off_budget.is_ok()) return fail(off_budget.status());
  req.offload_memory = *off_budget;
  Result<std::optional<bool>> off_act =
      parse_offload(f.offload_activations, "--offload-activations");
  if (!off_act.is_ok()) return fail(off_act.status());
  req.offload_activations = *off_act;
  if (pf.zero != "auto") {
    if (pf.zero.size() != 1 || pf.zero[0] < '0' || pf.zero[0] > '3') {
      return fail(
          Status::invalid_argument(fmt::format("--zero {}: use auto, 0, 1, 2 or 3", pf.zero)));
    }
    req.zero_stage = pf.zero[0] - '0';
  }
  // Distillation: the teacher's weights and forward-only working set in every candidate's plan
  // (the startup table's "teacher" line).
  Result<std::optional<model::Distill>> distill = train::resolve_distill(
      f.teacher, f.distill_alpha, f.distill_temperature, f.teacher_dtype, *cfg, f.model);
  if (!distill.is_ok()) return fail(distill.status());
  req.distill = *distill;
  if (dev->kind == "cpu") {
    // Plan what `headroom train` runs here under mpirun: each rank exactly as the trainer
    // allocates it (docs/notes/zero.md). Named GPUs are planned as ZeRO designs them.
    req.executor_layout = true;
    req.max_zero_stage = 3;
  }
  // Note [Self-correction]: what `headroom train` would choose here, by the same corrected model.
  train::StoredCorrections stored;
  if (dev->kind == "cpu" && dev->terms.fitted && f.self_correct) {
    stored = train::stored_corrections(*cfg);
    req.corrections = stored.by_precision;
  }
  Result<plan::SearchResult> r = plan::search_plan(req);
  if (!r.is_ok()) return fail(r.status());
  const int64_t nparams = model::gpt2_param_table(*cfg).num_parameters;

  if (f.json) {
    json j;
    j["model"] = {
        {"name", f.model},       {"n_layer", cfg->n_layer},       {"n_head", cfg->n_head},
        {"n_embd", cfg->n_embd}, {"vocab_size", cfg->vocab_size}, {"n_positions", cfg->n_positions},
        {"parameters", nparams}};
    // NCCL's buffers, which the search adds for several ranks on GPUs (plan/fixed_bytes.h).
    const plan::BackendFixedBytes collective = req.devices > 1 && dev->kind == "gpu"
                                                   ? plan::with_collective_buffers({})
                                                   : plan::BackendFixedBytes{};
    j["device"] = {
        {"name", dev->name},
        {"memory_bytes", dev->memory_bytes},
        {"flops_fp32", dev->flops_fp32},
        {"mem_bandwidth", dev->mem_bandwidth},
        {"interconnect_bandwidth", dev->interconnect_bandwidth},
        {"host_link_bandwidth", dev->host_link_bandwidth},
        {"offload_link_bandwidth", plan::offload_link_bandwidth(*dev)},
        {"host_memory_bandwidth",
         dev->host_memory_bandwidth > 0 ? dev->host_memory_bandwidth : dev->mem_bandwidth},
        {"source", dev->source},
        // The backend's bytes outside the arenas, counted in every candidate's peak.
        {"backend_fixed_bytes",
         {{"context", dev->backend_fixed.context},
          {"context_source", dev->backend_fixed.context_source},
          {"cublaslt_workspace", dev->backend_fixed.cublaslt_workspace},
          {"op_workspace", dev->backend_fixed.op_workspace},
          {"collective", collective.collective},
          {"collective_source", collective.collective_source}}}};
    j["cost_corrections"] = json::object();  // by precision: the scales that priced them
    for (const auto& [precision, c] : stored.by_precision) {
      json scale = json::object();
      for (size_t k = 0; k < plan::kCostKinds; k++)
        scale[std::string(plan::cost_kind_name(plan::CostKind(k)))] = c.scale[k];
      j["cost_corrections"][precision] = {{"scale", scale},
                                          {"other_seconds_per_token", c.other_seconds_per_token},
                                          {"steps", c.steps}};
    }
    j["offload_memory"] = req.offload_memory;
    j["devices"] = pf.devices;
    j["seq"] = req.seq;
    j["global_batch"] = req.global_batch;
    j["chosen"] = r->chosen ? candidate_json(*r->chosen) : json(nullptr);
    j["candidates"] = json::array();
    for (const auto& c : r->candidates) j["candidates"].push_back(candidate_json(c));
    j["rejected"] = json::array();
    for (const auto& c : r->rejected) j["rejected"].push_back(candidate_json(c));
    j["max_micro_batch"] = r->max_micro_batch;
    if (pf.sweep) {
      j["sweep"] = json::array();
      for (const auto& c : r->sweep) j["sweep"].push_back(candidate_json(c));
    }
    if (!r->advice.empty()) j["advice"] = r->advice;
    j["planning_ms"] = r->planning_ms;
    std::printf("%s\n", dump_json(j, 2).c_str());
    return r->chosen ? 0 : 3;
  }

  std::printf(
      "headroom plan: %s (%.1fM parameters), seq %d, global batch %d, %d x %s "
      "(%s each; %s)\n",
      f.model.c_str(), double(nparams) / 1e6, req.seq, req.global_batch, pf.devices,
      dev->name.c_str(), format_bytes(dev->memory_bytes).c_str(), dev->source.c_str());
  if (!stored.note.empty()) std::printf("%s\n", stored.note.c_str());
  const bool multi = pf.devices > 1;
  // " ZeRO-2," for several devices: the stage of a candidate in the lists below.
  auto stage_of = [&](const plan::Candidate& o) {
    return multi ? fmt::format(" ZeRO-{},", o.policy.zero_stage) : std::string();
  };
  if (r->chosen) {
    const plan::Candidate& c = *r->chosen;
    const int n_off = plan::offloaded_blocks(c.policy.exec);
    std::printf("\nchosen: micro-batch %d x %d accumulation steps%s, %s, %s, %s%s\n",
                c.policy.micro_batch, c.policy.accumulation, multi ? " per device" : "",
                c.policy.precision.c_str(), plan::describe_exec(c.policy.exec).c_str(),
                multi ? fmt::format("ZeRO stage {}, ", c.policy.zero_stage).c_str() : "",
                c.policy.offload_optimizer && n_off > 0 ? "optimizer and activation offload"
                : c.policy.offload_optimizer            ? "optimizer offload"
                : n_off > 0                             ? "activation offload"
                                                        : "no offload");
    const std::vector<std::string> per_block = plan::schedule_per_block(
        c.policy.exec, int(std::max(c.policy.exec.recompute.size(), c.policy.exec.offload.size())));
    if (!per_block.empty()) {
      // Runs of equal choices: "0-3: full, 4-9: offload, 10-11: none".
      std::string line;
      for (size_t l = 0; l < per_block.size();) {
        size_t end = l;
        while (end + 1 < per_block.size() && per_block[end + 1] == per_block[l]) end++;
        line +=
            fmt::format("{}{}: {}", l ? ", " : "",
                        end > l ? fmt::format("{}-{}", l, end) : std::to_string(l), per_block[l]);
        l = end + 1;
      }
      std::printf("  per block: %s\n", line.c_str());
    }
    if (n_off > 0) {
      const double bw = plan::offload_link_bandwidth(*dev);
      std::printf(
          "  activation offload: %d blocks, %s in the offload tier (budget %s%s); %s moved per "
          "step at %.1f GB/s, %.0f ms of it not hidden behind compute\n",
          n_off, format_bytes(c.offload_activation_bytes).c_str(),
          format_bytes(req.offload_memory).c_str(),
          c.policy.offload_optimizer ? fmt::format(", shared with the optimizer state: {} in all",
                                                   format_bytes(c.offload_bytes))
                                           .c_str()
                                     : "",
          format_bytes(uint64_t(c.cost.activation_offload_bytes)).c_str(), bw / 1e9,
          c.cost.activation_offload_seconds * 1e3);
    }
    std::printf(
        "  peak %s per device (lower bound %s), predicted %.0f tokens/s%s (%.0f ms a step)\n",
        format_bytes(c.peak_bytes).c_str(), format_bytes(c.lower_bound_bytes).c_str(),
        c.cost.tokens_per_s, multi ? " over all devices" : "", c.cost.step_seconds * 1e3);
    if (multi) {
      std::printf(
          "  step time: %.0f ms compute (GEMMs %.0f, memory-bound %.0f) + %.0f ms communication\n"
          "  communication: %s sent per device per step (ring collectives of ZeRO-%d), %.0f ms at "
          "%.1f GB/s (%s; not overlapped with compute)\n",
          (c.cost.gemm_seconds + c.cost.memory_seconds) * 1e3, c.cost.gemm_seconds * 1e3,
          c.cost.memory_seconds * 1e3, c.cost.comm_seconds * 1e3,
          format_bytes(uint64_t(c.cost.comm_bytes)).c_str(), c.policy.zero_stage,
          c.cost.comm_seconds * 1e3, dev->interconnect_bandwidth / 1e9,
          dev->kind == "cpu" ? "shared-memory MPI, measured" : "interconnect, datasheet x 0.8");
    }
    if (c.policy.offload_optimizer) {
      const double host_bw =
          dev->host_memory_bandwidth > 0 ? dev->host_memory_bandwidth : dev->mem_bandwidth;
      std::printf(
          "  optimizer offload: %s%s in the offload tier (fp32 master weights, AdamW m and v, "
          "the gradient copy%s)%s\n"
          "    per step %s over the host link (gradients out, weights back): %.0f ms at %.1f "
          "GB/s (%s), and AdamW on the host: %.0f ms at %.1f GB/s (%s); %s\n",
          format_bytes(c.offload_bytes - c.offload_activation_bytes).c_str(),
          multi ? " per device" : "", multi && c.policy.zero_stage > 0 ? ", this rank's shard" : "",
          req.offload_memory ? fmt::format(", budget {}", format_bytes(req.offload_memory)).c_str()
                             : ", budget not limited",
          format_bytes(uint64_t(c.cost.offload_bytes - c.cost.activation_offload_bytes)).c_str(),
          (c.cost.offload_seconds - c.cost.activation_offload_seconds) * 1e3,
          plan::offload_link_bandwidth(*dev) / 1e9,
          dev->kind == "cpu" ? "memcpy, measured" : "host link, datasheet x 0.8",
          c.cost.host_optimizer_seconds * 1e3, host_bw / 1e9,
          dev->kind == "cpu" ? "triad, measured" : "assumed host share",
          c.cost.optimizer_overlap_seconds > 0
              ? fmt::format("pipelined with AdamW ({:.0f} ms hidden)",
                            c.cost.optimizer_overlap_seconds * 1e3)
                    .c_str()
              : "not overlapped");
    }
    std::printf("\nmemory%s at the peak (%s):\n%s", multi ? " per device" : "",
                r->chosen_plan->ops[size_t(r->chosen_plan->peak_op)].name.c_str(),
                plan::category_table(*r->chosen_plan, dev->memory_bytes).c_str());
    if (c.offload_bytes > 0 && !multi) {
      std::printf("\noffload tier:\n%s",
                  plan::offload_table(*r->chosen_plan, req.offload_memory).c_str());
    }
    if (r->candidates.size() > 1) {
      std::printf("\nrunners-up:\n");
      for (size_t i = 1; i < r->candidates.size() && i < 6; i++) {
        const plan::Candidate& o = r->candidates[i];
        std::printf("  micro-batch %3d x %3d:%s %s%s, peak %10s, predicted %6.0f tokens/s (%s)\n",
                    o.policy.micro_batch, o.policy.accumulation, stage_of(o).c_str(),
                    o.policy.precision.c_str(),
                    o.policy.offload_optimizer ? ", optimizer offload" : "",
                    format_bytes(o.peak_bytes).c_str(), o.cost.tokens_per_s,
                    plan::describe_exec(o.policy.exec).c_str());
      }
    }
  }
  if (!r->rejected.empty()) {
    // The leanest first; with several precisions and stages, the ten leanest.
    std::vector<plan::Candidate> rejected = r->rejected;
    std::stable_sort(rejected.begin(), rejected.end(),
                     [](const plan::Candidate& a, const plan::Candidate& b) {
                       return a.peak_bytes < b.peak_bytes;
                     });
    std::printf("\nrejected:\n");
    for (size_t i = 0; i < rejected.size() && i < 10; i++) {
      const plan::Candidate& o = rejected[i];
      std::printf("  micro-batch %3d x %3d:%s %s%s: %s\n", o.policy.micro_batch,
                  o.policy.accumulation, stage_of(o).c_str(), o.policy.precision.c_str(),
                  o.policy.offload_optimizer ? ", optimizer offload" : "",
                  o.rejected_because.c_str());
    }
    if (rejected.size() > 10) {
      std::printf("  ... and %zu more (--json lists them all)\n", rejected.size() - 10);
    }
  }
  if (pf.sweep) {
    std::printf(
        "\nmemory versus micro-batch (seq %d; the fastest technique that fits, else the "
        "leanest):\n  %11s %12s %9s %14s %5s  %s\n",
        req.seq, "micro-batch", "planned peak", "of device", "tokens/s (est)", "fits",
        "techniques");
    for (const auto& o : r->sweep) {
      std::printf("  %11d %11s%s %8.1f%% %14.0f %5s  %s\n", o.policy.micro_batch,
                  format_bytes(o.peak_bytes).c_str(), o.placed ? " " : "+",
                  100.0 * double(o.peak_bytes) / double(dev->memory_bytes), o.cost.tokens_per_s,
                  o.fits ? "yes" : "no", plan::describe_exec(o.policy.exec).c_str());
    }
    std::printf("  (+: at least this much: rejected on the lower bound, never placed)\n");
  }
  std::printf("\nlargest micro-batch that fits: %d\n", r->max_micro_batch);
  if (!r->advice.empty()) std::printf("\n%s", r->advice.c_str());
  std::printf("planned in %.1f ms (%d offset plans placed)\n", r->planning_ms, r->plans_placed);
  return r->chosen ? 0 : 3;
}

}  // namespace headroom::cli
