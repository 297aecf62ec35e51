// The MPI communicator (compiled only when CMake finds MPI). See docs/notes/zero.md.
//
// Thread level: MPI_THREAD_SERIALIZED. The communication thread (dist::CommQueue) issues the
// collectives that overlap backward, and the training thread issues the rest (agree, the
// optimizer's gathers) when the queue is idle: two threads, never at once. FUNNELED would forbid
// the communication thread; MULTIPLE costs a lock inside Open MPI on every call and buys nothing
// here, because the collectives must be ordered identically on all ranks anyway. A process-wide
// mutex enforces "never at once" even if a caller gets it wrong.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "core/check.h"
#include "dist/communicator.h"

namespace headroom::dist {
namespace {

std::mutex& mpi_mutex() {
  static std::mutex m;
  return m;
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

// Initialises MPI once per process; MPI cannot be initialised again after MPI_Finalize.
Status ensure_initialized() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    int provided = 0;
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_SERIALIZED) {
      return Status::unsupported(
          "MPI was initialised elsewhere with a thread level below MPI_THREAD_SERIALIZED; "
          "headroom's communication thread needs SERIALIZED");
    }
    return Status::ok();
  }
  int provided = 0;
  if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
    return Status::internal("MPI_Init_thread failed");
  }
  std::atexit(finalize_at_exit);
  if (provided < MPI_THREAD_SERIALIZED) {
    return Status::unsupported("this MPI library provides thread level " +
                               std::to_string(provided) +
                               ", below MPI_THREAD_SERIALIZED; rebuild Open MPI with threads");
  }
  return Status::ok();
}

Status mpi_error(const char* call, int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  return Status::internal(std::string(call) + " failed: " + std::string(text, size_t(len)));
}

