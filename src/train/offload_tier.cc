// The offload tier: its memory stack, arenas and copy thread.
#include "train/offload_tier.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "core/units.h"

namespace headroom::train {

Result<std::unique_ptr<OffloadTier>> OffloadTier::create(const plan::MemoryPlan& plan,
                                                         uint64_t budget,
                                                         model::OffloadCopier::Options copier,
                                                         const backend::Ops* ops,
                                                         memory::MemoryResource* leaf) {
  // One budget for both kinds: the optimizer state lives through the run, a micro-batch's
  // offloaded activations through its forward and backward, so at the start of a backward the
  // tier holds both (Note [Optimizer offload], "Both kinds").
  if (plan.offload_bytes > budget) {
    // What would make it fit, for each part the plan has.
    std::vector<std::string> fixes = {"raise --offload-memory"};
    if (plan::offloaded_optimizer_bytes(plan) > 0) {
      fixes.push_back("shard the optimizer state over more ranks (--zero 1 under mpirun)");
      fixes.push_back(
          "keep the optimizer state on the device (--offload-optimizer off) under a larger "
          "--device-memory");
    }
    if (plan::offloaded_activation_bytes(plan) > 0) {
      fixes.push_back("offload fewer blocks' activations (--offload-activations auto|off)");
    }
    std::string advice;
    for (size_t i = 0; i < fixes.size(); i++) {
      advice += (i == 0 ? "" : i + 1 == fixes.size() ? ", or " : ", ") + fixes[i];
    }
    return Status::out_of_memory(fmt::format(
        "the offload tier (host memory) needs {} ({}) but its budget is {}: {}",
        format_bytes(plan.offload_bytes), plan::offload_parts(plan), format_bytes(budget), advice));
  }
  std::unique_ptr<OffloadTier> t(new OffloadTier(budget, leaf));
  for (const plan::Region& r : plan.offload) {
    Result<memory::Arena> a = memory::Arena::create(&t->tracking_, r.buffers, r.layout, r.category);
    if (!a.is_ok()) {
      return Status::out_of_memory(fmt::format("offload tier (--offload-memory {}), region {}: {}",
                                               format_bytes(budget), r.name, a.status().message()));
    }
    t->arenas_.push_back(std::move(*a));
    t->names_.push_back(r.name);
    if (r.name == plan::kOffloadedActivationsRegion && !plan.activations.offloaded.empty()) {
      t->activations_ = int(t->arenas_.size()) - 1;
    }
  }
  if (t->activations_ >= 0) {
    const memory::Arena& a = t->arenas_[size_t(t->activations_)];
    t->block_.emplace(a.base(), a.size());
    t->copier_.emplace(copier, ops);
  }
  return t;
}

OffloadTier::~OffloadTier() = default;

const memory::Arena* OffloadTier::arena(const char* name) const {
  for (size_t i = 0; i < names_.size(); i++) {
    if (names_[i] == name) return &arenas_[i];
  }
  return nullptr;
}

void OffloadTier::bind(model::Gpt2& net, const plan::MemoryPlan& plan) {
  if (plan.activations.offloaded.empty()) {
    net.bind_offload(nullptr, nullptr);
    return;
  }
  HR_CHECK_MSG(activations_ >= 0, "a plan offloads activations the offload tier has no room for");
  const memory::Arena& a = arenas_[size_t(activations_)];
  const plan::Region* region = plan::offload_region(plan, plan::kOffloadedActivationsRegion);
  HR_CHECK_MSG(region != nullptr && region->layout.size <= a.size(),
               "a plan's offloaded activations need more than the offload tier was made with");
  if (region->layout.size == a.size() && region->layout.offsets == a.layout().offsets) {
    net.bind_offload(&a, &*copier_);
    return;
  }
  // Another shape: its buffers at its own offsets in the same memory (the copy thread is idle
  // between micro-batches, so nothing still reads the previous view).
  if (view_.size() == 0 || view_.layout().offsets != region->layout.offsets ||
      view_.size() != region->layout.size) {
    view_ = memory::Arena();
    Result<memory::Arena> v =
        memory::Arena::create(&*block_, region->buffers, region->layout, region->category);
    HR_CHECK_MSG(v.is_ok(), v.status().to_string().c_str());
    view_ = std::move(*v);
  }
  net.bind_offload(&view_, &*copier_);
}

model::OffloadCopier::Stats OffloadTier::copy_stats() const {
  return copier_ ? copier_->stats() : model::OffloadCopier::Stats{};
}

}  // namespace headroom::train
