// The communicator: collectives over the ranks of a data-parallel job. One interface, an MPI
// implementation (CPU) and a single-process one; a NCCL one can implement the same calls.
// See docs/notes/zero.md for the thread level, the large-count rule and failure handling.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace headroom::dist {

// Collectives are called by every rank in the same order with matching arguments (counts, root);
// that is the caller's contract, as in MPI and NCCL. A call that breaks a local precondition
// (wrong counts length, negative size) is a bug and aborts with HR_CHECK, which under mpirun
// ends the whole job (never a hang). A failure reported by the transport returns a Status.
//
// Element counts are int64_t: counts above INT_MAX are sent in pieces (MPI counts are int).
//
// Thread safety: calls are serialised by the implementation (it holds a lock while inside the
// library), so any thread may call, one at a time. Ordering across ranks is still the caller's:
// two threads issuing collectives concurrently would race for the order, so in practice one
// thread at a time owns the communicator (dist::CommQueue while it has work, else the caller).
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view name() const = 0;  // "mpi", "local"
  // Whether the collectives take device memory themselves (NCCL). False: host memory only, and a
  // trainer on a device the host cannot address wraps this communicator in a
  // StagingCommunicator (dist/staging_communicator.h).
  virtual bool takes_device_memory() const { return false; }
  // Device memory this communicator holds outside every plan (NCCL's channel buffers and its
  // staging buffer, measured when it was made); 0 when it holds none.
  virtual uint64_t device_bytes_held() const { return 0; }

  // data[0, n) := the sum over ranks of data[0, n), on every rank.
  virtual Status all_reduce(float* data, int64_t n) = 0;
  virtual Status all_reduce(double* data, int64_t n) = 0;
  // data[0, n) := the minimum over ranks.
  virtual Status all_reduce_min(int64_t* data, int64_t n) = 0;

  // counts has size() entries; segment r is send[displ(r), displ(r) + counts[r]) with displ the
  // prefix sum. recv[0, counts[rank()]) := the sum over ranks of their segment rank().
  // REQUIRES: recv does not overlap send.
  virtual Status reduce_scatter(const float* send, float* recv,
                                std::span<const int64_t> counts) = 0;
  // recv[displ(r), displ(r) + counts[r]) := rank r's send[0, counts[r]), on every rank.
  // In place when send == recv + displ(rank()).
  virtual Status all_gather(const float* send, float* recv, std::span<const int64_t> counts) = 0;
  // data[0, bytes) := root's data[0, bytes).
  virtual Status broadcast(void* data, int64_t bytes, int root) = 0;
  virtual Status barrier() = 0;

  Status broadcast(float* data, int64_t n, int root) {
    return broadcast(static_cast<void*>(data), n * int64_t(sizeof(float)), root);
  }
};

// The status of a step, agreed by all ranks: each rank passes its own; every rank gets OK only if
// all were OK, otherwise the status (code and message) of the lowest-numbered failing rank with
// "rank N: " prepended. A collective: two small messages (a min all-reduce, then a broadcast of
// the failing rank's status only when there is one). Lets every rank stop, or re-plan, together
// instead of leaving the healthy ones waiting in the next collective.
Status agree(Communicator& comm, const Status& local);

// A v-collective's counts checked (a local precondition: `ranks` entries, none negative; a
// breach aborts) and their displacements (prefix sums) into *displs; returns their sum. Shared by
// the implementations of reduce_scatter and all_gather.
int64_t check_counts(std::span<const int64_t> counts, int ranks, std::vector<int64_t>* displs);

// The single-process communicator: size 1, every collective is a copy or nothing.
class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view name() const override { return "local"; }
  Status all_reduce(float*, int64_t n) override;
  Status all_reduce(double*, int64_t n) override;
  Status all_reduce_min(int64_t*, int64_t n) override;
  Status reduce_scatter(const float* send, float* recv, std::span<const int64_t> counts) override;
  Status all_gather(const float* send, float* recv, std::span<const int64_t> counts) override;
  Status broadcast(void* data, int64_t bytes, int root) override;
  Status barrier() override { return Status::ok(); }
};

struct CommOptions {
  // Largest element count handed to one MPI call; larger transfers go in pieces. INT_MAX in
  // production; tests lower it to exercise the piecewise path on small buffers.
  int64_t max_count = int64_t(1) << 30;
};

// True when this build has the MPI communicator.
bool have_mpi();
// True when the process was started by an MPI launcher (mpirun/mpiexec: OMPI_COMM_WORLD_SIZE,
// PMI_SIZE or PMIX_RANK is set).
bool launched_by_mpi();
// This process's rank as the MPI launcher gives it (OMPI_COMM_WORLD_RANK, PMI_RANK or
// PMIX_RANK), 0 when not launched by one: for what is read before the communicator exists
// (train's per-rank --device-memory-file).
int launcher_rank();

// The communicator of all the job's processes: MPI when launched by mpirun, otherwise the
// local one. Under mpirun in a build without MPI: Unsupported (never a silent size-1 job in
// every process). The first MPI communicator initialises MPI (MPI_Init_thread with
// MPI_THREAD_SERIALIZED) and MPI is finalised at exit; each communicator owns a duplicate of
// MPI_COMM_WORLD, so several may coexist (e.g. with different options).
Result<std::unique_ptr<Communicator>> make_world_communicator(const CommOptions& options = {});

#if defined(HEADROOM_HAVE_MPI)
// The MPI communicator directly (also started outside mpirun as a singleton of size 1).
Result<std::unique_ptr<Communicator>> make_mpi_communicator(const CommOptions& options);
#endif

}  // namespace headroom::dist
