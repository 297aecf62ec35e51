// Single-purpose adaptors over an upstream MemoryResource. Each holds a non-owning pointer to its
// upstream, which must outlive it.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "memory/resource.h"

namespace headroom::memory {

// Enforces a byte budget (the "device memory" on the CPU backend). Counts requested bytes (not
// rounded to pages), so the budget is what the plan predicts. The budget can be changed while
// allocations are live; lowering it below the bytes in use only makes the next requests fail.
class LimitResource final : public MemoryResource {
 public:
  LimitResource(MemoryResource* upstream, uint64_t budget) : upstream_(upstream), budget_(budget) {}

  uint64_t budget() const { return budget_.load(); }
  void set_budget(uint64_t b) { budget_.store(b); }
  uint64_t in_use() const { return in_use_.load(); }

 private:
  Result<void*> do_allocate(size_t bytes, size_t alignment, Category category) override;
  void do_deallocate(void* p, size_t bytes, size_t alignment, Category category) override;

  MemoryResource* upstream_;
  std::atomic<uint64_t> budget_;
  std::atomic<uint64_t> in_use_{0};
  std::mutex mu_;
};

struct CategoryBytes {
  uint64_t current = 0;
  uint64_t peak = 0;
};

struct MemoryStats {
  std::array<CategoryBytes, kNumCategories> by_category{};
  uint64_t current = 0;
  uint64_t peak = 0;
  uint64_t allocations = 0;  // successful allocate() calls since construction
  uint64_t failures = 0;

  // A fixed-width table: category, current, peak (categories never used are left out).
  std::string table() const;
};

// Counts bytes by category, current and peak. When the upstream fails, the returned OutOfMemory
// status is extended with this resource's table, so the message shows what was live.
class TrackingResource final : public MemoryResource {
 public:
  explicit TrackingResource(MemoryResource* upstream) : upstream_(upstream) {}

  MemoryStats stats() const;
  // Restarts peak tracking at the current values (e.g. at the start of a step).
  void reset_peak();

 private:
  Result<void*> do_allocate(size_t bytes, size_t alignment, Category category) override;
  void do_deallocate(void* p, size_t bytes, size_t alignment, Category category) override;

  MemoryResource* upstream_;
  mutable std::mutex mu_;
  MemoryStats stats_;
};

// Test helper: fails chosen allocations with OutOfMemory (the n-th call, or a set of calls),
// without touching the upstream.
class FailingResource final : public MemoryResource {
 public:
  explicit FailingResource(MemoryResource* upstream) : upstream_(upstream) {}
  // Fails the allocation whose 0-based index (counted over this resource's calls) is `n`.
  void fail_at(uint64_t n) { fail_at_ = n; }
  // Also fails every allocation whose index is in `indices` (e.g. drawn from a seed by a test).
  void fail_at(std::vector<uint64_t> indices);
  uint64_t calls() const { return calls_.load(); }
  uint64_t failures() const { return failures_.load(); }

 private:
  Result<void*> do_allocate(size_t bytes, size_t alignment, Category category) override;
  void do_deallocate(void* p, size_t bytes, size_t alignment, Category category) override;

  MemoryResource* upstream_;
  std::atomic<uint64_t> calls_{0};
  std::atomic<uint64_t> fail_at_{UINT64_MAX};
  std::atomic<uint64_t> failures_{0};
  std::mutex mu_;
  std::vector<uint64_t> fail_set_;  // sorted
};

// One fixed block (memory someone else owns) served to one allocation at a time: an arena laid
// out over memory already allocated and counted, e.g. a micro-batch shape's buffers inside the
// block planned for the largest shape. OutOfMemory for a request larger than the block, while
// the block is lent, or at an alignment its base does not have.
class BlockResource final : public MemoryResource {
 public:
  BlockResource(void* base, size_t size) : base_(base), size_(size) {}
  size_t size() const { return size_; }

 private:
  Result<void*> do_allocate(size_t bytes, size_t alignment, Category category) override;
  void do_deallocate(void* p, size_t bytes, size_t alignment, Category category) override;

  void* base_;
  size_t size_;
  bool lent_ = false;
};

}  // namespace headroom::memory
