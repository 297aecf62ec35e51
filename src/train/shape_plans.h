// Memory plans per micro-batch shape (issue #5): with bucketed batching a micro-batch is
// `rows x length` tokens under the plan's token budget, so the step region is planned once per
// shape that occurs, cached, and acquired from the pool per micro-batch. See
// docs/notes/batching.md.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "core/status.h"
#include "model/config.h"
#include "plan/memory_plan.h"

namespace headroom::train {

// Rows of `length` tokens in a micro-batch whose token budget is b x T: floor(b T / length),
// at least 1. At length T it is b. REQUIRES: b, T, length positive, length <= T.
int rows_per_micro_batch(int b, int T, int length);

// The micro-batch shapes (rows, length) that occur when step batches of `step_shapes`
// (rows, length) are cut into micro-batches of rows_per_micro_batch(b, T, length) rows, the
// last one of a step taking what is left. Sorted, without repeats.
std::vector<std::pair<int, int>> micro_batch_shapes(
    const std::vector<std::pair<int, int>>& step_shapes, int b, int T);

// A cache of step-region plans keyed by (rows, length), for one policy (precision, LM head,
// recomputation) of one model. Not thread-safe; the training thread owns it. Plans live as long
// as the cache (or until reset()), at stable addresses: the model binds their activation tables.
class ShapePlans {
 public:
  ShapePlans(model::Gpt2Config config, plan::Policy policy);

  // The plan of a micro-batch of `rows` sequences of `length` tokens: planned on first use.
  // Errors: those of plan::plan_training_memory (a length above n_positions).
  Result<const plan::MemoryPlan*> get(int rows, int length);
  // Forgets every plan and takes `policy` (after a re-plan changed the techniques).
  void reset(plan::Policy policy);

  // The shape with the largest step region among `shapes`, and that region's size.
  struct Largest {
    std::pair<int, int> shape{0, 0};
    uint64_t step_bytes = 0;
    const plan::MemoryPlan* plan = nullptr;
  };
  Result<Largest> largest(const std::vector<std::pair<int, int>>& shapes);

  uint64_t hits() const { return hits_; }
  uint64_t misses() const { return misses_; }  // plans computed
  size_t size() const { return plans_.size(); }

 private:
  model::Gpt2Config config_;
  plan::Policy policy_;
  std::map<std::pair<int, int>, plan::MemoryPlan> plans_;
  uint64_t hits_ = 0, misses_ = 0;
};

}  // namespace headroom::train
