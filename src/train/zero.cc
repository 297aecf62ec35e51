// ZeRO stages 0-3: the reductions and the sharded AdamW step.
#include "train/zero.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <utility>

#include "core/check.h"

namespace headroom::train {
namespace {

// torch.nn.utils.clip_grad_norm_, as in adamw_step.
float clip_scale(const AdamWConfig& config, double norm) {
  if (config.grad_clip > 0) {
    const double coef = double(config.grad_clip) / (norm + 1e-6);
    if (coef < 1.0) return float(coef);
  }
  return 1.0f;
}

}  // namespace

Status reduce_scatter_units(dist::Communicator* comm, const dist::ShardLayout& layout, float* grads,
                            float* grad_shard) {
  for (size_t u = 0; u < layout.units().size(); ++u) {
    HR_RETURN_IF_ERROR(comm->reduce_scatter(grads + layout.units()[u].begin,
                                            grad_shard + layout.local_offset(u), layout.counts(u)));
  }
  return Status::ok();
}

Result<double> sharded_grad_norm(dist::Communicator* comm, const dist::ShardLayout& layout,
                                 const float* grad_shard, float loss_scale,
                                 const backend::Ops& ops) {
  double sq = 0.0;
  for (size_t u = 0; u < layout.units().size(); ++u) {
    sq += ops.sum_squares(grad_shard + layout.local_offset(u), layout.piece(u).size());
  }
  HR_RETURN_IF_ERROR(comm->all_reduce(&sq, 1));
  return std::sqrt(sq) / (loss_scale > 0 ? double(loss_scale) : 1.0);
}

void sharded_adamw(const dist::ShardLayout& layout, const model::ParamTable& table, float* params,
                   bool params_full, const float* grad_shard, float* m, float* v,
                   const AdamWConfig& config, float lr, int step, double norm, float loss_scale,
                   const backend::Ops& ops, const UpdateSink* sink) {
  // fp16 (loss_scale > 0): the gradients are scaled; the update is not (the unscaling folded
  // into the clipping factor).
  backend::AdamWParams ap{lr,
                          config.beta1,
                          config.beta2,
                          config.eps,
                          config.weight_decay,
                          step,
                          clip_scale(config, norm) / (loss_scale > 0 ? loss_scale : 1.0f)};
  const float weight_decay = ap.weight_decay;
  const int64_t decay_floats = table.decay_floats;
  for (size_t u = 0; u < layout.units().size(); ++u) {
    const dist::Range p = layout.piece(u);
    if (p.empty()) continue;
    const int64_t base = layout.local_offset(u);
    const dist::Range parts[2] = {{p.begin, std::min(p.end, decay_floats)},
                                  {std::max(p.begin, decay_floats), p.end}};
    for (int i = 0; i < 2; ++i) {
      const dist::Range g = parts[i];
      if (g.empty()) continue;
      const int64_t l = base + (g.begin - p.begin);
      ap.weight_decay = i == 0 ? weight_decay : 0.0f;
      UpdateSink::split(sink, l, g.size(), [&](int64_t off, int64_t n) {
        ops.adamw_update(params + (params_full ? g.begin : l) + off,
                         const_cast<float*>(grad_shard) + l + off, m + l + off, v + l + off, n, ap,
                         nullptr, false);
      });
    }
  }
}

namespace {

// A parameter's group: 0 = embeddings, 1 + l = block l, INT32_MAX = the rest (the final norm).
int gpt2_group(const model::ParamTable& table, const model::ParamDesc& p) {
  const int g = table.group_of(p);
  return g == INT32_MAX ? INT32_MAX : g + 1;
}

// (group, decay) -> the contiguous range of its tensors.
std::map<std::pair<int, bool>, dist::Range> gpt2_groups(const model::ParamTable& table) {
  std::map<std::pair<int, bool>, dist::Range> groups;
  for (const model::ParamDesc& p : table.params) {
    const int group = gpt2_group(table, p);
    const int64_t end = model::ParamTable::end_of(p);
    auto [it, fresh] = groups.try_emplace({group, p.decay}, dist::Range{p.offset, end});
    if (!fresh) {
      it->second.begin = std::min(it->second.begin, p.offset);
      it->second.end = std::max(it->second.end, end);
    }
  }
  return groups;
}

}  // namespace

std::vector<dist::Range> gpt2_zero_units(const model::ParamTable& table) {
  const std::map<std::pair<int, bool>, dist::Range> groups = gpt2_groups(table);
  std::vector<dist::Range> units;
  for (const auto& [key, r] : groups) units.push_back(r);
  std::sort(units.begin(), units.end(),
            [](const dist::Range& a, const dist::Range& b) { return a.begin < b.begin; });
  int64_t at = 0;
  for (const dist::Range& u : units) {
    HR_CHECK_MSG(u.begin == at, "gpt2_zero_units: a group's tensors are not contiguous");
    at = u.end;
  }
  HR_CHECK(at == table.total_floats);
  return units;
}

std::vector<dist::Range> gpt2_backward_order(const model::ParamTable& table) {
  const std::map<std::pair<int, bool>, dist::Range> groups = gpt2_groups(table);
  std::vector<std::pair<int, bool>> keys;
  for (const auto& [key, r] : groups) keys.push_back(key);
  // Sort key: ln_f first, then block l at -l (the last block first), the embeddings last.
  auto key = [](int group) {
    return group == INT32_MAX ? INT32_MIN : group == 0 ? INT32_MAX : -group;
  };
  std::stable_sort(keys.begin(), keys.end(), [&](const auto& a, const auto& b) {
    if (key(a.first) != key(b.first)) return key(a.first) < key(b.first);
    return a.second > b.second;  // decayed tensors first within a block
  });
  std::vector<dist::Range> order;
  for (const auto& k : keys) order.push_back(groups.at(k));
  return order;
}

ZeroOptimizer::ZeroOptimizer(dist::Communicator* comm, const model::ParamTable* table, int stage,
                             std::vector<dist::Range> units, const backend::Ops& ops)
    : comm_(comm),
      table_(table),
      stage_(stage),
      layout_(stage == 3
                  ? dist::ShardLayout(units.empty() ? gpt2_zero_units(*table) : std::move(units),
                                      comm->rank(), comm->size())
                  : dist::ShardLayout::flat(table->total_floats, comm->rank(), comm->size())),
      ops_(&ops) {
  HR_CHECK_MSG(stage >= 0 && stage <= 3, "ZeroOptimizer: stage must be 0, 1, 2 or 3");
  HR_CHECK(table->decay_floats % dist::kShardAlign == 0);
}

ZeroOptimizer::Sizes ZeroOptimizer::sizes() const {
  const int64_t full = table_->total_floats, shard = layout_.local_floats();
  switch (stage_) {
    case 0:
      return {full, full, 0, full, full};
    case 1:
    case 2:  // the same buffers until backward writes per-bucket windows (docs/notes/zero.md)
      return {full, full, shard, shard, shard};
    default:
      return {shard, full, shard, shard, shard};
  }
}

Result<double> ZeroOptimizer::step(const ZeroBuffers& b, const AdamWConfig& config, float lr,
                                   int step, bf16_t* params_bf16, float loss_scale) {
  HR_CHECK(b.params && b.m && b.v);
  HR_CHECK_MSG(params_bf16 == nullptr || stage_ < 3, "ZeRO-3 keeps no full bf16 copy");
  HR_CHECK_MSG(!b.zero_grads || stage_ == 0,
               "ZeroOptimizer: zero_grads is for stage 0 (AdamW reads grad_shard in stages 1-3)");
  if (stage_ == 0) {
    HR_CHECK(b.grads);
    if (!b.grads_reduced) HR_RETURN_IF_ERROR(comm_->all_reduce(b.grads, table_->total_floats));
    return b.zero_grads ? adamw_step_and_zero(*table_, b.params, b.grads, b.m, b.v, config, lr,
                                              step, params_bf16, loss_scale, *ops_)
                        : adamw_step(*table_, b.params, b.grads, b.m, b.v, config, lr, step,
                                     params_bf16, loss_scale, *ops_);
  }
  // Stages 1-3: reduce-scatter, then each rank updates only what it owns.
  HR_CHECK(b.grad_shard || layout_.local_floats() == 0);
  if (!b.grads_reduced) {
    HR_CHECK(b.grads);
    HR_RETURN_IF_ERROR(reduce_scatter_units(comm_, layout_, b.grads, b.grad_shard));
  }
  HR_ASSIGN_OR_RETURN(const double norm,
                      sharded_grad_norm(comm_, layout_, b.grad_shard, loss_scale, *ops_));
  if (loss_scale > 0 && !std::isfinite(norm)) return norm;  // overflow: every rank skips
  sharded_adamw(layout_, *table_, b.params, /*params_full=*/stage_ < 3, b.grad_shard, b.m, b.v,
                config, lr, step, norm, loss_scale, *ops_);

  if (stage_ < 3) {  // every rank needs the whole updated buffer: gather the pieces in place
    for (size_t u = 0; u < layout_.units().size(); ++u) {
      HR_RETURN_IF_ERROR(comm_->all_gather(b.params + layout_.piece(u).begin,
                                           b.params + layout_.units()[u].begin, layout_.counts(u)));
    }
    // The bf16 copy, cast from the gathered fp32 values with adamw_update's rounding (nearest
    // even). Gathering bf16 instead would halve the traffic (docs/notes/zero.md, "Left").
    if (params_bf16) ops_->cast_to_bf16(params_bf16, b.params, table_->total_floats);
  }
  return norm;
}

Status ZeroOptimizer::gather_params(const float* shard, float* full) {
  for (size_t u = 0; u < layout_.units().size(); ++u) {
    HR_RETURN_IF_ERROR(comm_->all_gather(shard + layout_.local_offset(u),
                                         full + layout_.units()[u].begin, layout_.counts(u)));
  }
  return Status::ok();
}

void ZeroOptimizer::scatter_params(const float* full, float* shard) const {
  // The shard is the device's (parameters; m and v) or, with optimizer offload, the offload
  // tier's host memory (m and v on resume).
  const bool to_device = ops_->is_device_pointer(shard);
  for (size_t u = 0; u < layout_.units().size(); ++u) {
    const dist::Range p = layout_.piece(u);
    if (p.empty()) continue;
    float* dst = shard + layout_.local_offset(u);
    if (to_device) {
      ops_->copy_to_device(dst, full + p.begin, size_t(p.size()) * 4);
    } else {
      std::memcpy(dst, full + p.begin, size_t(p.size()) * 4);
    }
  }
}

}  // namespace headroom::train
