// A 2-rank job that fails on purpose, for fault_test.cc (run under mpirun by that test):
//   agree     rank 1 reports an out-of-memory step; both ranks agree on it, print it, and stop
//             with exit code 3 after finalising MPI (an orderly stop, no hang).
//   exit      rank 1 exits outright (std::_Exit(9), no MPI_Finalize) while rank 0 waits in an
//             all-reduce; mpirun must end the job.
//   abort     the same with abort() (what a failed HR_CHECK does).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "dist/communicator.h"

using namespace headroom;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: dist_fault_helper agree|exit|abort\n");
    return 2;
  }
  const std::string mode = argv[1];
  Result<std::unique_ptr<dist::Communicator>> made = dist::make_world_communicator();
  if (!made.is_ok()) {
    std::fprintf(stderr, "%s\n", made.status().to_string().c_str());
    return 2;
  }
  dist::Communicator& comm = **made;
  const int me = comm.rank();
  if (comm.size() < 2) {
    std::fprintf(stderr, "dist_fault_helper: needs 2 ranks\n");
    return 2;
  }
  std::vector<float> x(1024, 1.0f);
  if (!comm.all_reduce(x.data(), int64_t(x.size())).is_ok()) return 4;  // a healthy step first

  if (mode == "agree") {
    const Status local =
        me == 1 ? Status::out_of_memory("injected: step needs 2.0 GiB, 1.5 GiB free") : Status();
    const Status s = dist::agree(comm, local);
    std::printf("helper rank %d: step status: %s\n", me, s.to_string().c_str());
    std::fflush(stdout);
    if (!s.is_ok()) {
      made->reset();  // every rank stops the same way
      return 3;
    }
    return 0;
  }
  if (mode == "exit" || mode == "abort") {
    if (me == 1) {
      std::fprintf(stderr, "helper rank 1: dying now\n");
      std::fflush(stderr);
      if (mode == "exit") std::_Exit(9);
      std::abort();
    }
    const Status s = comm.all_reduce(x.data(), int64_t(x.size()));
    // Reaching this line is allowed only with an error: a transport that notices the dead peer.
    std::printf("helper rank 0: all_reduce returned: %s\n", s.to_string().c_str());
    return s.is_ok() ? 0 : 5;
  }
  std::fprintf(stderr, "dist_fault_helper: unknown mode %s\n", mode.c_str());
  return 2;
}
