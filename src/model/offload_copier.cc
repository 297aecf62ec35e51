// The offload copy thread.
#include "model/offload_copier.h"

#include <cstring>

#include "backend/ops.h"

namespace headroom::model {

OffloadCopier::OffloadCopier(Options options, const backend::Ops* ops)
    : options_(options),
      ops_(ops != nullptr && !ops->host_addressable() ? ops : nullptr),
      thread_([this] { run(); }) {}

void OffloadCopier::copy(const backend::Ops* ops, const Copy& c) {
  if (ops == nullptr || ops->host_addressable()) {
    std::memcpy(c.dst, c.src, c.bytes);
  } else if (c.direction == Direction::kToHost) {
    ops->copy_to_host(c.dst, c.src, c.bytes);
  } else {
    ops->copy_to_device(c.dst, c.src, c.bytes);
  }
}

OffloadCopier::~OffloadCopier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

uint64_t OffloadCopier::submit(std::vector<Copy> copies) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ticket = next_ticket_++;
    queue_.emplace_back(ticket, std::move(copies));
  }
  work_cv_.notify_one();
  return ticket;
}

void OffloadCopier::wait(uint64_t ticket) {
  if (ticket == 0) return;
  std::unique_lock<std::mutex> lock(mu_);
  if (done_ticket_ >= ticket) return;
  stats_.blocked_waits++;
  if (ticket > waited_ticket_) {
    waited_ticket_ = ticket;
    if (options_.run_at_wait) work_cv_.notify_one();
  }
  const auto t0 = std::chrono::steady_clock::now();
  done_cv_.wait(lock, [&] { return done_ticket_ >= ticket; });
  stats_.wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

OffloadCopier::Stats OffloadCopier::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void OffloadCopier::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = Stats();
}

void OffloadCopier::set_record(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  record_ = on;
  if (!on) spans_.clear();
}

std::vector<OffloadCopier::Span> OffloadCopier::take_spans() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Span> out;
  out.swap(spans_);
  return out;
}

void OffloadCopier::run() {
  while (true) {
    std::pair<uint64_t, std::vector<Copy>> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Jobs queued before the destructor are finished first: a waiter may still need them.
      work_cv_.wait(lock, [&] {
        return stop_ || (!queue_.empty() &&
                         (!options_.run_at_wait || waited_ticket_ >= queue_.front().first));
      });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    if (options_.delay.count() > 0) std::this_thread::sleep_for(options_.delay);
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t bytes = 0;
    if (ops_ == nullptr) {
      for (const Copy& c : job.second) {
        std::memcpy(c.dst, c.src, c.bytes);
        bytes += c.bytes;
      }
    } else {
      // The device's table: the job's copies queued at once (on a GPU they overlap each other's
      // setup and the compute queued after them), then waited for here, on the copy thread, so
      // that the executor's wait() means landed and ordered before its next ops.
      std::vector<uint64_t> tickets;
      tickets.reserve(job.second.size());
      for (const Copy& c : job.second) {
        tickets.push_back(c.direction == Direction::kToHost
                              ? ops_->copy_to_host_async(c.dst, c.src, c.bytes)
                              : ops_->copy_to_device_async(c.dst, c.src, c.bytes));
        bytes += c.bytes;
      }
      for (uint64_t t : tickets) ops_->wait_copy(t);
    }
    const auto t1 = std::chrono::steady_clock::now();
    const double secs = std::chrono::duration<double>(t1 - t0).count();
    if (options_.poison_sources) {
      for (const Copy& c : job.second) {
        void* src = const_cast<void*>(c.src);
        if (ops_ != nullptr && c.direction == Direction::kToHost) {
          ops_->fill_bytes(src, 0xFF, c.bytes);  // the device's memory
        } else {
          std::memset(src, 0xFF, c.bytes);
        }
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ticket_ = job.first;
      stats_.jobs++;
      stats_.bytes += bytes;
      stats_.copy_seconds += secs;
      if (record_) spans_.push_back({t0, t1, bytes});
    }
    done_cv_.notify_all();
  }
}

}  // namespace headroom::model
