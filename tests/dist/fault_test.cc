// Failure handling across ranks, end to end: dist_fault_helper runs as a 2-rank mpirun job under
// `timeout`; a failure on one rank must end the job within seconds with a clear message, never
// hang. Runs only in the single-process invocation of dist_tests (mpirun inside an mpirun job is
// not supported) and only when the build has MPI.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "dist/communicator.h"
#include "test_env.h"

namespace headroom::dist {
namespace {

struct JobResult {
  int exit_code = -1;  // of `timeout mpirun ...`: 124 means it hung until the timeout
  std::string output;  // stdout and stderr of every rank and of mpirun
  double seconds = 0;
};

#if defined(HEADROOM_MPIEXEC) && defined(HEADROOM_FAULT_HELPER)
JobResult run_job(const std::string& mode) {
  // Root is allowed (CI runs as root); 2 ranks may share fewer cores; Open MPI's allocations
  // that outlive MPI_Finalize are not leaks of ours (debug preset's LeakSanitizer).
  const std::string cmd =
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
      "OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1 ASAN_OPTIONS=detect_leaks=0 "
      "timeout -k 10 90 " HEADROOM_MPIEXEC " -np 2 --oversubscribe " HEADROOM_FAULT_HELPER " " +
      mode + " 2>&1";
  JobResult r;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}
#endif

// Why these tests cannot run here, or empty.
std::string not_runnable() {
  if (!have_mpi()) return "built without MPI";
  if (test::world().size() > 1 || launched_by_mpi()) return "runs only outside mpirun";
  return "";
}

TEST(Fault, FailureOnOneRankIsAgreedAndBothStop) {
  if (const std::string why = not_runnable(); !why.empty()) GTEST_SKIP() << why;
#if defined(HEADROOM_MPIEXEC) && defined(HEADROOM_FAULT_HELPER)
  const JobResult r = run_job("agree");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  for (int rank : {0, 1}) {
    EXPECT_NE(r.output.find("helper rank " + std::to_string(rank) +
                            ": step status: OutOfMemory: rank 1: injected: step needs 2.0 GiB"),
              std::string::npos)
        << r.output;
  }
  EXPECT_LT(r.seconds, 60) << r.output;
#endif
}

// A rank that exits or aborts without a word to the others: mpirun ends the job, reports which
// rank, and the survivor never returns success.
TEST(Fault, RankThatDiesEndsTheJob) {
  if (const std::string why = not_runnable(); !why.empty()) GTEST_SKIP() << why;
#if defined(HEADROOM_MPIEXEC) && defined(HEADROOM_FAULT_HELPER)
  for (const char* mode : {"exit", "abort"}) {
    const JobResult r = run_job(mode);
    EXPECT_NE(r.exit_code, 0) << mode << "\n" << r.output;
    EXPECT_NE(r.exit_code, 124) << mode << ": the job hung until the timeout\n" << r.output;
    EXPECT_LT(r.seconds, 60) << mode << "\n" << r.output;
    EXPECT_NE(r.output.find("helper rank 1: dying now"), std::string::npos) << r.output;
    // mpirun's own report names the job's end: "...exited with non-zero status..." for an exit,
    // "...exited on signal 6 (Aborted)" for an abort.
    EXPECT_NE(r.output.find("exited"), std::string::npos) << mode << "\n" << r.output;
    EXPECT_EQ(r.output.find("all_reduce returned: OK"), std::string::npos) << r.output;
  }
#endif
}

}  // namespace
}  // namespace headroom::dist
