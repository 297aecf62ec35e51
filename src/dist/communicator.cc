// agree(), the local communicator and the factory.
#include "dist/communicator.h"

#include <climits>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/check.h"

namespace headroom::dist {

int64_t check_counts(std::span<const int64_t> counts, int ranks, std::vector<int64_t>* displs) {
  HR_CHECK_MSG(counts.size() == size_t(ranks), "collective: counts must have size() entries");
  displs->resize(counts.size());
  int64_t total = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    HR_CHECK_MSG(counts[r] >= 0, "collective: negative count");
    (*displs)[r] = total;
    total += counts[r];
  }
  return total;
}

Status agree(Communicator& comm, const Status& local) {
  // Step 1: the lowest failing rank (INT64_MAX when none failed).
  int64_t failing = local.is_ok() ? INT64_MAX : comm.rank();
  HR_RETURN_IF_ERROR(comm.all_reduce_min(&failing, 1));
  if (failing == INT64_MAX) return Status::ok();
  // Step 2: its code and message, length first so that the receivers can size the buffer.
  const int root = int(failing);
  int64_t header[2] = {0, 0};  // code, message bytes
  std::string message;
  if (comm.rank() == root) {
    header[0] = int64_t(local.code());
    message = local.message();
    header[1] = int64_t(message.size());
  }
  HR_RETURN_IF_ERROR(comm.broadcast(header, sizeof(header), root));
  message.resize(size_t(header[1]));
  if (header[1] > 0) HR_RETURN_IF_ERROR(comm.broadcast(message.data(), header[1], root));
  return Status(StatusCode(header[0]), "rank " + std::to_string(root) + ": " + message);
}

// ---- LocalCommunicator --------------------------------------------------------------------

Status LocalCommunicator::all_reduce(float*, int64_t n) {
  HR_CHECK(n >= 0);
  return Status::ok();
}
Status LocalCommunicator::all_reduce(double*, int64_t n) {
  HR_CHECK(n >= 0);
  return Status::ok();
}
Status LocalCommunicator::all_reduce_min(int64_t*, int64_t n) {
  HR_CHECK(n >= 0);
  return Status::ok();
}
Status LocalCommunicator::reduce_scatter(const float* send, float* recv,
                                         std::span<const int64_t> counts) {
  HR_CHECK(counts.size() == 1 && counts[0] >= 0);
  if (counts[0] > 0) {
    HR_CHECK_MSG(recv + counts[0] <= send || send + counts[0] <= recv,
                 "reduce_scatter: recv overlaps send");
    std::memcpy(recv, send, size_t(counts[0]) * sizeof(float));
  }
  return Status::ok();
}
Status LocalCommunicator::all_gather(const float* send, float* recv,
                                     std::span<const int64_t> counts) {
  HR_CHECK(counts.size() == 1 && counts[0] >= 0);
  if (counts[0] > 0 && send != recv) std::memmove(recv, send, size_t(counts[0]) * sizeof(float));
  return Status::ok();
}
Status LocalCommunicator::broadcast(void*, int64_t bytes, int root) {
  HR_CHECK(root == 0 && bytes >= 0);
  return Status::ok();
}

// ---- factory ------------------------------------------------------------------------------

bool have_mpi() {
#if defined(HEADROOM_HAVE_MPI)
  return true;
#else
  return false;
#endif
}

bool launched_by_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

int launcher_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}) {
    if (const char* v = std::getenv(var)) return std::atoi(v);
  }
  return 0;
}

Result<std::unique_ptr<Communicator>> make_world_communicator(const CommOptions& options) {
  if (!launched_by_mpi()) return std::unique_ptr<Communicator>(new LocalCommunicator());
#if defined(HEADROOM_HAVE_MPI)
  return make_mpi_communicator(options);
#else
  return Status::unsupported(
      "this process was started by an MPI launcher, but headroom was built without MPI; "
      "install libopenmpi-dev and reconfigure (cmake finds MPI), or run without mpirun");
#endif
}

}  // namespace headroom::dist
