// The memory plan of one training configuration: every buffer of a step (DESIGN.md principle 1)
// with its lifetime in the step's schedule and its offset, grouped in regions that the trainer
// turns into arenas one for one. Computed on metadata only: planning GPT-2 124M takes well under
// a millisecond, a 70B-class configuration a few milliseconds.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "memory/arena.h"
#include "model/gpt2.h"
#include "plan/fixed_bytes.h"

namespace headroom::plan {

// How a step is run. Grows with the techniques (precision, recompute, offload, sharding).
struct Policy {
  int micro_batch = 1;             // b: sequences per micro-batch
  int accumulation = 1;            // k: micro-batches per optimizer step
  int seq = 1;                     // T
  std::string precision = "fp32";  // "fp32" or "bf16"; the plan sets exec.precision from it
  model::ExecOptions exec;         // attention kernel, LM head, recomputation per block
  int prefetch_depth = 2;          // steps of token ids the loader prepares ahead
  // Data parallelism: micro_batch and accumulation are per rank; each rank stages the whole
  // global step (ranks x accumulation x micro_batch sequences) and reads its share. With
  // zero_stage 1-3 the optimizer state (m, v) is a shard per rank and a reduced-gradient shard
  // is added (plan/zero.h).
  // Stages 2-3 replace the full gradient buffer by gradient windows (gpt2_zero_window_sizes),
  // and stage 3 the full parameters by a per-unit shard plus parameter windows
  // (docs/notes/zero.md, "Windows in the executor").
  int ranks = 1;
  int zero_stage = 0;  // 0-3
  // Optimizer offload (ZeRO-Offload; docs/notes/offload.md): the fp32 master weights, AdamW's m
  // and v (this rank's shard with ZeRO 1-2) and the gradient copy the update reads live in the
  // offload tier (MemoryPlan::offload), where AdamW runs; the device keeps the parameters the
  // executor reads and the gradients.
  bool offload_optimizer = false;
  // Training with a sparsity mask (docs/notes/pruning.md): one byte per parameter float (the
  // flat buffer's floats, padding included; 1 keep, 0 pruned) in a persistent region of its own,
  // kSparsityMaskRegion, after every other. Needs zero_stage 0 and no optimizer offload.
  bool sparsity_mask = false;
  // The backend's device bytes outside the arenas (a CUDA device's context and workspaces;
  // DeviceSpec::backend_fixed, which the search copies here): counted in persistent_bytes and so
  // in the peak, and in by_category (the workspaces as workspace, the context as other), but in
  // no region: the backend allocates them itself. Zero on the CPU backend.
  BackendFixedBytes backend_fixed = {};
  // The backend whose scratch sizes and row strides the step's buffers take (the one that will
  // run it); null: the CPU's. Not owned.
  const backend::Ops* ops = nullptr;
};

// The ZeRO units (train/zero.h's gpt2_zero_units) as the executor's windows hold them: the
// embedding unit (wte, wpe; an untied LM head's unit takes turns with it in this window), the
// ln_f unit, and the largest block's decayed and other units (two slots of each: block l uses
// slot l % 2). Floats.
struct ZeroWindowSizes {
  int64_t embedding = 0, final_norm = 0, block_decay = 0, block_other = 0;
  // One set of windows: the embedding, ln_f and two block slots.
  int64_t total() const { return embedding + final_norm + 2 * (block_decay + block_other); }
  // The largest rank's stage-3 shard: per unit ceil(n / ranks) rounded up to 16 floats
  // (dist::ShardLayout::max_local_floats over gpt2_zero_units).
  int64_t unit_shard = 0;
};
ZeroWindowSizes gpt2_zero_window_sizes(const model::ParamTable& table, int ranks);

// The offload tier's regions (MemoryPlan::offload), found by name: optimizer offload's fp32
// master weights, AdamW's m and v, and the gradient copy the host update reads; and activation
// offload's saved activations. A plan may hold both kinds (one tier, one budget).
inline constexpr const char* kOffloadMasterRegion = "master weights";
inline constexpr const char* kOffloadOptimizerRegion = "optimizer";
inline constexpr const char* kOffloadGradientsRegion = "gradients";
inline constexpr const char* kOffloadedActivationsRegion = "offloaded activations";
// The persistent region of the sparsity mask (Policy::sparsity_mask), found by name.
inline constexpr const char* kSparsityMaskRegion = "sparsity mask";
// Distillation (ExecOptions::distill): the teacher's fp32 weights, a persistent region (category
// teacher) after the bf16 copy and before the sparsity mask, found by name. The teacher's
// forward-only working set is in the step region (ActivationTable::teacher).
inline constexpr const char* kTeacherWeightsRegion = "teacher weights";

// A block of memory that the trainer allocates as one arena.
struct Region {
  std::string name;
  memory::Category category;  // what the allocation is tagged with
  std::vector<memory::BufferDesc> buffers;
  memory::Layout layout;
};

struct MemoryPlan {
  static constexpr size_t kBf16WeightsRegion = 4;

