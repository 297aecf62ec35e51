// A communicator for a device whose memory the host cannot touch and which has no transport of its
// own (the fenced test device; a CUDA build without NCCL): device buffers are copied to host
// memory, the inner (host) communicator runs on the copies, and results are copied back.
// See docs/notes/device-trainer.md ("Several ranks and ZeRO").
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string_view>
#include <vector>

#include "backend/ops.h"
#include "dist/communicator.h"

namespace headroom::dist {

// Decorates `inner` (MPI or the local communicator, which take host memory) for the memory of
// `ops`. Each buffer of a collective that ops.is_device_pointer() says is device memory is staged:
// copied to a host buffer with ops.copy_to_host, the inner collective run on it, the result
// copied back with ops.copy_to_device. Host buffers (agree()'s values, the trainer's loss sums)
// go to the inner communicator as they are. The results are the inner communicator's bits: the
// same collective runs on the same values.
//
// The host staging is one buffer outside any device budget (as a GPU's pinned staging is),
// grown to the largest collective seen and kept (no allocation per call once grown).
// With one rank, all_reduce, all_reduce_min and broadcast are identities and copy nothing.
//
// Thread safety: as Communicator's (calls are serialised by a lock here and in the inner one).
// REQUIRES: `inner` and `ops` outlive this object.
class StagingCommunicator final : public Communicator {
 public:
  StagingCommunicator(Communicator* inner, const backend::Ops* ops);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view name() const override { return "staged"; }

  Status all_reduce(float* data, int64_t n) override;
  Status all_reduce(double* data, int64_t n) override;
  Status all_reduce_min(int64_t* data, int64_t n) override;
  Status reduce_scatter(const float* send, float* recv, std::span<const int64_t> counts) override;
  Status all_gather(const float* send, float* recv, std::span<const int64_t> counts) override;
  Status broadcast(void* data, int64_t bytes, int root) override;
  Status barrier() override { return inner_->barrier(); }
  using Communicator::broadcast;  // the float overload

  // Bytes of host staging held now (the largest collective's device bytes so far).
  size_t staging_bytes() const;
  // Device bytes copied each way so far (tests, accounting).
  int64_t bytes_to_host() const;
  int64_t bytes_to_device() const;

 private:
  // Host staging of at least `bytes` bytes, grown if needed. REQUIRES: mu_ held.
  std::byte* host(size_t bytes);
  bool on_device(const void* p, size_t bytes) const {
    return bytes > 0 && p != nullptr && ops_->is_device_pointer(p);
  }
  template <typename T, typename F>
  Status reduce_in_place(T* data, int64_t n, F&& collective);

  Communicator* inner_;
  const backend::Ops* ops_;
  mutable std::mutex mu_;
  std::vector<std::max_align_t> staging_;
  int64_t to_host_ = 0;
  int64_t to_device_ = 0;
};

}  // namespace headroom::dist
