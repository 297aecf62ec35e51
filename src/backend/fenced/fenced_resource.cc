// The fenced device's memory: one mapping per block, so that mprotect can close each block
// without touching host memory that shares its pages.
#include "backend/fenced/fenced_resource.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "core/check.h"
#include "core/units.h"

namespace headroom::backend {

namespace {
size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}
size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
int prot(bool closed) { return closed ? PROT_NONE : PROT_READ | PROT_WRITE; }
}  // namespace

FencedResource::~FencedResource() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [base, len] : blocks_) munmap(reinterpret_cast<void*>(base), len);
  blocks_.clear();
}

void FencedResource::protect_all_locked(bool closed) {
  // One call per run of adjacent blocks (the kernel often maps them next to each other): each
  // call costs a TLB shootdown, so fewer calls make each op's window cheaper.
  auto protect = [&](uintptr_t begin, uintptr_t end) {
    // Failing to change a block's protection would make the fence lie: abort.
    HR_CHECK_MSG(mprotect(reinterpret_cast<void*>(begin), end - begin, prot(closed)) == 0,
                 (std::string("FencedResource: mprotect failed: ") + std::strerror(errno)).c_str());
    protect_calls_++;
  };
  uintptr_t begin = 0, end = 0;
  for (const auto& [base, len] : blocks_) {
    if (base != end) {
      if (end > begin) protect(begin, end);
      begin = base;
    }
    end = base + len;
  }
  if (end > begin) protect(begin, end);
}

void FencedResource::fence() {
  std::lock_guard<std::mutex> lock(mu_);
  const bool was = closed_locked();
  fenced_ = true;
  if (!was && closed_locked()) protect_all_locked(true);
}

void FencedResource::unfence() {
  std::lock_guard<std::mutex> lock(mu_);
  const bool was = closed_locked();
  fenced_ = false;
  if (was) protect_all_locked(false);
}

bool FencedResource::fenced() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fenced_;
}

FencedResource::Window::Window(FencedResource* r) : r_(r) {
  std::lock_guard<std::mutex> lock(r_->mu_);
  if (r_->windows_++ == 0 && r_->fenced_) r_->protect_all_locked(false);
}

FencedResource::Window::~Window() {
  std::lock_guard<std::mutex> lock(r_->mu_);
  HR_CHECK(r_->windows_ > 0);
  if (--r_->windows_ == 0 && r_->fenced_) r_->protect_all_locked(true);
}

bool FencedResource::contains(const void* p, size_t bytes) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.upper_bound(a);
  if (it == blocks_.begin()) return false;
  --it;
  return a + bytes <= it->first + it->second;
}

size_t FencedResource::live_blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return blocks_.size();
}

uint64_t FencedResource::protect_calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return protect_calls_;
}

Result<void*> FencedResource::do_allocate(size_t bytes, size_t alignment,
                                          memory::Category category) {
  if (bytes == 0) bytes = sizeof(void*);
  const size_t page = page_size();
  const size_t len = round_up(bytes, page);
  // Alignment beyond a page: map more and trim both ends to an aligned block of `len`.
  const size_t extra = alignment > page ? alignment : 0;
  std::lock_guard<std::mutex> lock(mu_);
  void* p = mmap(nullptr, len + extra, prot(closed_locked()), MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return Status::out_of_memory("fenced device: mmap of " + format_bytes(bytes) + " for " +
                                 std::string(memory::category_name(category)) +
                                 " failed: " + std::strerror(errno));
  }
  uintptr_t base = reinterpret_cast<uintptr_t>(p);
  if (extra > 0) {
    const uintptr_t aligned = (base + alignment - 1) / alignment * alignment;
    if (aligned > base) munmap(p, aligned - base);
    const uintptr_t end = base + len + extra;
    if (end > aligned + len) munmap(reinterpret_cast<void*>(aligned + len), end - aligned - len);
    base = aligned;
  }
  blocks_.emplace(base, len);
  return reinterpret_cast<void*>(base);
}

void FencedResource::do_deallocate(void* p, size_t, size_t, memory::Category) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(reinterpret_cast<uintptr_t>(p));
  HR_CHECK_MSG(it != blocks_.end(), "FencedResource: deallocate of a pointer it did not allocate");
  munmap(p, it->second);
  blocks_.erase(it);
}

}  // namespace headroom::backend
