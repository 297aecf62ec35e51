// The communication thread.
#include "dist/comm_queue.h"

#include "core/check.h"

namespace headroom::dist {

CommQueue::CommQueue() : thread_([this] { run(); }) {}

CommQueue::~CommQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_one();
  thread_.join();
}

CommQueue::Ticket CommQueue::submit(std::function<Status()> op) {
  Ticket t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    HR_CHECK(!stop_);
    queue_.push_back(std::move(op));
    t = ++submitted_;
  }
  work_cv_.notify_one();
  return t;
}

void CommQueue::wait(Ticket ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  HR_CHECK_MSG(ticket <= submitted_, "CommQueue::wait: ticket was never submitted");
  done_cv_.wait(lock, [&] { return done_ >= ticket; });
}

Status CommQueue::wait_all() {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return done_ == submitted_; });
  Status s = std::move(first_error_);
  first_error_ = Status::ok();
  return s;
}

CommQueue::Ticket CommQueue::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void CommQueue::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and drained
    std::function<Status()> op = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    Status s = op();
    lock.lock();
    if (!s.is_ok() && first_error_.is_ok()) first_error_ = std::move(s);
    ++done_;
    done_cv_.notify_all();
  }
}

}  // namespace headroom::dist
