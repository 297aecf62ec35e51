// The prefetching ring: fills ahead up to its depth and no further, hands slots out in order
// with their tags, and hides a slow source when the consumer is slower (checked by ordering,
// not by timing).
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "data/prefetcher.h"

namespace headroom::data {
namespace {

TEST(Prefetcher, FillsAheadUpToItsDepthInOrder) {
  std::vector<int64_t> slots(3, -1);
  std::atomic<int64_t> produced{0};
  std::mutex mu;
  std::condition_variable cv;
  {
    Prefetcher p(3, [&](int slot) {
      int64_t n = produced.fetch_add(1);
      slots[size_t(slot)] = n;  // the "batch": its sequence number
      cv.notify_all();
      return n * 10;  // the tag: e.g. the data position after it
    });
    // With no consumer it fills exactly `depth` slots, then waits for one to be released.
    while (p.ready_count() < 3) std::this_thread::yield();
    EXPECT_EQ(p.ready_count(), 3);
    EXPECT_EQ(produced.load(), 3);
    for (int64_t i = 0; i < 10; i++) {
      Prefetcher::Ready r = p.acquire();
      EXPECT_EQ(r.slot, int(i % 3));
      EXPECT_EQ(slots[size_t(r.slot)], i);  // in order, and not overwritten while held
      EXPECT_EQ(r.tag, i * 10);
      p.release(r.slot);
    }
  }  // the destructor stops the thread even while it waits for a free slot
  EXPECT_LE(produced.load(), 13);
}

TEST(Prefetcher, ASlowSourceIsHiddenWhenTheConsumerIsSlower) {
  // The source "costs" one unit per batch, the consumer three: once the ring is full, every
  // acquire finds its batch ready (ready_count > 0 before acquire) after the first.
  std::mutex mu;
  std::condition_variable cv;
  int64_t produced = 0;
  Prefetcher p(2, [&](int) {
    std::lock_guard<std::mutex> lock(mu);
    ++produced;
    cv.notify_all();
    return produced;
  });
  for (int i = 0; i < 6; i++) {
    {
      // Simulated compute: wait until the producer has run ahead (instead of sleeping).
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return produced >= i + 2; });
    }
    EXPECT_GT(p.ready_count(), 0) << i;
    Prefetcher::Ready r = p.acquire();
    EXPECT_EQ(r.tag, i + 1);
    p.release(r.slot);
  }
}

}  // namespace
}  // namespace headroom::data
