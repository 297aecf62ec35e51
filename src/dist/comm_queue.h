// A communication thread: collectives submitted by the training thread run on it, in submission
// order, while the training thread goes on (backward of the next layer, forward with prefetch).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "core/status.h"

namespace headroom::dist {

// Runs submitted operations one at a time, in submission order, on its own thread. Because every
// rank submits the same collectives in the same order, the collectives match across ranks.
//
// Use one queue per communicator, shared by everything that communicates during a step (the
// gradient reducer, the parameter gatherer): two queues would issue collectives from two threads
// in an order that can differ between ranks.
//
// After an operation fails, the later ones still run (skipping them on one rank would leave the
// others waiting in the matching collective); the first failure is kept and returned by
// wait_all(). Thread safety: submit/wait/wait_all may be called from any one thread (the
// training thread); the operations themselves run on the queue's thread.
class CommQueue {
 public:
  using Ticket = uint64_t;

  CommQueue();
  ~CommQueue();  // drains the queue, then joins the thread
  CommQueue(const CommQueue&) = delete;
  CommQueue& operator=(const CommQueue&) = delete;

  // Enqueues op; returns its ticket (increasing from 1).
  Ticket submit(std::function<Status()> op);
  // Blocks until the operation with this ticket (and every earlier one) has run.
  void wait(Ticket ticket);
  // Blocks until the queue is empty; returns the first failure since the last wait_all() and
  // clears it.
  Status wait_all();
  // The ticket of the last operation that has finished (0 before any).
  Ticket done() const;

 private:
  void run();

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // signals the thread: work or stop
  std::condition_variable done_cv_;  // signals waiters: an operation finished
  std::deque<std::function<Status()>> queue_;
  Ticket submitted_ = 0;
  Ticket done_ = 0;
  Status first_error_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

}  // namespace headroom::dist
