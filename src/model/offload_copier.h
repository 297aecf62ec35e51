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

namespace headroom::backend {
class Ops;
}

namespace headroom::model {

class OffloadCopier {
 public:
  // Which side of a copy is the device's memory (the op table's): a saved activation goes out
  // to the offload tier (kToHost: src is the device's), and comes back (kToDevice: dst is).
  // With host memory on both sides (the CPU's table, or none) it changes nothing.
  enum class Direction { kToHost, kToDevice };
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
    Direction direction = Direction::kToHost;
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
  // `ops`: the op table whose memory the device sides of the copies are. Null or a table whose
  // memory the host addresses (the CPU's): every copy is a memcpy. Otherwise (a GPU, the fenced
  // device) the copy thread queues a job's copies with the table's copy_to_host_async /
  // copy_to_device_async and waits for them (wait_copy) before the job counts as done, and the
  // poison hook fills a device source with fill_bytes. REQUIRES: `ops` outlives the copier, and
  // its copies may be called from another thread than its other ops (they are ordered after
  // every op queued before them: a job submitted after the ops that wrote its sources copies
  // what they wrote).
  explicit OffloadCopier(Options options, const backend::Ops* ops = nullptr);

  // One copy, finished on return, as a caller without a copy thread makes it: memcpy, or the
  // table's synchronous copy in `c.direction`.
  static void copy(const backend::Ops* ops, const Copy& c);
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
  const backend::Ops* ops_;  // null: host memory on both sides
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
