// The host leaf: page-aligned anonymous mappings for large blocks (with transparent huge pages
// requested), aligned_alloc for small ones. Optionally touches new memory once, so the page-fault
// cost (about 11 us per 4 KiB page on the development VM) is paid at start-up, not inside a step.
#pragma once

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

}  // namespace headroom::memory
