// The prefetching ring.
#include "data/prefetcher.h"

#include <chrono>

#include "core/check.h"

namespace headroom::data {

Prefetcher::Prefetcher(int depth, std::function<int64_t(int)> fill)
    : depth_(depth), fill_(std::move(fill)), tags_(size_t(depth), 0) {
  HR_CHECK(depth >= 1);
  thread_ = std::thread([this] { run(); });
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Prefetcher::run() {
  while (true) {
    int64_t index;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // A slot is free once the consumer released the batch that last used it.
      cv_.wait(lock, [&] { return stop_ || filled_ - released_ < depth_; });
      if (stop_) return;
      index = filled_;
    }
    const int slot = int(index % depth_);
    const int64_t tag = fill_(slot);
    {
      std::lock_guard<std::mutex> lock(mu_);
      tags_[size_t(slot)] = tag;
      filled_++;
    }
    cv_.notify_all();
  }
}

Prefetcher::Ready Prefetcher::acquire() {
  auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  HR_CHECK_MSG(acquired_ == released_, "acquire() before the previous slot was released");
  cv_.wait(lock, [&] { return filled_ > acquired_; });
  const int slot = int(acquired_ % depth_);
  acquired_++;
  const double waited =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return {slot, tags_[size_t(slot)], waited};
}

void Prefetcher::release(int slot) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    HR_CHECK(slot == int(released_ % depth_));
    released_++;
  }
  cv_.notify_all();
}

int Prefetcher::ready_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return int(filled_ - acquired_);
}

}  // namespace headroom::data
