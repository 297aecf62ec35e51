// The offset planner: turns buffer lifetimes into byte offsets inside one arena, so that buffers
// that are never live at the same time share memory. DESIGN.md "The plan": the MemoryPlan's
// offsets come from here. Design, heuristics and measurements: docs/notes/offset-planner.md.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "memory/arena.h"

namespace headroom::memory {

// One buffer to place: `bytes` of memory at an offset that is a multiple of `alignment`, live
// from the start of op `first` to the end of op `last` of a schedule (inclusive, so a buffer
// with first == last lives during one op). Two buffers conflict when their lifetimes share an
// op; conflicting buffers must not share a byte.
//
// REQUIRES: alignment is a power of two (>= 1); first <= last; the footprints below summed over
// all buffers stay below 2^63.
struct LiveRange {
  uint64_t bytes = 0;
  uint64_t alignment = kBufferAlignment;
  int32_t first = 0;
  int32_t last = 0;
};

// A buffer's footprint: its bytes rounded up to its alignment. The planner reserves footprints,
// so an arena of `size` bytes holds every buffer whatever follows it.
uint64_t footprint(const LiveRange& buffer);

struct OffsetPlan {
  std::vector<uint64_t> offsets;  // one per buffer, in input order; 0 for zero-byte buffers
  uint64_t size = 0;              // arena bytes needed: the largest offset + footprint (0 if none)
  uint64_t lower_bound = 0;       // the most footprint bytes live during one op: no plan is smaller
  std::string strategy;           // the heuristic whose placement was kept, e.g. "greedy_by_size"

  // The offsets and size as the Arena takes them (Arena::create wants 64-byte alignment, so
  // buffers meant for an arena are described with alignment kBufferAlignment or more).
  Layout layout() const { return Layout{offsets, size}; }
};

// Places every buffer and returns the smallest of several greedy placements (largest-first best
// fit in the manner of TensorFlow Lite's "greedy by size", under several orders, keeping the
// smallest as XLA does; see the note). Deterministic: the same input gives the same plan.
// Runs on metadata only, in O(n log n) memory; time is close to O(n log n) on schedules whose
// free memory has few holes (16 ms for a 9,348-buffer transformer step on a 2-core VM) and
// O(n^2) with a small constant when it is shredded (0.7 s for 10,000 random lifetimes); see
// bench/offset_planner_bench.cc.
// Thread-safe (no shared state). Aborts (HR_CHECK) if a buffer breaks LiveRange's REQUIRES.
OffsetPlan plan_offsets(std::span<const LiveRange> buffers);

// Places the buffers one at a time in `order` (a permutation of 0..n-1), each at the best-fitting
// gap among the already placed buffers it conflicts with, or above them all if no gap fits.
// This is the step that plan_offsets repeats for each heuristic order; callers who know a good
// order for their schedule can use it directly. `strategy` is copied into the plan.
OffsetPlan plan_offsets_in_order(std::span<const LiveRange> buffers,
                                 std::span<const uint32_t> order, std::string strategy = "custom");

// The most footprint bytes live during one op (OffsetPlan::lower_bound). O(n log n).
uint64_t live_bytes_lower_bound(std::span<const LiveRange> buffers);

// Checks a plan against its buffers: one offset per buffer, each a multiple of its buffer's
// alignment, offset + bytes <= size, and no two conflicting buffers sharing a byte. Returns
// InvalidArgument naming the first problem found; for a collision it names both buffers (index,
// byte range, ops) and an op at which both are live. O(n log n); used by tests and as a debug
// check before building an arena.
Status verify_offsets(std::span<const LiveRange> buffers, const OffsetPlan& plan);

}  // namespace headroom::memory
