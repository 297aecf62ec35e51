// A background thread that fills a bounded ring of slots ahead of the consumer (the training
// loop), so data preparation overlaps compute. The slots' memory belongs to the caller (the
// trainer's planned staging region); the prefetcher only says which slot is ready.
//
// Thread safety: one consumer thread calls acquire()/release(); `fill` runs on the prefetcher's
// own thread, one slot at a time, in order. Slots are handed out in the order they were filled.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace headroom::data {

class Prefetcher {
 public:
  // fill(slot) prepares slot `slot` (0 <= slot < depth) and returns a tag kept with it (the
  // trainer stores the data position after that batch). Starts the thread at once.
  Prefetcher(int depth, std::function<int64_t(int slot)> fill);
  ~Prefetcher();  // stops and joins the thread (a fill in progress completes first)
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  struct Ready {
    int slot;
    int64_t tag;
    double waited_ms;  // how long acquire() blocked: the data wait the step saw
  };
  // Blocks until the oldest filled slot is ready and returns it. REQUIRES: the previous slot was
  // released.
  Ready acquire();
  // Gives the slot back to be filled again.
  void release(int slot);

  int depth() const { return depth_; }
  // Slots filled and not yet acquired (for tests and logs).
  int ready_count() const;

 private:
  void run();

  const int depth_;
  std::function<int64_t(int)> fill_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int64_t> tags_;
  int64_t filled_ = 0;    // slots filled so far (slot = index % depth)
  int64_t acquired_ = 0;  // slots handed to the consumer
  int64_t released_ = 0;  // slots given back
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace headroom::data
