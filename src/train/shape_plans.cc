// The per-shape plan cache (see shape_plans.h).
#include "train/shape_plans.h"

#include <algorithm>
#include <set>

#include "core/check.h"

namespace headroom::train {

int rows_per_micro_batch(int b, int T, int length) {
  HR_CHECK(b >= 1 && T >= 1 && length >= 1 && length <= T);
  return std::max(1, int(int64_t(b) * T / length));
}

std::vector<std::pair<int, int>> micro_batch_shapes(
    const std::vector<std::pair<int, int>>& step_shapes, int b, int T) {
  std::set<std::pair<int, int>> out;
  for (const auto& [rows, length] : step_shapes) {
    const int r = rows_per_micro_batch(b, T, length);
    if (rows >= r) out.insert({r, length});
    if (rows % r) out.insert({rows % r, length});
  }
  return {out.begin(), out.end()};
}

ShapePlans::ShapePlans(model::Gpt2Config config, plan::Policy policy)
    : config_(std::move(config)), policy_(std::move(policy)) {}

void ShapePlans::reset(plan::Policy policy) {
  policy_ = std::move(policy);
  plans_.clear();
}

Result<const plan::MemoryPlan*> ShapePlans::get(int rows, int length) {
  auto it = plans_.find({rows, length});
  if (it != plans_.end()) {
    hits_++;
    return &it->second;
  }
  plan::Policy p = policy_;
  p.micro_batch = rows;
  p.accumulation = 1;
  p.seq = length;
  HR_ASSIGN_OR_RETURN(plan::MemoryPlan mp, plan::plan_training_memory(config_, p));
  misses_++;
  return &plans_.emplace(std::make_pair(rows, length), std::move(mp)).first->second;
}

Result<ShapePlans::Largest> ShapePlans::largest(const std::vector<std::pair<int, int>>& shapes) {
  Largest l;
  for (const auto& [rows, length] : shapes) {
    HR_ASSIGN_OR_RETURN(const plan::MemoryPlan* p, get(rows, length));
    if (!l.plan || p->step_bytes > l.step_bytes) {
      l = {{rows, length}, p->step_bytes, p};
    }
  }
  return l;
}

}  // namespace headroom::train
