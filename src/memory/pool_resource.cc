// The caching pool: best fit over free blocks kept by (category, size), neighbours merged on free.
#include "memory/pool_resource.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "core/units.h"

namespace headroom::memory {

namespace {
constexpr size_t kGranule = 64;

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// The size class of a request (see the header).
size_t class_size(size_t bytes, size_t small_limit) {
  if (bytes < small_limit) {
    size_t s = kGranule;
    while (s < bytes) s <<= 1;
    return s;
  }
  return round_up(bytes, kGranule);
}

char* align_up(char* p, size_t a) {
  auto u = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<char*>((u + a - 1) / a * a);
}
}  // namespace

std::string PoolStats::describe() const {
  return fmt::format("pool: reserved {}, in use {}, free {} (largest block {}) in {} chunk{}",
                     format_bytes(reserved), format_bytes(in_use), format_bytes(free()),
                     format_bytes(largest_free), chunks, chunks == 1 ? "" : "s");
}

PoolResource::~PoolResource() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Chunk& c : chunks_) {
    if (c.live) upstream_->deallocate(c.base, c.size, c.alignment, c.category);
  }
}

void PoolResource::insert_free(char* p, const Block& b) {
  free_.emplace(FreeKey{chunks_[b.chunk].category, b.size}, p);
}

void PoolResource::erase_free(char* p, const Block& b) {
  auto [lo, hi] = free_.equal_range(FreeKey{chunks_[b.chunk].category, b.size});
  for (auto it = lo; it != hi; ++it) {
    if (it->second == p) {
      free_.erase(it);
      return;
    }
  }
  HR_CHECK_MSG(false, "pool: a free block is missing from the free index");
}

// Carves [p, p + bytes) out of the free block at `start` (p is inside it, suitably aligned);
// what is left before and after stays free.
void* PoolResource::take(char* start, size_t bytes, size_t alignment) {
  char* p = align_up(start, alignment);
  const Block b = blocks_.at(start);
  erase_free(start, b);
  const size_t lead = size_t(p - start);
  const size_t tail = b.size - lead - bytes;
  if (lead) {
    blocks_[start] = {lead, b.chunk, true};
    insert_free(start, blocks_[start]);
  }
  blocks_[p] = {bytes, b.chunk, false};
  if (tail) {
    blocks_[p + bytes] = {tail, b.chunk, true};
    insert_free(p + bytes, blocks_[p + bytes]);
  }
  stats_.in_use += bytes;
  return p;
}

Result<void*> PoolResource::do_allocate(size_t bytes, size_t alignment, Category category) {
  const size_t size = class_size(bytes, options_.small_limit);
  const size_t align = std::max(alignment, kGranule);
  std::lock_guard<std::mutex> lock(mu_);
  // Best fit: the smallest free block of this category that holds the request once aligned.
  for (auto it = free_.lower_bound(FreeKey{category, size});
       it != free_.end() && it->first.first == category; ++it) {
    char* start = it->second;
    const Block& b = blocks_.at(start);
    if (align_up(start, align) + size <= start + b.size) {
      stats_.hits++;
      const size_t chunk = b.chunk;
      void* p = take(start, size, align);
      if (observer_)
        notify(PoolEvent::Kind::kAcquire, static_cast<char*>(p), size, chunk, category);
      return p;
    }
  }
  // A miss: a new chunk (a slab for small classes, the exact size for large ones).
  const bool small = size < options_.small_limit;
  const size_t chunk_size = small ? std::max(options_.small_chunk, size) : size;
  const size_t chunk_align = small ? std::max<size_t>(align, 4096) : align;
  Result<void*> r = upstream_->allocate(chunk_size, chunk_align, category);
  if (!r.is_ok() && r.status().code() == StatusCode::kOutOfMemory && release_unused_locked() > 0) {
    r = upstream_->allocate(chunk_size, chunk_align, category);
  }
  if (!r.is_ok()) {
    if (r.status().code() != StatusCode::kOutOfMemory) return r;
    PoolStats s = stats_;
    s.largest_free = 0;
    for (const auto& [key, p] : free_)
      s.largest_free = std::max<uint64_t>(s.largest_free, key.second);
    return Status::out_of_memory(r.status().message() + "\n" + s.describe());
  }
  Chunk c{static_cast<char*>(*r), chunk_size, chunk_align, category, true};
  size_t id = 0;
  while (id < chunks_.size() && chunks_[id].live) id++;
  if (id == chunks_.size()) {
    chunks_.push_back(c);
  } else {
    chunks_[id] = c;
  }
  stats_.reserved += chunk_size;
  stats_.chunks++;
  stats_.upstream_allocations++;
  blocks_[c.base] = {chunk_size, id, true};
  insert_free(c.base, blocks_[c.base]);
  if (observer_) notify(PoolEvent::Kind::kReserve, c.base, chunk_size, id, category);
  void* p = take(c.base, size, align);
  if (observer_) notify(PoolEvent::Kind::kAcquire, static_cast<char*>(p), size, id, category);
  return p;
}