#define HR_MPI(call)                       \
  do {                                     \
    const int hr_mpi_rc_ = (call);         \
    if (hr_mpi_rc_ != MPI_SUCCESS) {       \
      return mpi_error(#call, hr_mpi_rc_); \
    }                                      \
  } while (0)

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, const CommOptions& options) : comm_(comm) {
    max_count_ = std::clamp<int64_t>(options.max_count, 1, INT_MAX);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    std::lock_guard<std::mutex> lock(mpi_mutex());
    if (!finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "mpi"; }

  Status all_reduce(float* data, int64_t n) override {
    return all_reduce_impl(data, n, MPI_FLOAT, MPI_SUM);
  }
  Status all_reduce(double* data, int64_t n) override {
    return all_reduce_impl(data, n, MPI_DOUBLE, MPI_SUM);
  }
  Status all_reduce_min(int64_t* data, int64_t n) override {
    return all_reduce_impl(data, n, MPI_INT64_T, MPI_MIN);
  }

  Status reduce_scatter(const float* send, float* recv, std::span<const int64_t> counts) override {
    std::vector<int64_t> displs;
    const int64_t total = check_counts(counts, size_, &displs);
    const int64_t mine = counts[size_t(rank_)];
    HR_CHECK_MSG(mine == 0 || total == 0 || recv + mine <= send || send + total <= recv,
                 "reduce_scatter: recv overlaps send");
    std::lock_guard<std::mutex> lock(mpi_mutex());
    if (fits(counts, total)) {
      std::vector<int> icounts(counts.begin(), counts.end());
      float dummy = 0.0f;
      HR_MPI(MPI_Reduce_scatter(total > 0 ? send : &dummy, mine > 0 ? recv : &dummy, icounts.data(),
                                MPI_FLOAT, MPI_SUM, comm_));
      return Status::ok();
    }
    // Piecewise: one MPI_Reduce per root and piece, each under max_count_ elements.
    for (int r = 0; r < size_; ++r) {
      for (int64_t off = 0; off < counts[size_t(r)]; off += max_count_) {
        const int len = int(std::min(max_count_, counts[size_t(r)] - off));
        HR_MPI(MPI_Reduce(send + displs[size_t(r)] + off, r == rank_ ? recv + off : nullptr, len,
                          MPI_FLOAT, MPI_SUM, r, comm_));
      }
    }
    return Status::ok();
  }

  Status all_gather(const float* send, float* recv, std::span<const int64_t> counts) override {
    std::vector<int64_t> displs;
    const int64_t total = check_counts(counts, size_, &displs);
    const int64_t mine = counts[size_t(rank_)];
    float* my_place = recv + displs[size_t(rank_)];
    const bool in_place = send == my_place;
    std::lock_guard<std::mutex> lock(mpi_mutex());
    if (fits(counts, total)) {
      std::vector<int> icounts(counts.begin(), counts.end()), idispls(displs.begin(), displs.end());
      float dummy = 0.0f;
      HR_MPI(MPI_Allgatherv(in_place ? MPI_IN_PLACE : (mine > 0 ? send : &dummy), int(mine),
                            MPI_FLOAT, total > 0 ? recv : &dummy, icounts.data(), idispls.data(),
                            MPI_FLOAT, comm_));
      return Status::ok();
    }
    // Piecewise: each rank broadcasts its segment in pieces of at most max_count_ elements.
    if (!in_place && mine > 0) std::memmove(my_place, send, size_t(mine) * sizeof(float));
    for (int r = 0; r < size_; ++r) {
      for (int64_t off = 0; off < counts[size_t(r)]; off += max_count_) {
        const int len = int(std::min(max_count_, counts[size_t(r)] - off));
        HR_MPI(MPI_Bcast(recv + displs[size_t(r)] + off, len, MPI_FLOAT, r, comm_));
      }
    }
    return Status::ok();
  }

  Status broadcast(void* data, int64_t bytes, int root) override {
    HR_CHECK(bytes >= 0 && root >= 0 && root < size_);
    std::lock_guard<std::mutex> lock(mpi_mutex());
    char* p = static_cast<char*>(data);
    for (int64_t off = 0; off < bytes; off += max_count_) {
      HR_MPI(MPI_Bcast(p + off, int(std::min(max_count_, bytes - off)), MPI_BYTE, root, comm_));
    }
    return Status::ok();
  }

  Status barrier() override {
    std::lock_guard<std::mutex> lock(mpi_mutex());
    HR_MPI(MPI_Barrier(comm_));
    return Status::ok();
  }

 private:
  Status all_reduce_impl(void* data, int64_t n, MPI_Datatype type, MPI_Op op) {
    HR_CHECK(n >= 0);
    int elem = 0;
    MPI_Type_size(type, &elem);
    std::lock_guard<std::mutex> lock(mpi_mutex());
    char* p = static_cast<char*>(data);
    for (int64_t off = 0; off < n; off += max_count_) {
      const int len = int(std::min(max_count_, n - off));
      HR_MPI(MPI_Allreduce(MPI_IN_PLACE, p + off * elem, len, type, op, comm_));
    }
    return Status::ok();
  }

  // Whether one v-collective can carry it: MPI's counts and displacements are int.
  bool fits(std::span<const int64_t> counts, int64_t total) const {
    return total <= max_count_ &&
           std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c <= max_count_; });
  }

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  int64_t max_count_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_mpi_communicator(const CommOptions& options) {
  HR_RETURN_IF_ERROR(ensure_initialized());
  MPI_Comm comm;
  {
    std::lock_guard<std::mutex> lock(mpi_mutex());
    if (int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm); rc != MPI_SUCCESS) {
      return mpi_error("MPI_Comm_dup", rc);
    }
    // Errors come back as codes (turned into Status) instead of aborting inside MPI. A rank
    // that dies is handled by mpirun, which ends the job.
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  }
  return std::unique_ptr<Communicator>(new MpiCommunicator(comm, options));
}

}  // namespace headroom::dist
