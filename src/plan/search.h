// The search: for a model, a device and an effective batch, the configuration that fits and is
// predicted fastest, with the runners-up and why the rest were rejected. Written to grow: each
// technique (precision, recomputation, offload, sharding) becomes another dimension of the
// candidate list.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "plan/cost_model.h"
#include "plan/device_spec.h"
#include "plan/memory_plan.h"
#include "plan/zero.h"

namespace headroom::plan {

struct SearchRequest {
  model::Gpt2Config config;
  DeviceSpec device;  // speed; memory comes from device_memory
  // The backend that will run the plan, for its scratch sizes and row strides (Policy::ops);
  // null: the CPU's. Not owned.
  const backend::Ops* ops = nullptr;
  uint64_t device_memory = 0;      // budget per device, bytes
  int devices = 1;                 // data-parallel ranks
  int seq = 0;                     // T
  int global_batch = 0;            // sequences per optimizer step, all ranks together
  std::optional<int> micro_batch;  // a --batch given explicitly is a constraint
  // "fp32", "bf16", or "auto": both searched, the faster choice wins (bf16 only where the
  // device has bf16 GEMMs: DeviceSpec::flops_bf16 > 0).
  std::string precision = "fp32";
  // --recompute given: the same choice for every block; unset: the planner chooses, including a
  // per-block mix (an optimal schedule for the chain under the budget).
  std::optional<model::Recompute> recompute;
  // Activation offload (docs/notes/offload-activations.md): unset lets the planner offload the
  // kept activations of chosen blocks (a per-block choice next to recomputation, by the
  // schedule search); true offloads every block that is not fully recomputed; false never. The
  // offload tier holds offload_memory bytes (0: activations are not offloaded unless forced);
  // transfers are priced at offload_link_bandwidth(device).
  std::optional<bool> offload_activations;
  std::optional<bool> fused_head;  // unset: the planner chooses
  // bf16: keep the persistent bf16 weight copy (true) or cast each layer per use (false), a
  // constraint; unset: both priced. An elastic re-plan keeps the run's: the copy is a persistent
  // region, allocated once for the run.
  std::optional<bool> bf16_weight_copy;
  int head_chunk = 256;  // tokens per chunk of the fused LM head
  bool sweep = false;    // also fill SearchResult::sweep
  // Distillation (docs/notes/distillation.md): every candidate trains against this teacher,
  // whose weights and forward-only working set are in each plan; it needs the fused head.
  std::optional<model::Distill> distill;
  // ZeRO stage 0-3 (--zero N): a constraint; unset: every stage is searched when devices > 1
  // (one device: stage 0). Per-rank memory comes from zero_memory, communication from
  // zero_traffic at device.interconnect_bandwidth (docs/notes/cost-model.md).
  std::optional<int> zero_stage;
  // Stages 2-3 as ZeRO designs them: backward writes gradients into windows (the embedding
  // unit, whose tied gradient is final last, plus two of the largest block units) that are
  // reduce-scattered every micro-batch, and stage 3 gathers parameters into two unit slots
  // (current + prefetch). false: the buffers the CPU executor allocates today (a full gradient
  // buffer and, with bf16, whole fp32 master weights; stage 3 a full parameter buffer), so that
  // stage 2 saves nothing over stage 1 and stages 0-2 match plan_training_memory's regions.
  bool zero_windows = true;
  // true: plan each rank exactly as the CPU trainer allocates it (plan_training_memory with
  // policy.ranks = devices and the stage: stages 2-3 with the executor's gradient and parameter
  // windows, stage 3 with bf16 casting weights per layer), so that a candidate's peak is the
  // trainer's planned (and measured) peak. Overrides zero_windows for the memory; the traffic is
  // priced with windows.
  bool executor_layout = false;
  // The highest stage `auto` searches (an explicit zero_stage is not limited).
  int max_zero_stage = 3;
  // Optimizer offload (Policy::offload_optimizer; docs/notes/offload.md): a constraint when set;
  // unset, every plan is tried with and without it, and offload wins only where it fits and the
  // plan without does not, or where it is predicted faster (ties go to no offload).
  std::optional<bool> offload_optimizer;
  // The offload tier's budget per device (bytes); 0: not limited. A plan whose offload bytes
  // exceed it does not fit.
  uint64_t offload_memory = 0;
  // Note [Self-correction]: the corrections this machine measured on earlier runs of this model,
  // by precision ("fp32", "bf16", "fp16"): each precision's candidates are priced with its own
  // (in place of device.correction), so that the choice between precisions, and every choice
  // within one, is made by the corrected model. A precision without one keeps device.correction.
  std::map<std::string, CostCorrection> corrections;
};

// "tiled attention, fused LM head (chunk 256), recompute: 4 full, 8 none".
std::string describe_exec(const model::ExecOptions& exec);
// "none", "selective", "full" or "mixed".
std::string recompute_summary(const model::ExecOptions& exec);
// Per block: "none", "selective", "full", "offload" or "selective+offload".
std::vector<std::string> schedule_per_block(const model::ExecOptions& exec, int n_layer);
// The number of offloaded blocks.
int offloaded_blocks(const model::ExecOptions& exec);

struct Candidate {
  Policy policy;  // policy.ranks and policy.zero_stage: the sharding
  // Per rank with devices > 1: peak_bytes, lower_bound_bytes and by_category count this rank's
  // shards (zero_memory) instead of a full replica; cost.comm_* its traffic.
  uint64_t peak_bytes = 0;
  uint64_t lower_bound_bytes = 0;
  std::array<uint64_t, memory::kNumCategories> by_category{};
  // The offload tier's bytes (per rank; MemoryPlan::offload_bytes): optimizer state and
  // offloaded activations together; 0 without offload. offload_activation_bytes: the
  // activations' part (the rest is the optimizer state's).
  uint64_t offload_bytes = 0;
  uint64_t offload_activation_bytes = 0;
  StepCost cost;
  bool fits = false;
  bool placed = true;            // false: rejected on the lower bound, never placed
  std::string rejected_because;  // empty when it fits
};

struct SearchResult {
  std::optional<Candidate> chosen;
  // The chosen plan. With devices > 1 its regions describe one full replica (the CPU executor's
  // layout before sharding); its byte counts (persistent_bytes, peak_bytes, by_category) are the
  // per-rank ones of `chosen`.
  std::optional<MemoryPlan> chosen_plan;
  // For each micro-batch that divides the per-device batch: its fastest fitting technique
  // (candidates, fastest first) or, when none fits, its leanest one (rejected).
  std::vector<Candidate> candidates;
  std::vector<Candidate> rejected;
  int plans_placed = 0;  // offset plans computed (the rest were rejected on the lower bound)
  // The fastest plan priced that did not fit (infinity when some were never priced): the search
  // skips optimizer offload where the plan without it is already the fastest of all.
  double fastest_rejected_tokens_per_s = 0;
  std::vector<Candidate> sweep;  // micro-batch 1, 2, 4, ... past the largest that fits
  int max_micro_batch = 0;       // largest micro-batch whose plan fits (0: none)
  std::string advice;            // when nothing fits: what is missing and what would help
  double planning_ms = 0;
};

// The ZeRO spec of `policy` (its ranks and zero_stage) for `params`: bytes per element from the
// precision (the engine keeps fp32 gradients), stage 3's multi-unit shard (one unit per block's
// decayed and other tensors, as train/zero.h's gpt2_zero_units), and with `windows` the
// gradient and gather windows described at SearchRequest::zero_windows.
ZeroSpec planned_zero_spec(const model::ParamTable& params, const Policy& policy, bool windows);

// Errors: InvalidArgument for an impossible request (global batch not divisible by the devices,
// a micro-batch that does not divide the per-device batch, a sequence above n_positions, a ZeRO
// stage outside 0-3 or above 0 on one device, several devices without an interconnect figure).
// A request where nothing fits is not an error: chosen is empty and advice says why.
Result<SearchResult> search_plan(const SearchRequest& request);

}  // namespace headroom::plan
