// Collectives on device memory through host staging (staging_communicator.h).
#include "dist/staging_communicator.h"

#include <cstring>

#include "core/check.h"

namespace headroom::dist {

namespace {

// Offsets inside the staging buffer keep every part aligned for any scalar.
size_t round_up(size_t bytes) {
  constexpr size_t a = alignof(std::max_align_t);
  return (bytes + a - 1) / a * a;
}

}  // namespace

StagingCommunicator::StagingCommunicator(Communicator* inner, const backend::Ops* ops)
    : inner_(inner), ops_(ops) {
  HR_CHECK(inner_ != nullptr && ops_ != nullptr);
}

std::byte* StagingCommunicator::host(size_t bytes) {
  const size_t units = (bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t);
  if (staging_.size() < units) {
    // Grown once to the largest collective (the trainer's first steps reach it), then kept.
    staging_.clear();
    staging_.shrink_to_fit();
    staging_.resize(units);
  }
  return reinterpret_cast<std::byte*>(staging_.data());
}

template <typename T, typename F>
Status StagingCommunicator::reduce_in_place(T* data, int64_t n, F&& collective) {
  HR_CHECK(n >= 0);
  const size_t bytes = size_t(n) * sizeof(T);
  if (!on_device(data, bytes)) return collective(data);
  if (inner_->size() == 1) return Status::ok();  // the sum (minimum) over one rank: the data
  std::lock_guard<std::mutex> lock(mu_);
  T* h = reinterpret_cast<T*>(host(bytes));
  ops_->copy_to_host(h, data, bytes);
  HR_RETURN_IF_ERROR(collective(h));
  ops_->copy_to_device(data, h, bytes);
  to_host_ += int64_t(bytes);
  to_device_ += int64_t(bytes);
  return Status::ok();
}

Status StagingCommunicator::all_reduce(float* data, int64_t n) {
  return reduce_in_place(data, n, [&](float* d) { return inner_->all_reduce(d, n); });
}
Status StagingCommunicator::all_reduce(double* data, int64_t n) {
  return reduce_in_place(data, n, [&](double* d) { return inner_->all_reduce(d, n); });
}
Status StagingCommunicator::all_reduce_min(int64_t* data, int64_t n) {
  return reduce_in_place(data, n, [&](int64_t* d) { return inner_->all_reduce_min(d, n); });
}

Status StagingCommunicator::reduce_scatter(const float* send, float* recv,
                                           std::span<const int64_t> counts) {
  std::vector<int64_t> displs;
  const int64_t total = check_counts(counts, size(), &displs);
  const int64_t mine = counts[size_t(rank())];
  const size_t send_bytes = size_t(total) * sizeof(float),
               recv_bytes = size_t(mine) * sizeof(float);
  const bool dsend = on_device(send, send_bytes), drecv = on_device(recv, recv_bytes);
  if (!dsend && !drecv) return inner_->reduce_scatter(send, recv, counts);
  std::lock_guard<std::mutex> lock(mu_);
  std::byte* buf = host(round_up(send_bytes) + recv_bytes);
  const float* hs = send;
  if (dsend) {
    ops_->copy_to_host(buf, send, send_bytes);
    hs = reinterpret_cast<const float*>(buf);
    to_host_ += int64_t(send_bytes);
  }
  float* hr = drecv ? reinterpret_cast<float*>(buf + round_up(send_bytes)) : recv;
  HR_RETURN_IF_ERROR(inner_->reduce_scatter(hs, hr, counts));
  if (drecv) {
    ops_->copy_to_device(recv, hr, recv_bytes);
    to_device_ += int64_t(recv_bytes);
  }
  return Status::ok();
}

Status StagingCommunicator::all_gather(const float* send, float* recv,
                                       std::span<const int64_t> counts) {
  std::vector<int64_t> displs;
  const int64_t total = check_counts(counts, size(), &displs);
  const int64_t mine = counts[size_t(rank())], at = displs[size_t(rank())];
  const size_t recv_bytes = size_t(total) * sizeof(float),
               send_bytes = size_t(mine) * sizeof(float);
  const bool drecv = on_device(recv, recv_bytes), dsend = on_device(send, send_bytes);
  if (!dsend && !drecv) return inner_->all_gather(send, recv, counts);
  std::lock_guard<std::mutex> lock(mu_);
  if (!drecv) {
    // A device shard gathered into host memory: only the shard is staged.
    float* hs = reinterpret_cast<float*>(host(send_bytes));
    ops_->copy_to_host(hs, send, send_bytes);
    to_host_ += int64_t(send_bytes);
    return inner_->all_gather(hs, recv, counts);
  }
  // Into device memory: this rank's segment is placed in the host copy of recv and gathered
  // there in place (whether or not the caller's call was in place), then the whole is copied back.
  float* hr = reinterpret_cast<float*>(host(recv_bytes));
  if (dsend) {
    ops_->copy_to_host(hr + at, send, send_bytes);
    to_host_ += int64_t(send_bytes);
  } else if (send_bytes > 0) {
    std::memcpy(hr + at, send, send_bytes);
  }
  HR_RETURN_IF_ERROR(inner_->all_gather(hr + at, hr, counts));
  ops_->copy_to_device(recv, hr, recv_bytes);
  to_device_ += int64_t(recv_bytes);
  return Status::ok();
}

Status StagingCommunicator::broadcast(void* data, int64_t bytes, int root) {
  HR_CHECK(bytes >= 0 && root >= 0 && root < size());
  if (!on_device(data, size_t(bytes))) return inner_->broadcast(data, bytes, root);
  if (inner_->size() == 1) return Status::ok();  // root's data is the data
  std::lock_guard<std::mutex> lock(mu_);
  std::byte* h = host(size_t(bytes));
  if (rank() == root) {
    ops_->copy_to_host(h, data, size_t(bytes));
    to_host_ += bytes;
  }
  HR_RETURN_IF_ERROR(inner_->broadcast(h, bytes, root));
  if (rank() != root) {
    ops_->copy_to_device(data, h, size_t(bytes));
    to_device_ += bytes;
  }
  return Status::ok();
}

size_t StagingCommunicator::staging_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return staging_.size() * sizeof(std::max_align_t);
}
int64_t StagingCommunicator::bytes_to_host() const {
  std::lock_guard<std::mutex> lock(mu_);
  return to_host_;
}
int64_t StagingCommunicator::bytes_to_device() const {
  std::lock_guard<std::mutex> lock(mu_);
  return to_device_;
}

}  // namespace headroom::dist
