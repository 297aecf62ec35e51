// Host memory: mmap for large blocks (returned to the kernel on free, which is what we want for
// arenas that live for the whole run), aligned_alloc for small ones.
#include "memory/host_resource.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/units.h"

namespace headroom::memory {

namespace {
size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}
size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
}  // namespace

Result<void*> HostResource::do_allocate(size_t bytes, size_t alignment, Category category) {
  if (bytes == 0) bytes = sizeof(void*);
  if (bytes >= options_.mmap_threshold && alignment <= page_size()) {
    size_t len = round_up(bytes, page_size());
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return Status::out_of_memory("host mmap of " + format_bytes(bytes) + " for " +
                                   std::string(category_name(category)) +
                                   " failed: " + std::strerror(errno));
    }
#ifdef MADV_HUGEPAGE
    if (options_.huge_pages) madvise(p, len, MADV_HUGEPAGE);
#endif
    if (options_.prefault) {
      // Touch one byte per page so first-touch faults happen now, not inside a training step.
      auto* c = static_cast<volatile char*>(p);
      for (size_t off = 0; off < len; off += page_size()) c[off] = 0;
    }
    return p;
  }
  size_t a = alignment < sizeof(void*) ? sizeof(void*) : alignment;
  void* p = std::aligned_alloc(a, round_up(bytes, a));
  if (!p) {
    return Status::out_of_memory("host allocation of " + format_bytes(bytes) + " for " +
                                 std::string(category_name(category)) + " failed");
  }
  return p;
}

void HostResource::do_deallocate(void* p, size_t bytes, size_t alignment, Category) {
  if (!p) return;
  if (bytes == 0) bytes = sizeof(void*);
  if (bytes >= options_.mmap_threshold && alignment <= page_size()) {
    munmap(p, round_up(bytes, page_size()));
  } else {
    std::free(p);
  }
}

}  // namespace headroom::memory
