// Limit, tracking and failure-injection adaptors.
#include "memory/adaptors.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>

#include "core/check.h"
#include "core/units.h"

namespace headroom::memory {

std::string_view category_name(Category c) {
  switch (c) {
    case Category::kWeights:
      return "weights";
    case Category::kGrads:
      return "grads";
    case Category::kOptimizer:
      return "optimizer";
    case Category::kMaster:
      return "master";
    case Category::kActivations:
      return "activations";
    case Category::kRecompute:
      return "recompute";
    case Category::kWorkspace:
      return "workspace";
    case Category::kLogits:
      return "logits";
    case Category::kComm:
      return "comm";
    case Category::kStaging:
      return "staging";
    case Category::kOffload:
      return "offload";
    case Category::kKvCache:
      return "kv_cache";
    case Category::kTeacher:
      return "teacher";
    case Category::kOther:
      return "other";
    case Category::kCount:
      break;
  }
  return "?";
}

Result<void*> LimitResource::do_allocate(size_t bytes, size_t alignment, Category category) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t used = in_use_.load();
    uint64_t budget = budget_.load();
    if (used + bytes > budget) {
      return Status::out_of_memory(
          fmt::format("cannot allocate {} for {}: {} of the {} device budget in use, {} free",
                      format_bytes(bytes), category_name(category), format_bytes(used),
                      format_bytes(budget), format_bytes(budget > used ? budget - used : 0)));
    }
    in_use_.fetch_add(bytes);
  }
  Result<void*> r = upstream_->allocate(bytes, alignment, category);
  if (!r.is_ok()) in_use_.fetch_sub(bytes);
  return r;
}

void LimitResource::do_deallocate(void* p, size_t bytes, size_t alignment, Category category) {
  upstream_->deallocate(p, bytes, alignment, category);
  in_use_.fetch_sub(bytes);
}

std::string MemoryStats::table() const {
  std::string s = fmt::format("  {:<12} {:>12} {:>12}\n", "category", "in use", "peak");
  for (size_t i = 0; i < kNumCategories; i++) {
    const CategoryBytes& c = by_category[i];
    if (c.peak == 0) continue;
    s += fmt::format("  {:<12} {:>12} {:>12}\n", category_name(static_cast<Category>(i)),
                     format_bytes(c.current), format_bytes(c.peak));
  }
  s += fmt::format("  {:<12} {:>12} {:>12}\n", "total", format_bytes(current), format_bytes(peak));
  return s;
}

Result<void*> TrackingResource::do_allocate(size_t bytes, size_t alignment, Category category) {
  Result<void*> r = upstream_->allocate(bytes, alignment, category);
  std::lock_guard<std::mutex> lock(mu_);
  if (!r.is_ok()) {
    stats_.failures++;
    if (r.status().code() == StatusCode::kOutOfMemory) {
      return Status::out_of_memory(r.status().message() + "\nlive device memory by category:\n" +
                                   stats_.table());
    }
    return r;
  }
  CategoryBytes& c = stats_.by_category[static_cast<size_t>(category)];
  c.current += bytes;
  if (c.current > c.peak) c.peak = c.current;
  stats_.current += bytes;
  if (stats_.current > stats_.peak) stats_.peak = stats_.current;
  stats_.allocations++;
  return r;
}

void TrackingResource::do_deallocate(void* p, size_t bytes, size_t alignment, Category category) {
  upstream_->deallocate(p, bytes, alignment, category);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.by_category[static_cast<size_t>(category)].current -= bytes;
  stats_.current -= bytes;
}

MemoryStats TrackingResource::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void TrackingResource::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak = stats_.current;
  for (CategoryBytes& c : stats_.by_category) c.peak = c.current;
}

void FailingResource::fail_at(std::vector<uint64_t> indices) {
  std::sort(indices.begin(), indices.end());
  std::lock_guard<std::mutex> lock(mu_);
  fail_set_ = std::move(indices);
}

Result<void*> FailingResource::do_allocate(size_t bytes, size_t alignment, Category category) {
  uint64_t n = calls_.fetch_add(1);
  bool in_set = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_set = std::binary_search(fail_set_.begin(), fail_set_.end(), n);
  }
  if (n == fail_at_.load() || in_set) {
    failures_.fetch_add(1);
    return Status::out_of_memory(fmt::format("injected failure of allocation #{} ({} for {})", n,
                                             format_bytes(bytes), category_name(category)));
  }
  return upstream_->allocate(bytes, alignment, category);
}

void FailingResource::do_deallocate(void* p, size_t bytes, size_t alignment, Category category) {
  upstream_->deallocate(p, bytes, alignment, category);
}

Result<void*> BlockResource::do_allocate(size_t bytes, size_t alignment, Category category) {
  if (lent_) {
    return Status::out_of_memory(fmt::format("the {} block is already lent ({} for {})",
                                             format_bytes(size_), format_bytes(bytes),
                                             category_name(category)));
  }
  if (bytes > size_ || reinterpret_cast<uintptr_t>(base_) % alignment != 0) {
    return Status::out_of_memory(fmt::format("{} (alignment {}) for {} does not fit the {} block",
                                             format_bytes(bytes), alignment,
                                             category_name(category), format_bytes(size_)));
  }
  lent_ = true;
  return base_;
}

void BlockResource::do_deallocate(void* p, size_t, size_t, Category) {
  HR_CHECK_MSG(lent_ && p == base_, "BlockResource: returned memory it did not lend");
  lent_ = false;
}

}  // namespace headroom::memory
