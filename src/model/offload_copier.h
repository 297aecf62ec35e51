// The copy thread of activation offload: one std::thread that runs queued copies (device step
// buffer -> offload tier, and back) in order while the executor computes, so that transfers
// overlap compute. See docs/notes/offload-activations.md.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace headroom::model {

class OffloadCopier {
 public:
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  // Test hooks (both off in a real run).
  struct Options {
    // Sleep this long before each job: a transfer slower than compute, so that a missing or
    // misplaced wait shows up as wrong results (the executor must wait, not race).
    std::chrono::microseconds delay{0};
    // After copying a job, overwrite its sources with 0xFF bytes (a NaN in fp32 and bf16): the
    // memory is dead once copied, and a reader that still uses it computes NaN.
    bool poison_sources = false;
    // Start a job only once someone waits for it (or the copier stops): every copy then lands
    // as late as the executor allows, deterministically, and every wait blocks.
    bool run_at_wait = false;
  };
  struct Stats {
    uint64_t jobs = 0;
    uint64_t bytes = 0;          // copied, both directions
    double copy_seconds = 0;     // the copy thread busy copying (delay hook excluded)
    double wait_seconds = 0;     // the executor blocked in wait(): transfer time not hidden
    uint64_t blocked_waits = 0;  // wait() calls that found their job not yet done
  };

  OffloadCopier() : OffloadCopier(Options{}) {}
  explicit OffloadCopier(Options options);
  // Finishes the queued jobs, then joins the thread.
  ~OffloadCopier();
  OffloadCopier(const OffloadCopier&) = delete;
  OffloadCopier& operator=(const OffloadCopier&) = delete;

  // Queues one job (its copies run in order, after every earlier job) and returns its ticket
  // (> 0). The caller must not write the sources nor touch the destinations until wait(ticket)
  // returns. Thread safety: submit/wait/stats from any thread.
  uint64_t submit(std::vector<Copy> copies);
  // Blocks until job `ticket` (and so every earlier one) has finished. 0 returns at once.
  void wait(uint64_t ticket);
  Stats stats() const;
  void reset_stats();
  // Profiling (--profile): with recording on, each finished job's copying interval and bytes are
  // kept until take_spans() hands them over (the caller turns them into events of the copy
  // track). Off: nothing is kept.
  struct Span {
    std::chrono::steady_clock::time_point start, end;
    uint64_t bytes = 0;
  };
  void set_record(bool on);
  std::vector<Span> take_spans();

 private:
  void run();

  Options options_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::pair<uint64_t, std::vector<Copy>>> queue_;
  uint64_t next_ticket_ = 1;
  uint64_t done_ticket_ = 0;    // every job up to this one has finished
  uint64_t waited_ticket_ = 0;  // the highest ticket waited for (Options::run_at_wait)
  bool stop_ = false;
  bool record_ = false;
  std::vector<Span> spans_;
  Stats stats_;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace headroom::model
