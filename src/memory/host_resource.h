// The host leaf: page-aligned anonymous mappings for large blocks (with transparent huge pages
// requested), aligned_alloc for small ones. Optionally touches new memory once, so the page-fault
// cost (about 11 us per 4 KiB page on the development VM) is paid at start-up, not inside a step.
#pragma once

#include <new>

#include "memory/resource.h"

namespace headroom::memory {

struct HostResourceOptions {
  size_t mmap_threshold = 1 << 20;  // blocks of at least this size are mmap'ed
  bool huge_pages = true;           // madvise(MADV_HUGEPAGE) on mmap'ed blocks
  bool prefault = true;             // write every page of mmap'ed blocks once on allocation
};

class HostResource final : public MemoryResource {
 public:
  explicit HostResource(HostResourceOptions options = {}) : options_(options) {}

 private:
  Result<void*> do_allocate(size_t bytes, size_t alignment, Category category) override;
  void do_deallocate(void* p, size_t bytes, size_t alignment, Category category) override;

  HostResourceOptions options_;
};

// A standard allocator over HostResource with its defaults, for vectors that should live in memory
// like the arenas' (benchmarks and calibration time kernels on it: large operands on 4 KiB pages
// pay TLB misses a training step does not). Throws std::bad_alloc when the resource fails.
template <typename T>
struct HostAllocator {
  using value_type = T;
  HostAllocator() = default;
  template <typename U>
  HostAllocator(const HostAllocator<U>&) {}  // NOLINT: converting, as allocators are
  T* allocate(size_t n) {
    HostResource r;
    Result<void*> p = r.allocate(n * sizeof(T));
    if (!p.is_ok()) throw std::bad_alloc();
    return static_cast<T*>(p.value());
  }
  void deallocate(T* p, size_t n) {
    HostResource r;
    r.deallocate(p, n * sizeof(T));
  }
  template <typename U>
  bool operator==(const HostAllocator<U>&) const {
    return true;
  }
};

}  // namespace headroom::memory
