// Memory resources (RMM style): one small interface, a leaf that owns memory, and adaptors that
// each do one thing (limit, tracking, failure injection) stacked on it like a sentence:
//   TrackingResource(LimitResource(HostResource)).
// Thread safety: every resource here is safe to call from several threads.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace headroom::memory {

// What a buffer is for; the startup table and out-of-memory reports group bytes by it.
enum class Category : uint8_t {
  kWeights,
  kGrads,
  kOptimizer,
  kMaster,
  kActivations,
  kRecompute,
  kWorkspace,
  kLogits,
  kComm,
  kStaging,
  kOffload,
  kKvCache,  // generation's cached keys and values
  kTeacher,  // distillation's forward-only teacher: its weights and working set
  kOther,
  kCount,
};
constexpr size_t kNumCategories = static_cast<size_t>(Category::kCount);
std::string_view category_name(Category c);

constexpr size_t kDefaultAlignment = 64;

class MemoryResource {
 public:
  virtual ~MemoryResource() = default;

  // Returns `bytes` bytes aligned to `alignment` (a power of two), or OutOfMemory.
  // `bytes` == 0 returns a unique non-null pointer-sized allocation.
  [[nodiscard]] Result<void*> allocate(size_t bytes, size_t alignment = kDefaultAlignment,
                                       Category category = Category::kOther) {
    return do_allocate(bytes, alignment, category);
  }
  // REQUIRES: p came from allocate() on this resource with the same bytes, alignment, category.
  void deallocate(void* p, size_t bytes, size_t alignment = kDefaultAlignment,
                  Category category = Category::kOther) {
    do_deallocate(p, bytes, alignment, category);
  }

 protected:
  virtual Result<void*> do_allocate(size_t bytes, size_t alignment, Category category) = 0;
  virtual void do_deallocate(void* p, size_t bytes, size_t alignment, Category category) = 0;
};

}  // namespace headroom::memory
