// Sharding arithmetic; kept in one place so that every stage, the reducer and the planner agree
// on who owns which float.
#include "dist/shard.h"

#include <algorithm>

#include "core/check.h"

namespace headroom::dist {
namespace {
int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
}  // namespace

int64_t shard_floats(int64_t n, int ranks) {
  HR_CHECK(n >= 0 && ranks >= 1);
  return round_up((n + ranks - 1) / ranks, kShardAlign);
}

Range shard_range(int64_t n, int rank, int ranks) {
  HR_CHECK(rank >= 0 && rank < ranks);
  const int64_t s = shard_floats(n, ranks);
  return {std::min(n, rank * s), std::min(n, (rank + 1) * s)};
}

std::vector<int64_t> shard_counts(int64_t n, int ranks) {
  std::vector<int64_t> counts(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) counts[size_t(r)] = shard_range(n, r, ranks).size();
  return counts;
}

ShardLayout::ShardLayout(std::vector<Range> units, int rank, int ranks)
    : units_(std::move(units)), rank_(rank), ranks_(ranks) {
  HR_CHECK(ranks >= 1 && rank >= 0 && rank < ranks);
  for (size_t u = 0; u < units_.size(); ++u) {
    HR_CHECK_MSG(units_[u].begin >= 0 && units_[u].end >= units_[u].begin,
                 "ShardLayout: a unit has a negative size");
    HR_CHECK_MSG(u == 0 || units_[u].begin >= units_[u - 1].end,
                 "ShardLayout: units must be sorted and disjoint");
  }
  local_offsets_.resize(units_.size());
  for (int r = 0; r < ranks_; ++r) {
    int64_t off = 0;
    for (size_t u = 0; u < units_.size(); ++u) {
      if (r == rank_) local_offsets_[u] = off;
      off = round_up(off + piece(u, r).size(), kShardAlign);
    }
    if (r == rank_) local_floats_ = off;
    max_local_floats_ = std::max(max_local_floats_, off);
  }
}

ShardLayout ShardLayout::flat(int64_t n, int rank, int ranks) {
  return ShardLayout({Range{0, n}}, rank, ranks);
}

Range ShardLayout::piece(size_t unit, int rank) const {
  const Range& u = units_[unit];
  const Range p = shard_range(u.size(), rank, ranks_);
  return {u.begin + p.begin, u.begin + p.end};
}

std::vector<int64_t> ShardLayout::counts(size_t unit) const {
  return shard_counts(units_[unit].size(), ranks_);
}

}  // namespace headroom::dist