  Policy policy;
  model::ParamTable params;
  model::ActivationTable activations;  // the step region's buffers and their ids
  std::vector<model::OpDesc> ops;      // the micro-batch schedule the lifetimes come from

  // Persistent regions (live for the whole run), in allocation order: parameters (the fp32
  // master weights with bf16), gradients, optimizer state, staging of the step's token ids, and
  // with bf16 precision the bf16 copy of the parameters (index kBf16WeightsRegion).
  std::vector<Region> persistent;
  // The micro-batch region: activations, logits, workspace; offsets from the offset planner.
  Region step;
  std::vector<int32_t> first_op, last_op;  // lifetime of each step buffer, in `ops` indices

  uint64_t persistent_bytes = 0;
  uint64_t step_bytes = 0;         // the step region's size (the offset plan)
  uint64_t step_lower_bound = 0;   // most bytes live at one op
  uint64_t peak_bytes = 0;         // persistent + step: what the device must hold
  uint64_t lower_bound_bytes = 0;  // persistent + step lower bound
  int peak_op = 0;                 // the op where the most step bytes are live
  // Bytes by category at the peak: persistent regions whole, step buffers live at peak_op.
  std::array<uint64_t, memory::kNumCategories> by_category{};
  std::string step_strategy;  // which placement heuristic won
  bool placed = true;         // false: step offsets not computed (see plan_training_memory)

  // The offload tier (a separate host resource with its own budget; pinned host memory on a
  // GPU): regions allocated from it, not counted in peak_bytes, found by name
  // (offload_region). With Policy::offload_optimizer: kOffloadMasterRegion (fp32 master
  // weights), kOffloadOptimizerRegion (adam_m, adam_v) and kOffloadGradientsRegion (the reduced
  // gradients the host update reads), each the rank's shard; the device's optimizer region
  // (index 2) is then empty. And, when some block is offloaded, kOffloadedActivationsRegion
  // (ActivationTable::offload_buffers). Both kinds are live through the whole step (the state
  // persistently, the activations of each micro-batch), so the tier holds their sum.
  std::vector<Region> offload;
  uint64_t offload_bytes = 0;  // the offload tier's regions together
};

// The persistent region named `name` (kTeacherWeightsRegion, ...), or null.
const Region* persistent_region(const MemoryPlan& plan, const char* name);
// The offload region named `name` (kOffload*Region), or null.
const Region* offload_region(const MemoryPlan& plan, const char* name);
// The offload tier's two parts: the offloaded activations' region, and the rest (optimizer
// offload's state; per rank, as shard_plan counts it in the search's derived plans). Their sum
// is plan.offload_bytes.
uint64_t offloaded_activation_bytes(const MemoryPlan& plan);
inline uint64_t offloaded_optimizer_bytes(const MemoryPlan& plan) {
  return plan.offload_bytes - offloaded_activation_bytes(plan);
}
// The two parts in words: "optimizer state 24.8 GiB + offloaded activations 1.21 GiB" (either
// alone when the other is empty; "" without offload).
std::string offload_parts(const MemoryPlan& plan);

// Moves the optimizer state of `plan` to the offload tier (Policy::offload_optimizer): m and v
// leave the device's optimizer region (which stays, empty, so region indices do not move), the
// device's fp32 parameters become working weights (category weights), and the offload tier gets
// the master weights, m, v and a gradient copy of the optimizer's shard, ahead of the
// offloaded activations' region when the plan has one (both share the tier). Updates the byte
// counts. plan_training_memory calls it; the search applies it to plans it already has.
// REQUIRES: !plan->policy.offload_optimizer.
void offload_optimizer_state(MemoryPlan* plan);

// Plans the memory of training `config` under `policy`. Errors: InvalidArgument for a policy
// that cannot run (seq above n_positions, non-positive sizes).
// `same_shape`, when given, is a plan of the same model, micro-batch and sequence length whose
// step region is reused instead of placed again (the search prices many accumulation counts).
// With place == false the step buffers get no offsets: step_bytes is the lower bound, an
// optimistic peak that lets the search reject candidates without placing them.
Result<MemoryPlan> plan_training_memory(const model::Gpt2Config& config, const Policy& policy,
                                        const MemoryPlan* same_shape = nullptr, bool place = true);

// The bytes of the step region's buffers live at op `op` (a column of the memory timeline).
uint64_t live_bytes_at(const MemoryPlan& plan, int op);

// A fixed-width table by category: bytes and share of the peak.
std::string category_table(const MemoryPlan& plan, uint64_t budget);

// The offload tier's regions: buffer, bytes, share ("" when nothing is offloaded).
std::string offload_table(const MemoryPlan& plan, uint64_t budget);

}  // namespace headroom::plan
