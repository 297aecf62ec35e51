// How a flat fp32 buffer is split across ranks for ZeRO (see docs/notes/zero.md): contiguous,
// 16-float-aligned pieces, one per rank, the last ones shorter or empty.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace headroom::dist {

// Piece sizes are multiples of this many floats (64 bytes: one cache line, one AVX-512 vector),
// so every piece starts on the same vector boundary as in the unsharded buffer and the AdamW
// kernel vectorises a piece exactly as it vectorises the whole buffer (bit-identical updates).
inline constexpr int64_t kShardAlign = 16;

// A half-open range [begin, end) of floats.
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  bool operator==(const Range&) const = default;
};

// Floats in each rank's piece of an n-float buffer: ceil(n / ranks) rounded up to kShardAlign.
// REQUIRES: n >= 0, ranks >= 1.
int64_t shard_floats(int64_t n, int ranks);
// Rank r's piece of [0, n): [min(n, r*s), min(n, (r+1)*s)) with s = shard_floats(n, ranks).
// The pieces of all ranks tile [0, n) in rank order; trailing ones may be shorter or empty.
Range shard_range(int64_t n, int rank, int ranks);
// Piece sizes of all ranks (the `counts` of Communicator::reduce_scatter/all_gather).
std::vector<int64_t> shard_counts(int64_t n, int ranks);

// A flat buffer split into units (contiguous, disjoint, sorted ranges that need not cover it),
// each unit split across the ranks by shard_range. ZeRO-1/2 use one unit, the whole buffer;
// ZeRO-3 uses one unit per layer range so that a layer is gathered by one balanced collective.
//
// This rank's pieces are stored back to back in a local shard buffer, each at a kShardAlign-
// aligned local offset. Immutable after construction; thread-safe to read.
class ShardLayout {
 public:
  // REQUIRES: units sorted, disjoint, non-negative; 0 <= rank < ranks.
  ShardLayout(std::vector<Range> units, int rank, int ranks);
  // The whole buffer [0, n) as one unit.
  static ShardLayout flat(int64_t n, int rank, int ranks);

  int rank() const { return rank_; }
  int ranks() const { return ranks_; }
  const std::vector<Range>& units() const { return units_; }

  // Rank r's piece of unit u, in the flat buffer's coordinates.
  Range piece(size_t unit, int rank) const;
  Range piece(size_t unit) const { return piece(unit, rank_); }
  // The sizes of every rank's piece of unit u (rank order; they sum to the unit's size).
  std::vector<int64_t> counts(size_t unit) const;
  // Where this rank's piece of unit u starts in its local shard buffer.
  int64_t local_offset(size_t unit) const { return local_offsets_[unit]; }
  // Floats of this rank's local shard buffer (pieces plus alignment gaps).
  int64_t local_floats() const { return local_floats_; }
  // The largest local_floats() of any rank (what a per-rank plan must reserve).
  int64_t max_local_floats() const { return max_local_floats_; }

 private:
  std::vector<Range> units_;
  int rank_;
  int ranks_;
  std::vector<int64_t> local_offsets_;
  int64_t local_floats_ = 0;
  int64_t max_local_floats_ = 0;
};

}  // namespace headroom::dist
