// The prefetching ring: fills ahead up to its depth and no further, hands slots out in order
// with their tags, and hides a slow source when the consumer is slower (checked by ordering,
// not by timing).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
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

// A source that stalls (a slow disk, a network hiccup) is hidden up to the queue's depth: with
// the ring full when the source stops, the consumer still gets `depth` batches without waiting
// (each is ready before acquire), and only then does the stall show (nothing ready). Checked by
// state, not by timing.
TEST(Prefetcher, AStalledSourceIsHiddenUpToTheQueueDepth) {
  for (int depth : {1, 2, 4}) {
    std::mutex mu;
    std::condition_variable cv;
    int64_t produced = 0;
    bool stalled = false;
    Prefetcher p(depth, [&](int) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return !stalled; });
      ++produced;
      cv.notify_all();
      return produced;
    });
    // The ring fills (every slot handed over); then the source stalls before the consumer frees
    // a slot (until then the loader has nothing to fill).
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (p.ready_count() < depth && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::yield();
    }
    ASSERT_EQ(p.ready_count(), depth) << "the loader did not fill ahead to its depth";
    {
      std::lock_guard<std::mutex> lock(mu);
      stalled = true;
    }
    for (int i = 0; i < depth; i++) {
      EXPECT_GT(p.ready_count(), 0) << "depth " << depth << " batch " << i;
      Prefetcher::Ready r = p.acquire();
      EXPECT_EQ(r.tag, i + 1);
      p.release(r.slot);
    }
    // The queue is spent: the next batch waits for the source.
    EXPECT_EQ(p.ready_count(), 0) << "depth " << depth;
    {
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_EQ(produced, depth);
      stalled = false;
    }
    cv.notify_all();
    Prefetcher::Ready r = p.acquire();
    EXPECT_EQ(r.tag, depth + 1);
    p.release(r.slot);
  }
}

}  // namespace
}  // namespace headroom::data
