// Memory planning: lifetimes from the model's op list, offsets from the offset planner.
#include "plan/memory_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "core/units.h"
#include "memory/offset_planner.h"
#include "plan/zero.h"

namespace headroom::plan {

using memory::BufferDesc;
using memory::Category;

namespace {
// The parameter table of `c`, kept per thread: the search plans thousands of configurations of
// one model, and building the table (names, shapes, offsets) cost more than copying it.
const model::ParamTable& param_table_of(const model::Gpt2Config& c) {
  thread_local model::TransformerConfig key;
  thread_local model::ParamTable table;
  if (!(c == key) || table.params.empty()) {
    table = model::gpt2_param_table(c);
    key = c;
  }
  return table;
}

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
  HR_RETURN_IF_ERROR(config.check_seq(p.seq));
  if (p.micro_batch <= 0 || p.accumulation <= 0 || p.prefetch_depth <= 0) {
    return Status::invalid_argument(fmt::format(
        "micro-batch {} and accumulation {} must be positive", p.micro_batch, p.accumulation));
  }
  if (p.ranks <= 0 || p.zero_stage < 0 || p.zero_stage > 3) {
    return Status::invalid_argument(fmt::format(
        "ranks {} must be positive and the ZeRO stage {} one of 0-3", p.ranks, p.zero_stage));
  }
  MemoryPlan plan;
  plan.policy = p;
  // The precision name is the policy's; the model reads it from the execution options.
  if (p.precision == "bf16") {
    plan.policy.exec.precision = model::Precision::kBf16;
    if (!p.exec.tiled_attention) {
      return Status::invalid_argument("bf16 precision needs tiled attention (--attention tiled)");
    }
  } else if (p.precision == "fp16") {
    plan.policy.exec.precision = model::Precision::kFp16;
    // fp16 casts its GEMM weights per layer (Note [fp16 GEMMs]): no persistent copy.
    plan.policy.exec.bf16_weight_copy = false;
    if (!p.exec.tiled_attention) {
      return Status::invalid_argument("fp16 precision needs tiled attention (--attention tiled)");
    }
  } else if (p.precision == "fp32") {
    plan.policy.exec.precision = model::Precision::kFp32;
  } else {
    return Status::unsupported(
        fmt::format("precision {} is not built (fp32, bf16 and fp16 are)", p.precision));
  }
  const bool bf16 = plan.policy.exec.precision == model::Precision::kBf16;
  // Mixed precision (bf16 or fp16): the fp32 parameters are the master weights.
  const bool mixed = plan.policy.exec.precision != model::Precision::kFp32;
  plan.params = param_table_of(config);
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
  if (const std::optional<model::Distill>& d = p.exec.distill) {
    // Distillation (docs/notes/distillation.md): the KD loss lives in the chunked LM head.
    if (p.exec.head_chunk <= 0) {
      return Status::invalid_argument(
          "distillation fuses its loss into the chunked LM head: it needs the fused head "
          "(head chunk > 0), not full logits");
    }
    if (d->teacher.vocab_size != config.vocab_size) {
      return Status::invalid_argument(fmt::format(
          "the teacher's vocab_size {} differs from the student's {}: distillation needs one "
          "tokenizer and vocabulary",
          d->teacher.vocab_size, config.vocab_size));
    }
    if (d->teacher.n_positions < p.seq) {
      return Status::invalid_argument(fmt::format(
          "the teacher's n_positions {} is below the sequence length {}: use --seq {} or less",
          d->teacher.n_positions, p.seq, d->teacher.n_positions));
    }
    if (d->teacher_precision == model::Precision::kFp16) {
      return Status::invalid_argument("a teacher runs in fp32 or bf16 (--teacher-dtype)");
    }
    if (p.ranks > 1 || p.zero_stage != 0) {
      return Status::unsupported(
          "distillation runs on one process (ZeRO and several ranks are not built for it yet)");
    }
  }
  plan.activations = model::gpt2_activation_table(
      config, p.micro_batch, p.seq, true, plan.policy.exec, p.ops ? *p.ops : backend::cpu_ops());
  plan.ops = model::gpt2_step_ops(config, plan.activations, true);

