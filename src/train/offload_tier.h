// The offload tier of a training run: a host resource of its own with one budget
// (TrainOptions::offload_memory, --offload-memory), the arenas of every region of the plan's
// offload tier (optimizer offload's state and offloaded activations, either or both), and the
// copy thread that moves offloaded activations there and back while the executor computes.
// See docs/notes/offload.md and docs/notes/offload-activations.md.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "memory/adaptors.h"
#include "memory/arena.h"
#include "memory/host_resource.h"
#include "model/gpt2.h"
#include "model/offload_copier.h"
#include "plan/memory_plan.h"

namespace headroom::train {

class OffloadTier {
 public:
  // The stack host leaf -> limit(budget) -> tracking, and one arena per region of plan.offload
  // (found by name: plan::kOffload*Region), so that the tracked peak is plan.offload_bytes; a
  // copy thread when the plan offloads activations. OutOfMemory naming --offload-memory and
  // the tier's parts (optimizer state, offloaded activations) when they exceed the budget.
  // `ops`: the table whose memory the step region is (the copy thread copies through it when
  // the host cannot address that memory; model::OffloadCopier); null: host memory. `leaf`: the
  // host memory the tier's regions come from (null: plain host memory; outlives the tier).
  static Result<std::unique_ptr<OffloadTier>> create(const plan::MemoryPlan& plan, uint64_t budget,
                                                     model::OffloadCopier::Options copier = {},
                                                     const backend::Ops* ops = nullptr,
                                                     memory::MemoryResource* leaf = nullptr);
  ~OffloadTier();

  // Binds the offloaded-activations arena and the copy thread to `net` for `plan` (the current
  // plan: no offloaded block unbinds). A plan whose offloaded-activations region is laid out
  // differently (another micro-batch shape of bucketed batching) gets its buffers at its own
  // offsets inside the same memory. REQUIRES: that region is no larger than the one this tier
  // was created with (the trainer creates it with the largest shape's; re-plans never add
  // offload).
  void bind(model::Gpt2& net, const plan::MemoryPlan& plan);

  // The arena of the offload region `name` (plan::kOffload*Region), or null when the plan has
  // none. Owned by the tier.
  const memory::Arena* arena(const char* name) const;

  memory::MemoryStats stats() const { return tracking_.stats(); }
  uint64_t budget() const { return limit_.budget(); }
  // Zero without a copy thread.
  model::OffloadCopier::Stats copy_stats() const;
  // The copy thread, or null when the plan offloads no activations (profiling: its spans).
  model::OffloadCopier* copier() { return copier_ ? &*copier_ : nullptr; }

 private:
  OffloadTier(uint64_t budget, memory::MemoryResource* leaf)
      : limit_(leaf ? leaf : &host_, budget), tracking_(&limit_) {}

  memory::HostResource host_;
  memory::LimitResource limit_;
  memory::TrackingResource tracking_;
  std::vector<memory::Arena> arenas_;
  std::vector<std::string> names_;  // region name of each arena
  int activations_ = -1;            // index of the offloaded-activations arena
  // Another shape's offloaded activations, laid out over the activations arena's memory.
  std::optional<memory::BlockResource> block_;
  memory::Arena view_;
  std::optional<model::OffloadCopier> copier_;  // last: stops before the arenas go
};

}  // namespace headroom::train
