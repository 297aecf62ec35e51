// Sharding arithmetic: pieces tile the buffer in rank order, 16-float aligned, last ones short.
#include <gtest/gtest.h>

#include "dist/shard.h"

namespace headroom::dist {
namespace {

TEST(Shard, PiecesTileTheBufferAligned) {
  for (int64_t n : {0, 1, 15, 16, 17, 20, 1000, 4096, 123457}) {
    for (int R : {1, 2, 3, 4, 7, 64}) {
      int64_t at = 0;
      for (int r = 0; r < R; ++r) {
        const Range p = shard_range(n, r, R);
        EXPECT_EQ(p.begin, at) << n << " " << R;
        EXPECT_GE(p.size(), 0);
        EXPECT_LE(p.size(), shard_floats(n, R));
        if (p.end < n) {
          EXPECT_EQ(p.end % kShardAlign, 0);
        }
        at = p.end;
      }
      EXPECT_EQ(at, n);
      EXPECT_EQ(shard_floats(n, R) % kShardAlign, 0);
      EXPECT_LT(shard_floats(n, R) * (R - 1), n + kShardAlign * R) << "pieces too large";
    }
  }
  // 20 floats on 4 ranks: 16, 4, then nothing.
  EXPECT_EQ(shard_range(20, 0, 4), (Range{0, 16}));
  EXPECT_EQ(shard_range(20, 1, 4), (Range{16, 20}));
  EXPECT_EQ(shard_range(20, 2, 4), (Range{20, 20}));
  EXPECT_EQ(shard_counts(20, 4), (std::vector<int64_t>{16, 4, 0, 0}));
  // Beyond 32-bit element counts.
  const int64_t big = (int64_t(1) << 33) + 5;
  EXPECT_EQ(shard_range(big, 1, 2).end, big);
  EXPECT_EQ(shard_range(big, 0, 2).end, (int64_t(1) << 32) + 16);
}

TEST(Shard, LayoutPlacesPiecesAlignedAndCountsTheLargestRank) {
  // Three units, with a gap between the second and third.
  const std::vector<Range> units = {{0, 100}, {112, 120}, {128, 1128}};
  int64_t max_local = 0;
  for (int r = 0; r < 3; ++r) {
    ShardLayout l(units, r, 3);
    int64_t at = 0;
    for (size_t u = 0; u < units.size(); ++u) {
      EXPECT_EQ(l.local_offset(u) % kShardAlign, 0);
      EXPECT_GE(l.local_offset(u), at);
      at = l.local_offset(u) + l.piece(u).size();
      int64_t sum = 0;
      for (int64_t c : l.counts(u)) sum += c;
      EXPECT_EQ(sum, units[u].size());
      EXPECT_EQ(l.counts(u)[size_t(r)], l.piece(u).size());
    }
    EXPECT_LE(at, l.local_floats());
    max_local = std::max(max_local, l.local_floats());
  }
  EXPECT_EQ(ShardLayout(units, 0, 3).max_local_floats(), max_local);
  // Unit 1 (8 floats) lives entirely on rank 0.
  EXPECT_EQ(ShardLayout(units, 0, 3).piece(1), (Range{112, 120}));
  EXPECT_TRUE(ShardLayout(units, 1, 3).piece(1).empty());
}

}  // namespace
}  // namespace headroom::dist