  const int64_t P = plan.params.total_floats;
  const int64_t tokens = int64_t(p.ranks) * p.accumulation * p.micro_batch * p.seq;
  // With bf16 the fp32 parameters are the master weights, and a bf16 copy (region 4, after
  // staging) is what the GEMMs read.
  const Category param_cat = mixed ? Category::kMaster : Category::kWeights;
  if (p.zero_stage == 3 && bf16 && plan.policy.exec.bf16_weight_copy) {
    return Status::invalid_argument(
        "ZeRO-3 with bf16 casts each block's weights when it is gathered: a persistent bf16 "
        "copy of the whole model would undo the sharding (use --bf16-weights cast)");
  }
  // ZeRO (plan/zero.h): m and v are this rank's shard, and the gradients reduce-scattered to
  // this rank land in a shard. Every rank plans the largest shard, so that all ranks hold the
  // same plan (the last one's piece may be shorter). Stages 1-2 shard the flat buffer as one
  // unit, stage 3 each unit of gpt2_zero_units.
  const ZeroWindowSizes win = gpt2_zero_window_sizes(plan.params, p.ranks);
  ZeroSpec zs;
  zs.stage = p.zero_stage;
  zs.ranks = p.ranks;
  zs.param_floats = P;
  if (p.zero_stage == 3) zs.shard_floats = win.unit_shard;
  const int64_t shard = p.zero_stage == 0 ? P : zero_memory(zs).optimizer / 8;
  // The six windows of one kind, in ZeroWindowPtrs' order (train/zero_windows.h).
  auto windows = [&](const std::string& prefix, Category cat) {
    std::vector<BufferDesc> w;
    w.push_back({prefix + ".embeddings", DType::kF32, Shape{win.embedding}, cat});
    w.push_back({prefix + ".ln_f", DType::kF32, Shape{win.final_norm}, cat});
    for (int slot = 0; slot < 2; slot++) {
      const std::string s = prefix + ".slot" + std::to_string(slot);
      w.push_back({s + ".decay", DType::kF32, Shape{win.block_decay}, cat});
      w.push_back({s + ".other", DType::kF32, Shape{win.block_other}, cat});
    }
    return w;
  };
  if (p.zero_stage < 3) {
    plan.persistent.push_back(single_region(mixed ? "master weights" : "parameters", param_cat,
                                            {{"parameters", DType::kF32, Shape{P}, param_cat}}));
  } else {
    // This rank's shard (the fp32 master with bf16) and the gathered units it computes with.
    std::vector<BufferDesc> params = {{"parameter_shard", DType::kF32, Shape{shard}, param_cat}};
    for (BufferDesc& b : windows("parameter_window", Category::kComm)) params.push_back(b);
    plan.persistent.push_back(
        single_region(mixed ? "master weights" : "parameters", param_cat, std::move(params)));
  }
  std::vector<BufferDesc> grads;
  if (p.zero_stage < 2) {
    grads.push_back({"gradients", DType::kF32, Shape{P}, Category::kGrads});
  } else {
    // Backward writes each unit into a window that is reduce-scattered as soon as it is final.
    grads = windows("gradient_window", Category::kGrads);
  }
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
  if (const std::optional<model::Distill>& d = p.exec.distill) {
    // The teacher's weights, fp32 whatever its precision (a bf16 teacher casts each layer's GEMM
    // weights into its working set, in the step region), for the whole run.
    const int64_t tp = param_table_of(d->teacher).total_floats;
    plan.persistent.push_back(
        single_region(kTeacherWeightsRegion, Category::kTeacher,
                      {{"teacher_parameters", DType::kF32, Shape{tp}, Category::kTeacher}}));
  }
  if (p.sparsity_mask) {
    if (p.zero_stage != 0 || p.offload_optimizer) {
      return Status::invalid_argument(
          "a sparsity mask (--sparsity-mask, --prune-at) needs the full parameters and optimizer "
          "state on the device: use --zero 0 without --offload-optimizer");
    }
    // One byte per weight (1 keep, 0 pruned): AdamW's pass masks the gradients before and the
    // weights after the update (docs/notes/pruning.md). The optimizer's state, as m and v.
    plan.persistent.push_back(
        single_region(kSparsityMaskRegion, Category::kOptimizer,
                      {{"sparsity_mask", DType::kU8, Shape{P}, Category::kOptimizer}}));
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
  // The backend's fixed bytes live as long as the process: persistent, in no region.
  plan.persistent_bytes += p.backend_fixed.total();
  plan.step_bytes = plan.step.layout.size;
  plan.peak_bytes = plan.persistent_bytes + plan.step_bytes;
  plan.lower_bound_bytes = plan.persistent_bytes + plan.step_lower_bound;

  // The first op with the most live step bytes (live_bytes_at of every op, in one sweep over
  // the lifetimes instead of one pass over the buffers per op: the search plans thousands).
  std::vector<int64_t> delta(plan.ops.size() + 1, 0);
  for (size_t i = 0; i < plan.step.buffers.size(); i++) {
    const int64_t b = int64_t((plan.step.buffers[i].bytes() + memory::kBufferAlignment - 1) /
                              memory::kBufferAlignment * memory::kBufferAlignment);
    delta[size_t(plan.first_op[i])] += b;
    delta[size_t(plan.last_op[i]) + 1] -= b;
  }
  int64_t live = 0, best = 0;
  for (int o = 0; o < int(plan.ops.size()); o++) {
    live += delta[size_t(o)];
    if (live > best) {
      best = live;
      plan.peak_op = o;
    }
  }
  for (const Region& r : plan.persistent) {
    for (const BufferDesc& b : r.buffers) plan.by_category[size_t(b.category)] += b.bytes();
  }
  plan.by_category[size_t(Category::kWorkspace)] += p.backend_fixed.cublaslt_workspace +
                                                    p.backend_fixed.op_workspace +
                                                    p.backend_fixed.collective;
  plan.by_category[size_t(Category::kOther)] += p.backend_fixed.context;
  const std::vector<BufferDesc>& bufs = plan.step.buffers;
  for (size_t i = 0; i < bufs.size(); i++) {
    if (plan.first_op[i] <= plan.peak_op && plan.peak_op <= plan.last_op[i]) {
      plan.by_category[size_t(bufs[i].category)] += bufs[i].bytes();
    }
  }
  if (p.offload_optimizer) {
    plan.policy.offload_optimizer = false;  // planned without, then moved
    offload_optimizer_state(&plan);
  }
  return plan;
}

ZeroWindowSizes gpt2_zero_window_sizes(const model::ParamTable& table, int ranks) {
  // Units as train/zero.cc's gpt2_groups: (group, decay) -> the range of its tensors, groups
  // -1 embeddings, l block l, INT32_MAX the head's (ln_f; an untied LM head decayed).
  std::map<std::pair<int, bool>, std::pair<int64_t, int64_t>> units;
  for (const model::ParamDesc& d : table.params) {
    const int group = table.group_of(d);
    const int64_t end = model::ParamTable::end_of(d);
    auto [it, fresh] = units.try_emplace({group, d.decay}, std::make_pair(d.offset, end));
    if (!fresh) {
      it->second.first = std::min(it->second.first, d.offset);
      it->second.second = std::max(it->second.second, end);
    }
  }
  ZeroWindowSizes w;
  for (const auto& [key, range] : units) {
    const int64_t n = range.second - range.first;
    if (key.first == -1 || (key.first == INT32_MAX && key.second)) {
      // An untied head (the head site's decayed unit) shares the embedding's window: the
      // embedding releases it after its forward, and its gradient is reduced before the
      // embedding's backward writes there (train/zero_windows.h).
      w.embedding = std::max(w.embedding, n);
    } else if (key.first == INT32_MAX) {
      w.final_norm = std::max(w.final_norm, n);
    } else {
      int64_t& slot = key.second ? w.block_decay : w.block_other;
      slot = std::max(slot, n);
    }
    w.unit_shard += std::min(n, ((n + ranks - 1) / ranks + 15) / 16 * 16);
  }
  return w;
}

// See Note [Optimizer offload] in docs/notes/offload.md.
void offload_optimizer_state(MemoryPlan* plan) {
  HR_CHECK_MSG(plan->persistent.size() > 2 && !plan->policy.offload_optimizer &&
                   !offload_region(*plan, kOffloadMasterRegion),
               "offload_optimizer_state: a training plan without optimizer offload expected");
  Region& params = plan->persistent[0];
  Region& opt = plan->persistent[2];
  const int64_t shard = opt.buffers.at(0).shape.numel();  // m's floats: the optimizer's shard
  // The executor reads the fp32 parameters (with bf16 too: LayerNorm, biases, embeddings and the
  // casts read them), so they stay as working weights; the master copy is the offload tier's.
  const auto moved = [plan](const Region& r) {
    for (const BufferDesc& b : r.buffers) plan->by_category[size_t(b.category)] -= b.bytes();
    plan->persistent_bytes -= std::min(plan->persistent_bytes, r.layout.size);
  };
  if (params.category != Category::kWeights) {
    for (const BufferDesc& b : params.buffers) {
      plan->by_category[size_t(b.category)] -= b.bytes();
      plan->by_category[size_t(Category::kWeights)] += b.bytes();
    }
    params.name = "parameters";
    params.category = Category::kWeights;
    for (BufferDesc& b : params.buffers) b.category = Category::kWeights;
  }
  moved(opt);
  // The optimizer's regions first, then what was there (the offloaded activations, if any).
  std::vector<Region> tier;
  tier.push_back(single_region(kOffloadMasterRegion, Category::kMaster,
                               {{"master_weights", DType::kF32, Shape{shard}, Category::kMaster}}));
  tier.push_back(
      single_region(kOffloadOptimizerRegion, Category::kOptimizer, std::move(opt.buffers)));
  tier.push_back(
      single_region(kOffloadGradientsRegion, Category::kGrads,
                    {{"offload_gradients", DType::kF32, Shape{shard}, Category::kGrads}}));
  for (Region& r : plan->offload) tier.push_back(std::move(r));
  plan->offload = std::move(tier);
  opt.name = "optimizer (offloaded)";
  opt.buffers.clear();
  opt.layout = memory::Layout{};
  plan->offload_bytes = 0;
  for (const Region& r : plan->offload) plan->offload_bytes += r.layout.size;
  plan->peak_bytes = plan->persistent_bytes + plan->step_bytes;
  plan->lower_bound_bytes = plan->persistent_bytes + plan->step_lower_bound;
  plan->policy.offload_optimizer = true;
}

const Region* persistent_region(const MemoryPlan& plan, const char* name) {
  for (const Region& r : plan.persistent) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

const Region* offload_region(const MemoryPlan& plan, const char* name) {
  for (const Region& r : plan.offload) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

uint64_t offloaded_activation_bytes(const MemoryPlan& plan) {
  const Region* r = offload_region(plan, kOffloadedActivationsRegion);
  return r ? r->layout.size : 0;
}

std::string offload_parts(const MemoryPlan& plan) {
  const uint64_t acts = offloaded_activation_bytes(plan), state = plan.offload_bytes - acts;
  std::string s;
  if (state > 0) s = fmt::format("optimizer state {}", format_bytes(state));
  if (acts > 0) {
    s += fmt::format("{}offloaded activations {}", s.empty() ? "" : " + ", format_bytes(acts));
  }
  return s;
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
  if (const std::string fixed = describe_fixed_bytes(plan.policy.backend_fixed); !fixed.empty()) {
    s += fmt::format("  (of which the backend's, outside the arenas: {})\n", fixed);
  }
  s += fmt::format("  {:<12} {:>12}   ({:.1f}% of the {} budget; lower bound {})\n", "peak",
                   format_bytes(plan.peak_bytes),
                   budget ? 100.0 * double(plan.peak_bytes) / double(budget) : 0.0,
                   format_bytes(budget), format_bytes(plan.lower_bound_bytes));
  if (plan.offload_bytes > 0) {
    s += fmt::format("  {:<12} {:>12}   (offload tier, outside the device peak: {})\n", "offload",
                     format_bytes(plan.offload_bytes), offload_parts(plan));
  }
  return s;
}

std::string offload_table(const MemoryPlan& plan, uint64_t budget) {
  if (plan.offload.empty()) return "";
  std::string s = fmt::format("  {:<20} {:>12} {:>7}\n", "offload tier", "bytes", "share");
  const double total = double(std::max<uint64_t>(1, plan.offload_bytes));
  for (const Region& r : plan.offload) {
    // The offloaded activations as one row (a dozen buffers per block).
    if (r.name == kOffloadedActivationsRegion) {
      s += fmt::format("  {:<20} {:>12} {:>6.1f}%   ({} blocks)\n", r.name,
                       format_bytes(r.layout.size), 100.0 * double(r.layout.size) / total,
                       plan.activations.offloaded.size());
      continue;
    }
    for (const BufferDesc& b : r.buffers) {
      s += fmt::format("  {:<20} {:>12} {:>6.1f}%\n", b.name, format_bytes(b.bytes()),
                       100.0 * double(b.bytes()) / total);
    }
  }
  s += fmt::format("  {:<20} {:>12}   {}\n", "total", format_bytes(plan.offload_bytes),
                   budget ? fmt::format("({:.1f}% of the {} offload budget)",
                                        100.0 * double(plan.offload_bytes) / double(budget),
                                        format_bytes(budget))
                          : std::string("(offload budget not limited)"));
  return s;
}

}  // namespace headroom::plan
