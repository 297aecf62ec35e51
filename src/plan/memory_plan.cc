// Memory planning: lifetimes from the model's op list, offsets from the offset planner.
#include "plan/memory_plan.h"

#include <fmt/format.h>

#include "core/units.h"
#include "memory/offset_planner.h"
#include "plan/zero.h"

namespace headroom::plan {

using memory::BufferDesc;
using memory::Category;

namespace {
Region single_region(std::string name, Category c, std::vector<BufferDesc> buffers) {
  Region r{std::move(name), c, std::move(buffers), {}};
  r.layout = memory::sequential_layout(r.buffers);
  return r;
}
}  // namespace

Result<MemoryPlan> plan_training_memory(const model::Gpt2Config& config, const Policy& p,
                                        const MemoryPlan* same_shape, bool place) {
  HR_RETURN_IF_ERROR(config.validate());
  if (p.seq <= 0 || p.seq > config.n_positions) {
    return Status::invalid_argument(
        fmt::format("sequence length {} must be between 1 and the model's n_positions ({})", p.seq,
                    config.n_positions));
  }
  if (p.micro_batch <= 0 || p.accumulation <= 0 || p.prefetch_depth <= 0) {
    return Status::invalid_argument(fmt::format(
        "micro-batch {} and accumulation {} must be positive", p.micro_batch, p.accumulation));
  }
  if (p.ranks <= 0 || p.zero_stage < 0 || p.zero_stage > 3) {
    return Status::invalid_argument(fmt::format(
        "ranks {} must be positive and the ZeRO stage {} one of 0-3", p.ranks, p.zero_stage));
  }
  if (p.zero_stage == 3) {
    return Status::unsupported(
        "ZeRO-3 is not built into the trainer yet: the model reads one full parameter buffer, so "
        "sharding the parameters would save nothing (it needs per-layer parameter windows); use "
        "--zero 0, 1 or 2");
  }
  MemoryPlan plan;
  plan.policy = p;
  // The precision name is the policy's; the model reads it from the execution options.
  if (p.precision == "bf16") {
    plan.policy.exec.precision = model::Precision::kBf16;
    if (!p.exec.tiled_attention) {
      return Status::invalid_argument("bf16 precision needs tiled attention (--attention tiled)");
    }
  } else if (p.precision == "fp32") {
    plan.policy.exec.precision = model::Precision::kFp32;
  } else {
    return Status::unsupported(fmt::format(
        "precision {} is not built yet (fp32 and bf16 are; fp16 with loss scaling is planned)",
        p.precision));
  }
  const bool bf16 = plan.policy.exec.precision == model::Precision::kBf16;
  plan.params = model::gpt2_param_table(config);
  if (!p.exec.recompute.empty() && int(p.exec.recompute.size()) != config.n_layer) {
    return Status::invalid_argument(
        fmt::format("a recompute choice per block is needed: got {} for {} blocks",
                    p.exec.recompute.size(), config.n_layer));
  }
  if (!p.exec.offload.empty() && int(p.exec.offload.size()) != config.n_layer) {
    return Status::invalid_argument(
        fmt::format("an offload choice per block is needed: got {} for {} blocks",
                    p.exec.offload.size(), config.n_layer));
  }
  for (int l = 0; l < config.n_layer; l++) {
    if (p.exec.offload_at(l) && p.exec.recompute_at(l) == model::Recompute::kFull) {
      return Status::invalid_argument(fmt::format(
          "block {} is both fully recomputed and offloaded: full recomputation keeps nothing to "
          "offload (use none or selective with offload)",
          l));
    }
  }
  if (p.exec.head_chunk < 0) {
    return Status::invalid_argument(fmt::format("LM head chunk {} is negative", p.exec.head_chunk));
  }
  plan.activations =
      model::gpt2_activation_table(config, p.micro_batch, p.seq, true, plan.policy.exec);
  plan.ops = model::gpt2_step_ops(config, plan.activations, true);

  const int64_t P = plan.params.total_floats;
  const int64_t tokens = int64_t(p.ranks) * p.accumulation * p.micro_batch * p.seq;
  // With bf16 the fp32 parameters are the master weights, and a bf16 copy (region 4, after
  // staging) is what the GEMMs read.
  const Category param_cat = bf16 ? Category::kMaster : Category::kWeights;
  plan.persistent.push_back(single_region(bf16 ? "master weights" : "parameters", param_cat,
                                          {{"parameters", DType::kF32, Shape{P}, param_cat}}));
  // ZeRO-1/2 (plan/zero.h): m and v are this rank's shard, and the gradients reduce-scattered to
  // this rank land in a shard next to the full accumulation buffer. Every rank plans the largest
  // shard, so that all ranks hold the same plan (the last one's piece may be shorter).
  ZeroSpec zs;
  zs.stage = p.zero_stage;
  zs.ranks = p.ranks;
  zs.param_floats = P;
  const int64_t shard = p.zero_stage == 0 ? P : zero_memory(zs).optimizer / 8;
  std::vector<BufferDesc> grads = {{"gradients", DType::kF32, Shape{P}, Category::kGrads}};
  if (p.zero_stage > 0) {
    grads.push_back({"gradient_shard", DType::kF32, Shape{shard}, Category::kGrads});
  }
  plan.persistent.push_back(single_region("gradients", Category::kGrads, std::move(grads)));
  plan.persistent.push_back(
      single_region("optimizer", Category::kOptimizer,
                    {{"adam_m", DType::kF32, Shape{shard}, Category::kOptimizer},
                     {"adam_v", DType::kF32, Shape{shard}, Category::kOptimizer}}));
  // Token staging: `prefetch_depth` slots of a whole step's micro-batches (the loader fills one
  // while the step runs on another), and one micro-batch for validation. With several ranks a
  // slot holds the whole global step (every rank reads the same stream and takes its share).
  std::vector<BufferDesc> staging;
  for (int d = 0; d < p.prefetch_depth; d++) {
    staging.push_back(
        {"input_ids." + std::to_string(d), DType::kI32, Shape{tokens}, Category::kStaging});
    staging.push_back(
        {"targets." + std::to_string(d), DType::kI32, Shape{tokens}, Category::kStaging});
  }
  const int64_t mb_tokens = int64_t(p.micro_batch) * p.seq;
  staging.push_back({"val_input_ids", DType::kI32, Shape{mb_tokens}, Category::kStaging});
  staging.push_back({"val_targets", DType::kI32, Shape{mb_tokens}, Category::kStaging});
  plan.persistent.push_back(single_region("staging", Category::kStaging, std::move(staging)));
  if (bf16 && plan.policy.exec.bf16_weight_copy) {
    plan.persistent.push_back(
        single_region("bf16 weights", Category::kWeights,
                      {{"parameters_bf16", DType::kBF16, Shape{P}, Category::kWeights}}));
  }

  if (same_shape && same_shape->policy.micro_batch == p.micro_batch &&
      same_shape->policy.seq == p.seq && same_shape->policy.exec == plan.policy.exec &&
      same_shape->params.total_floats == P && (same_shape->placed || !place)) {
    plan.first_op = same_shape->first_op;
    plan.last_op = same_shape->last_op;
    plan.step = same_shape->step;
    plan.step_strategy = same_shape->step_strategy;
    plan.step_lower_bound = same_shape->step_lower_bound;
    plan.placed = same_shape->placed;
  } else {
    // Lifetimes: the first and last op that touches each step buffer.
    const std::vector<BufferDesc>& bufs = plan.activations.buffers;
    plan.first_op.assign(bufs.size(), INT32_MAX);
    plan.last_op.assign(bufs.size(), -1);
    for (size_t o = 0; o < plan.ops.size(); o++) {
      for (size_t b : plan.ops[o].buffers) {
        plan.first_op[b] = std::min(plan.first_op[b], int32_t(o));
        plan.last_op[b] = std::max(plan.last_op[b], int32_t(o));
      }
    }
    std::vector<memory::LiveRange> ranges(bufs.size());
    for (size_t i = 0; i < bufs.size(); i++) {
      HR_CHECK_MSG(plan.last_op[i] >= 0, "a step buffer is not used by any op");
      ranges[i] = {bufs[i].bytes(), memory::kBufferAlignment, plan.first_op[i], plan.last_op[i]};
    }
    plan.step.name = "step";
    plan.step.category = Category::kActivations;
    plan.step.buffers = bufs;
    if (place) {
      memory::OffsetPlan offsets = memory::plan_offsets(ranges);
      plan.step.layout.offsets = offsets.offsets;
      plan.step.layout.size = offsets.size;
      plan.step_strategy = offsets.strategy;
      plan.step_lower_bound = offsets.lower_bound;
    } else {
      plan.step_lower_bound = memory::live_bytes_lower_bound(ranges);
      plan.step.layout.size = plan.step_lower_bound;
      plan.step_strategy = "not placed";
      plan.placed = false;
    }
  }

  if (!plan.activations.offload_buffers.empty()) {
    plan.offload.push_back(single_region(kOffloadedActivationsRegion, Category::kOffload,
                                         plan.activations.offload_buffers));
  }
  for (const Region& r : plan.offload) plan.offload_bytes += r.layout.size;
  for (const Region& r : plan.persistent) plan.persistent_bytes += r.layout.size;
  plan.step_bytes = plan.step.layout.size;
  plan.peak_bytes = plan.persistent_bytes + plan.step_bytes;
  plan.lower_bound_bytes = plan.persistent_bytes + plan.step_lower_bound;

  uint64_t best = 0;
  for (int o = 0; o < int(plan.ops.size()); o++) {
    uint64_t live = live_bytes_at(plan, o);
    if (live > best) {
      best = live;
      plan.peak_op = o;
    }
  }
  for (const Region& r : plan.persistent) {
    for (const BufferDesc& b : r.buffers) plan.by_category[size_t(b.category)] += b.bytes();
  }
  const std::vector<BufferDesc>& bufs = plan.step.buffers;
  for (size_t i = 0; i < bufs.size(); i++) {
    if (plan.first_op[i] <= plan.peak_op && plan.peak_op <= plan.last_op[i]) {
      plan.by_category[size_t(bufs[i].category)] += bufs[i].bytes();
    }
  }
  return plan;
}

uint64_t live_bytes_at(const MemoryPlan& plan, int op) {
  uint64_t live = 0;
  const auto& bufs = plan.step.buffers;
  for (size_t i = 0; i < bufs.size(); i++) {
    if (plan.first_op[i] <= op && op <= plan.last_op[i]) {
      live += (bufs[i].bytes() + memory::kBufferAlignment - 1) / memory::kBufferAlignment *
              memory::kBufferAlignment;
    }
  }
  return live;
}

std::string category_table(const MemoryPlan& plan, uint64_t budget) {
  std::string s = fmt::format("  {:<12} {:>12} {:>7}\n", "category", "bytes", "share");
  uint64_t sum = 0;
  for (size_t i = 0; i < memory::kNumCategories; i++) {
    uint64_t b = plan.by_category[i];
    if (!b) continue;
    sum += b;
    s += fmt::format("  {:<12} {:>12} {:>6.1f}%\n", memory::category_name(static_cast<Category>(i)),
                     format_bytes(b), 100.0 * double(b) / double(plan.peak_bytes));
  }
  if (plan.peak_bytes > sum) {
    s +=
        fmt::format("  {:<12} {:>12} {:>6.1f}%\n", "placement", format_bytes(plan.peak_bytes - sum),
                    100.0 * double(plan.peak_bytes - sum) / double(plan.peak_bytes));
  }
  s += fmt::format("  {:<12} {:>12}   ({:.1f}% of the {} budget; lower bound {})\n", "peak",
                   format_bytes(plan.peak_bytes),
                   budget ? 100.0 * double(plan.peak_bytes) / double(budget) : 0.0,
                   format_bytes(budget), format_bytes(plan.lower_bound_bytes));
  if (plan.offload_bytes > 0) {
    s += fmt::format(
        "  {:<12} {:>12}   (offload tier, outside the device peak: {} blocks' "
        "activations)\n",
        "offload", format_bytes(plan.offload_bytes), plan.activations.offloaded.size());
  }
  return s;
}

}  // namespace headroom::plan
