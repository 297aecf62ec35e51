// Every collective against a computed expectation, on however many ranks the job has (1 when
// run alone, 2 under mpirun), through both the one-call path and the piecewise path that large
// counts take (forced here with a tiny max_count).
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "dist/communicator.h"
#include "dist/shard.h"
#include "test_env.h"

namespace headroom::dist {
namespace {

using test::world;

// Values whose sums over a few ranks are exact in fp32, so expectations compare with ==.
float value(int rank, int64_t i) { return float((rank + 1) * 1000 + i % 997) * 0.5f; }

void check_collectives(Communicator& comm) {
  const int R = comm.size(), me = comm.rank();
  // all_reduce, float: sum over ranks.
  {
    const int64_t n = 1003;  // not a multiple of anything useful
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) x[size_t(i)] = value(me, i);
    ASSERT_TRUE(comm.all_reduce(x.data(), n).is_ok());
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      float want = 0;
      for (int r = 0; r < R; ++r) want += value(r, i);
      bad += x[size_t(i)] != want;
    }
    EXPECT_EQ(bad, 0) << comm.name();
  }
  // all_reduce, double, and min.
  {
    std::vector<double> d = {double(me) + 0.25, 1e300 / R};
    std::vector<int64_t> m = {int64_t(me) + 10, -int64_t(me), INT64_MAX};
    ASSERT_TRUE(comm.all_reduce(d.data(), 2).is_ok());
    ASSERT_TRUE(comm.all_reduce_min(m.data(), 3).is_ok());
    EXPECT_DOUBLE_EQ(d[0], R * (R - 1) / 2.0 + 0.25 * R);
    EXPECT_DOUBLE_EQ(d[1], 1e300 / R * R);
    EXPECT_EQ(m[0], 10);
    EXPECT_EQ(m[1], -(R - 1));
    EXPECT_EQ(m[2], INT64_MAX);
  }
  // reduce_scatter with uneven counts (the last rank's piece is shorter).
  {
    const int64_t n = 1000;
    const std::vector<int64_t> counts = shard_counts(n, R);
    std::vector<float> send(n), recv(static_cast<size_t>(counts[size_t(me)] + 1), -7.0f);
    for (int64_t i = 0; i < n; ++i) send[size_t(i)] = value(me, i);
    ASSERT_TRUE(comm.reduce_scatter(send.data(), recv.data(), counts).is_ok());
    const Range mine = shard_range(n, me, R);
    int64_t bad = 0;
    for (int64_t j = 0; j < mine.size(); ++j) {
      float want = 0;
      for (int r = 0; r < R; ++r) want += value(r, mine.begin + j);
      bad += recv[size_t(j)] != want;
    }
    EXPECT_EQ(bad, 0) << comm.name();
    EXPECT_EQ(recv.back(), -7.0f) << "wrote past its piece";
  }
  // all_gather, separate buffers and in place, with an empty piece when R > 1.
  for (bool in_place : {false, true}) {
    const int64_t n = 20;  // pieces of 16: the third and later ranks get nothing
    const std::vector<int64_t> counts = shard_counts(n, R);
    const Range mine = shard_range(n, me, R);
    std::vector<float> recv(n, -1.0f), send(size_t(mine.size()));
    for (int64_t j = 0; j < mine.size(); ++j) send[size_t(j)] = value(me, mine.begin + j);
    const float* src = send.data();
    if (in_place) {
      std::copy(send.begin(), send.end(), recv.begin() + mine.begin);
      src = recv.data() + mine.begin;
    }
    ASSERT_TRUE(comm.all_gather(src, recv.data(), counts).is_ok());
    int64_t bad = 0;
    for (int r = 0; r < R; ++r) {
      const Range p = shard_range(n, r, R);
      for (int64_t i = p.begin; i < p.end; ++i) bad += recv[size_t(i)] != value(r, i);
    }
    EXPECT_EQ(bad, 0) << comm.name() << (in_place ? " in place" : "");
  }
  // broadcast from the last rank (bytes, odd length).
  {
    std::vector<char> b(23);
    for (size_t i = 0; i < b.size(); ++i) b[i] = char(me * 31 + int(i));
    ASSERT_TRUE(comm.broadcast(b.data(), int64_t(b.size()), R - 1).is_ok());
    int bad = 0;
    for (size_t i = 0; i < b.size(); ++i) bad += b[i] != char((R - 1) * 31 + int(i));
    EXPECT_EQ(bad, 0);
  }
  EXPECT_TRUE(comm.barrier().is_ok());
}

TEST(Communicator, CollectivesMatchExpectations) { check_collectives(world()); }

// Counts above MPI's int are sent in pieces; the same path, forced with pieces of 7 elements.
TEST(Communicator, PiecewisePathForLargeCounts) {
  Result<std::unique_ptr<Communicator>> small = make_world_communicator(CommOptions{7});
  ASSERT_TRUE(small.is_ok()) << small.status().to_string();
  EXPECT_EQ((*small)->size(), world().size());
  check_collectives(**small);
}

TEST(Communicator, LocalCommunicatorIsSizeOne) {
  LocalCommunicator local;
  EXPECT_EQ(local.size(), 1);
  check_collectives(local);
}

TEST(Agree, AllOkGivesOk) { EXPECT_TRUE(agree(world(), Status::ok()).is_ok()); }

// Rank 1 (rank 0 alone) fails: every rank gets its code and message, with its rank.
TEST(Agree, OneFailingRankReachesEveryRank) {
  const int failing = world().size() > 1 ? 1 : 0;
  const Status local = world().rank() == failing
                           ? Status::out_of_memory("injected: 3 GiB requested, 1 GiB free")
                           : Status::ok();
  const Status s = agree(world(), local);
  EXPECT_EQ(s.code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(s.message(),
            "rank " + std::to_string(failing) + ": injected: 3 GiB requested, 1 GiB free");
  // The communicator is still usable afterwards (nobody is stuck in a collective).
  EXPECT_TRUE(agree(world(), Status::ok()).is_ok());
}

// Several failing ranks: the lowest one's status wins, the same on every rank.
TEST(Agree, LowestFailingRankWins) {
  const int me = world().rank();
  const Status local = Status::io_error("disk of rank " + std::to_string(me) + " is full");
  const Status s = agree(world(), local);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.message(), "rank 0: disk of rank 0 is full");
}

}  // namespace
}  // namespace headroom::dist
