// dist_tests' main: makes the world communicator (initialising MPI under mpirun), lets only rank
// 0 print the usual gtest output (other ranks print their failures, prefixed), and exits with
// the same code on every rank.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>

#include "dist/communicator.h"
#include "test_env.h"

namespace headroom::dist::test {
namespace {

std::unique_ptr<Communicator> g_world;

// Failures of a rank other than 0, one line each, so that a 2-rank run stays readable.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
    }
  }

 private:
  int rank_;
};

}  // namespace

Communicator& world() { return *g_world; }

}  // namespace headroom::dist::test

int main(int argc, char** argv) {
  using namespace headroom;
  ::testing::InitGoogleTest(&argc, argv);
  Result<std::unique_ptr<dist::Communicator>> comm = dist::make_world_communicator();
  if (!comm.is_ok()) {
    std::fprintf(stderr, "dist_tests: %s\n", comm.status().to_string().c_str());
    return 2;
  }
  dist::test::g_world = std::move(*comm);
  const int rank = dist::test::g_world->rank();
  if (rank != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new dist::test::RankFailurePrinter(rank));
  }
  int rc = RUN_ALL_TESTS();
  // One exit code for the job: failed anywhere means failed everywhere.
  int64_t ok = rc == 0 ? 1 : 0;
  if (!dist::test::g_world->all_reduce_min(&ok, 1).is_ok()) ok = 0;
  if (rank == 0 && dist::test::g_world->size() > 1) {
    std::printf("dist_tests: %d ranks, %s\n", dist::test::g_world->size(),
                ok ? "all passed" : "FAILED on some rank");
  }
  dist::test::g_world.reset();
  return ok ? 0 : 1;
}
