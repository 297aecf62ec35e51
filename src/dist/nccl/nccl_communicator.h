// The NCCL communicator: dist::Communicator's collectives between GPUs, one rank per process,
// bootstrapped over another communicator (MPI under mpirun). Compiled into hr_dist only when the
// build has both CUDA and MPI (HEADROOM_HAVE_NCCL); plain types here, no CUDA headers.
// See docs/notes/cuda.md, "Infrastructure".
#pragma once

#include <memory>

#include "dist/communicator.h"

namespace headroom::dist {

// True when this build has the NCCL communicator.
inline bool have_nccl() {
#if defined(HEADROOM_HAVE_NCCL)
  return true;
#else
  return false;
#endif
}

#if defined(HEADROOM_HAVE_NCCL)

// Makes the NCCL communicator of the ranks of `bootstrap` (same rank and size): rank 0 creates
// the ncclUniqueId and broadcasts it over `bootstrap`, then every rank joins (ncclCommInitRank)
// on the CUDA op table's device (backend::cuda::process_device: local rank % devices). A
// collective over `bootstrap`, which is used only here and need not outlive the result.
// Errors: Unsupported without a usable device; Internal with NCCL's message when NCCL fails
// (e.g. two ranks on one GPU: NCCL needs a GPU per rank).
//
// Semantics of the collectives (Communicator's contract, on the GPU):
//  - Pointers are device memory of that device (or managed memory). all_reduce, all_reduce_min,
//    broadcast and barrier also take host memory (agree() passes host values): it is staged
//    through a fixed 1 MiB device buffer and the call waits for the result. reduce_scatter and
//    all_gather need device memory (InvalidArgument otherwise).
//  - Stream order, not host order: a call on device memory queues the collective on the op
//    table's comm stream after an event recorded on the compute stream (so it reads what the ops
//    queued before the call wrote), and makes the compute stream wait on the collective's event
//    (so ops queued after the call see its result). It returns without waiting for the GPU;
//    compute queued before the call overlaps with it. Host code reading the result synchronizes
//    first (Ops::synchronize). barrier() waits for the collective to finish on the host.
//  - reduce_scatter / all_gather with equal counts use ncclReduceScatter / ncclAllGather; with
//    unequal counts (a shard layout whose last rank holds less), a group of one ncclReduce /
//    ncclBroadcast per rank's segment: no padded staging buffer, so no memory outside the plan.
Result<std::unique_ptr<Communicator>> make_nccl_communicator(Communicator& bootstrap);

#endif

}  // namespace headroom::dist
