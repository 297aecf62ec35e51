// The offload tier: its memory stack, arenas and copy thread.
#include "train/offload_tier.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "core/units.h"

namespace headroom::train {

Result<std::unique_ptr<OffloadTier>> OffloadTier::create(const plan::MemoryPlan& plan,
                                                         uint64_t budget,
                                                         model::OffloadCopier::Options copier) {
  // Only the offloaded activations: optimizer offload's regions (train/offload.h) have their own
  // stack.
  uint64_t bytes = 0;
  for (const plan::Region& r : plan.offload) {
    if (r.name == plan::kOffloadedActivationsRegion) bytes += r.layout.size;
  }
  if (bytes > budget) {
    return Status::out_of_memory(fmt::format(
        "the plan offloads {} of activations ({} blocks) but the offload tier holds {}: raise "
        "--offload-memory, or offload fewer blocks (--offload-activations auto|off)",
        format_bytes(bytes), plan.activations.offloaded.size(), format_bytes(budget)));
  }
  std::unique_ptr<OffloadTier> t(new OffloadTier(budget));
  for (size_t i = 0; i < plan.offload.size(); i++) {
    const plan::Region& r = plan.offload[i];
    if (r.name != plan::kOffloadedActivationsRegion) continue;
    Result<memory::Arena> a = memory::Arena::create(&t->tracking_, r.buffers, r.layout, r.category);
    if (!a.is_ok()) {
      return Status::out_of_memory(fmt::format("offload tier (--offload-memory {}): {}",
                                               format_bytes(budget), a.status().message()));
    }
    t->arenas_.push_back(std::move(*a));
    t->names_.push_back(r.name);
    if (!plan.activations.offloaded.empty()) t->activations_ = int(t->arenas_.size()) - 1;
  }
  if (t->activations_ >= 0) t->copier_.emplace(copier);
  return t;
}

OffloadTier::~OffloadTier() = default;

void OffloadTier::bind(model::Gpt2& net, const plan::MemoryPlan& plan) {
  if (plan.activations.offloaded.empty()) {
    net.bind_offload(nullptr, nullptr);
    return;
  }
  HR_CHECK_MSG(activations_ >= 0, "a plan offloads activations the offload tier has no room for");
  const memory::Arena& a = arenas_[size_t(activations_)];
  const auto region = std::find_if(
      plan.offload.begin(), plan.offload.end(),
      [](const plan::Region& r) { return r.name == plan::kOffloadedActivationsRegion; });
  HR_CHECK_MSG(region != plan.offload.end() && region->layout.size == a.size(),
               "the offloaded activations' region changed after the tier was made");
  net.bind_offload(&a, &*copier_);
}

model::OffloadCopier::Stats OffloadTier::copy_stats() const {
  return copier_ ? copier_->stats() : model::OffloadCopier::Stats{};
}

}  // namespace headroom::train