void PoolResource::do_deallocate(void* ptr, size_t, size_t, Category) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(static_cast<char*>(ptr));
  HR_CHECK_MSG(it != blocks_.end() && !it->second.free,
               "pool: deallocate of a pointer the pool did not hand out");
  stats_.in_use -= it->second.size;
  it->second.free = true;
  if (observer_) {
    notify(PoolEvent::Kind::kRelease, it->first, it->second.size, it->second.chunk,
           chunks_[it->second.chunk].category);
  }
  auto adjacent = [](const auto& a, const auto& b) {
    return a->second.chunk == b->second.chunk && a->first + a->second.size == b->first;
  };
  auto next = std::next(it);
  if (next != blocks_.end() && next->second.free && adjacent(it, next)) {
    erase_free(next->first, next->second);
    it->second.size += next->second.size;
    blocks_.erase(next);
  }
  if (it != blocks_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.free && adjacent(prev, it)) {
      erase_free(prev->first, prev->second);
      prev->second.size += it->second.size;
      blocks_.erase(it);
      it = prev;
    }
  }
  insert_free(it->first, it->second);
}

uint64_t PoolResource::release_unused_locked() {
  uint64_t freed = 0;
  for (size_t id = 0; id < chunks_.size(); id++) {
    Chunk& c = chunks_[id];
    if (!c.live) continue;
    auto it = blocks_.find(c.base);
    if (it == blocks_.end() || !it->second.free || it->second.size != c.size) continue;
    erase_free(it->first, it->second);
    blocks_.erase(it);
    // The event before the chunk leaves, so its offset still counts the chunks before it.
    stats_.reserved -= c.size;
    stats_.chunks--;
    if (observer_) notify(PoolEvent::Kind::kUnreserve, c.base, c.size, id, c.category);
    upstream_->deallocate(c.base, c.size, c.alignment, c.category);
    c.live = false;
    freed += c.size;
  }
  return freed;
}

void PoolResource::notify(PoolEvent::Kind kind, const char* p, size_t bytes, size_t chunk,
                          Category category) {
  PoolEvent e;
  e.kind = kind;
  e.bytes = bytes;
  e.category = category;
  for (size_t id = 0; id < chunk; id++) {
    if (chunks_[id].live) e.offset += chunks_[id].size;
  }
  e.offset += uint64_t(p - chunks_[chunk].base);
  e.after = stats_;
  observer_(e);
}

void PoolResource::set_observer(std::function<void(const PoolEvent&)> observer) {
  std::lock_guard<std::mutex> lock(mu_);
  observer_ = std::move(observer);
}

uint64_t PoolResource::release_unused() {
  std::lock_guard<std::mutex> lock(mu_);
  return release_unused_locked();
}

PoolStats PoolResource::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  PoolStats s = stats_;
  s.largest_free = 0;
  for (const auto& [key, p] : free_)
    s.largest_free = std::max<uint64_t>(s.largest_free, key.second);
  return s;
}

}  // namespace headroom::memory
