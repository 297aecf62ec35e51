// The pool: serves what varies at run time (DESIGN.md "Memory"). It keeps freed blocks reserved
// for reuse, so re-acquiring a block of the same size costs a map lookup instead of an upstream
// allocation and its first-touch page faults (~11 us per 4 KiB page on the development VM), and
// it hands reserved-but-free memory back on request (release_unused) when the budget shrinks.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "memory/resource.h"

namespace headroom::memory {

struct PoolStats {
  uint64_t reserved = 0;              // bytes held from the upstream (chunks)
  uint64_t in_use = 0;                // bytes of the blocks handed out (rounded sizes)
  uint64_t largest_free = 0;          // the largest free block (ignoring alignment)
  uint64_t chunks = 0;                // upstream allocations held
  uint64_t upstream_allocations = 0;  // chunks ever allocated (a miss each)
  uint64_t hits = 0;                  // requests served from reserved memory

  uint64_t free() const { return reserved - in_use; }
  // Share of the reserved bytes not in use: 0 when every reserved byte serves a request.
  double fragmentation() const {
    return reserved ? double(reserved - in_use) / double(reserved) : 0.0;
  }
  // "reserved 12.0 MiB, in use 8.00 MiB, free 4.00 MiB (largest 4.00 MiB) in 2 chunks".
  std::string describe() const;
};

// What the pool did, for an observer (the profiler's event stream, docs/notes/report.md).
struct PoolEvent {
  enum class Kind : uint8_t {
    kAcquire,    // a block handed out (bytes: its rounded size)
    kRelease,    // a block given back (it stays reserved)
    kReserve,    // a chunk taken from the upstream
    kUnreserve,  // a chunk handed back to the upstream
  };
  Kind kind = Kind::kAcquire;
  uint64_t bytes = 0;
  // Where the block or chunk lies in the pool's reserved bytes: the sizes of the live chunks
  // before its chunk plus its offset inside the chunk. (Chunks come and go, so an offset is a
  // position at the time of the event, not an address.)
  uint64_t offset = 0;
  Category category = Category::kOther;
  PoolStats after;  // the pool's figures after the event (largest_free not computed: 0)
};

// Best-fit with coalescing over chunks from the upstream, in size classes:
//  - a request below options.small_limit is rounded up to a power of two (at least 64 bytes) and
//    carved from options.small_chunk slabs, so small blocks are interchangeable;
//  - a larger request is rounded up to 64 bytes and, on a miss, gets a chunk of exactly that
//    size, so a run that reuses one block holds exactly what its plan predicts.
// A freed block merges with its free neighbours in the same chunk. Free blocks serve only
// requests of their own category (so the tracking below attributes bytes truthfully).
// When the upstream fails, the pool releases its unused chunks and tries once more.
// Thread safety: safe to call from several threads (one mutex).
struct PoolOptions {
  size_t small_limit = size_t(1) << 20;  // requests below this use size classes; 0: none do
  size_t small_chunk = size_t(2) << 20;  // the slab that small classes are carved from
};

class PoolResource final : public MemoryResource {
 public:
  explicit PoolResource(MemoryResource* upstream, PoolOptions options = {})
      : upstream_(upstream), options_(options) {}
  // Returns every chunk to the upstream. REQUIRES: every block has been deallocated.
  ~PoolResource() override;
  PoolResource(const PoolResource&) = delete;
  PoolResource& operator=(const PoolResource&) = delete;

  PoolStats stats() const;
  // Calls `observer` for every block acquired or released and every chunk reserved or handed back,
  // on the calling thread while the pool's lock is held (so events arrive in the pool's order; the
  // observer must not call back into the pool). Empty: none (the default; one test per call).
  void set_observer(std::function<void(const PoolEvent&)> observer);
  // Hands every chunk that holds no block in use back to the upstream; returns the bytes freed.
  uint64_t release_unused();

 private:
  struct Block {
    size_t size = 0;
    size_t chunk = 0;  // index into chunks_
    bool free = true;
  };
  struct Chunk {
    char* base = nullptr;
    size_t size = 0;
    size_t alignment = 0;
    Category category = Category::kOther;
    bool live = false;  // false once returned to the upstream
  };
  using FreeKey = std::pair<Category, size_t>;  // best fit: by category, then size

  Result<void*> do_allocate(size_t bytes, size_t alignment, Category category) override;
  void do_deallocate(void* p, size_t bytes, size_t alignment, Category category) override;

  // REQUIRES: mu_ held.
  void* take(char* start, size_t bytes, size_t alignment);
  void insert_free(char* p, const Block& b);
  void erase_free(char* p, const Block& b);
  uint64_t release_unused_locked();
  void notify(PoolEvent::Kind kind, const char* p, size_t bytes, size_t chunk, Category category);

  MemoryResource* upstream_;
  PoolOptions options_;
  mutable std::mutex mu_;
  std::map<char*, Block> blocks_;  // every block of every live chunk, by address
  std::multimap<FreeKey, char*> free_;
  std::vector<Chunk> chunks_;
  PoolStats stats_;
  std::function<void(const PoolEvent&)> observer_;
};

}  // namespace headroom::memory
