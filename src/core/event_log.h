// The event stream of a profiled run (DESIGN.md, core: "event sink"): every allocation and release
// of a buffer and every op's begin and end, with the op, phase, layer, micro-batch, step and time.
// Recording appends one fixed-size record to a vector (names are interned once, by index); code
// that does not record holds a null EventRecorder* and pays one pointer check. The report layer
// turns the log into the timeline, trace.json and report.html. See docs/notes/report.md.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace headroom {

// kMarker: a point event (a re-plan); its `name` is the marker's name, its `category` the detail,
// its `region` the cause ("budget", "out of memory", "resume").
// kPoolAcquire / kPoolRelease: a block handed out by / given back to a pool (the step region, once
// per micro-batch); kPoolReserve / kPoolUnreserve: a chunk the pool took from / handed back to its
// upstream. The planned buffers inside a pool block have their own alloc/free events, so pool
// events are not part of the bytes-by-category timeline: they give the pool's reserved and in-use
// bytes (fragmentation) beside it.
enum class EventKind : uint8_t {
  kAlloc,
  kFree,
  kOpBegin,
  kOpEnd,
  kMarker,
  kPoolAcquire,
  kPoolRelease,
  kPoolReserve,
  kPoolUnreserve
};
// "alloc", "free", "op_begin", "op_end", "marker", "pool_acquire", "pool_release",
// "pool_reserve", "pool_unreserve".
std::string_view event_kind_name(EventKind k);
inline bool is_pool_event(EventKind k) {
  return k == EventKind::kPoolAcquire || k == EventKind::kPoolRelease ||
         k == EventKind::kPoolReserve || k == EventKind::kPoolUnreserve;
}

// Where in a training step an event happened. kData: waiting for and loading the batches.
enum class EventPhase : uint8_t { kNone, kForward, kBackward, kOptimizer, kValidation, kData };
std::string_view event_phase_name(EventPhase p);  // "", "forward", "backward", ..., "data"

// The thread an event happened on, as the trace's thread ids (report/profile.h): the training
// thread, activation offload's copy thread, and the prefetching loader's.
constexpr uint8_t kEventThreadTraining = 0;
constexpr uint8_t kEventThreadCopy = 1;
constexpr uint8_t kEventThreadLoader = 2;

// One event, 56 bytes. Strings are indices into EventLog::names(); UINT32_MAX
// (EventLog::kNoName) means none.
struct Event {
  double t_us = 0;      // microseconds since the start of the run
  uint64_t bytes = 0;   // alloc/free: the buffer's size; 0 for op events
  uint64_t offset = 0;  // alloc/free: offset in its region (arena), or the pool's offset
  // The buffer (alloc/free) or the op (op_begin/op_end).
  uint32_t name = UINT32_MAX;
  // alloc/free: the memory category ("activations", ...) and the arena or pool ("step",
  // "parameters"); none for op events.
  uint32_t category = UINT32_MAX;
  uint32_t region = UINT32_MAX;
  // The op of the schedule that was running (the one that allocates, frees, begins or ends):
  // its index (-1: none) and its name.
  int32_t op = -1;
  uint32_t op_name = UINT32_MAX;
  int32_t step = -1;         // optimizer step (0-based); -1 before the first
  int16_t micro_batch = -1;  // within the step; -1 outside a training micro-batch
  int16_t layer = -1;        // transformer block; -1 for embedding, head, and others
  EventKind kind = EventKind::kAlloc;
  EventPhase phase = EventPhase::kNone;
  uint8_t thread = kEventThreadTraining;
};
static_assert(sizeof(Event) == 56);

// Events in the order they were recorded (time order per thread: the loader's ops are appended by
// the training thread when it takes their batches, so they may come after later events), and the
// interned strings they refer to. Not thread-safe.
class EventLog {
 public:
  static constexpr uint32_t kNoName = UINT32_MAX;

  // The index of `s`, adding it on first use. Costs a hash lookup: intern at setup, not per event.
  uint32_t intern(std::string_view s);
  // The string of an index from intern(); "" for kNoName. REQUIRES: id < names().size() or kNoName.
  const std::string& name(uint32_t id) const;
  // The index of `s` if it was interned, else kNoName.
  uint32_t find(std::string_view s) const;
  const std::vector<std::string>& names() const { return names_; }

  void reserve(size_t events) { events_.reserve(events); }
  void append(const Event& e) { events_.push_back(e); }
  const std::vector<Event>& events() const { return events_; }
  size_t size() const { return events_.size(); }
  bool empty() const { return events_.empty(); }
  void clear_events() { events_.clear(); }

 private:
  std::vector<std::string> names_;
  std::unordered_map<std::string, uint32_t> ids_;
  std::vector<Event> events_;
};

// The step schedule in the recorder's terms: the ops in execution order and, for each planned
// buffer of the step region, its lifetime [first_op, last_op] (indices into `ops`), size, offset.
struct ScheduleOp {
  uint32_t name = EventLog::kNoName;
  EventPhase phase = EventPhase::kNone;
  int16_t layer = -1;
};
struct ScheduleBuffer {
  uint32_t name = EventLog::kNoName, category = EventLog::kNoName, region = EventLog::kNoName;
  uint64_t bytes = 0, offset = 0;
  int32_t first_op = 0, last_op = 0;  // REQUIRES: 0 <= first_op <= last_op < ops.size()
};

// Turns op boundaries into events: when the executor crosses a boundary, it records the end of one
// op and the begin of the next, and, inside a training micro-batch, the release of every buffer
// whose last op just ended and the allocation of every buffer whose first op begins. So each
// planned buffer is allocated and released exactly once per micro-batch, at its planned offset.
// Order at a boundary: frees, op_end, op_begin, allocs (so at equal times frees come first).
// Amortised O(1) per event, no allocation beyond the log's vector. Not thread-safe.
class EventRecorder {
 public:
  EventLog& log() { return log_; }
  const EventLog& log() const { return log_; }

  // Replaces the schedule (at setup, and after a re-plan). Buffers still live under the old
  // schedule are released first at `t_us`.
  void set_schedule(std::vector<ScheduleOp> ops, std::vector<ScheduleBuffer> buffers,
                    double t_us = 0);
  const std::vector<ScheduleOp>& ops() const { return ops_; }
  const std::vector<ScheduleBuffer>& buffers() const { return buffers_; }

  // The ops that follow belong to training micro-batch `micro_batch` of optimizer step `step`,
  // until the schedule's last op ends. Outside a micro-batch (validation) ops are recorded with
  // phase kValidation and micro_batch -1, and no memory events. Buffers left live by an
  // interrupted micro-batch are released first (at the last recorded time).
  void begin_micro_batch(int step, int micro_batch);
  bool in_micro_batch() const { return in_micro_batch_; }

  // The executor ended op `ended` and begins op `next` at `t_us` (-1: none). Indices into ops().
  void op_boundary(int ended, int next, double t_us);

  // A buffer outside the schedule (a persistent region, a pool block), in the current context.
  void alloc(double t_us, uint32_t name, uint32_t category, uint32_t region, uint64_t bytes,
             uint64_t offset);
  void free(double t_us, uint32_t name, uint32_t category, uint32_t region, uint64_t bytes,
            uint64_t offset);
  // A point event in the current context ("re-plan", "step region re-planned: ...", and what
  // caused it: "budget", "out of memory", "resume"). Interns the strings: for rare events.
  // `step`: the optimizer step it belongs to; kCurrentStep: the current context's.
  static constexpr int kCurrentStep = -2;
  void marker(double t_us, std::string_view name, std::string_view detail,
              std::string_view cause = {}, int step = kCurrentStep);

  // An op outside the schedule (the optimizer step and its parts, waiting for data, the loader
  // filling a batch): its begin or end, with op index -1, no layer and no micro-batch. `step` is
  // the optimizer step it belongs to. Ops of one thread nest (begin/end pairs match by name).
  void begin_op(double t_us, uint32_t name, EventPhase phase, int step,
                uint8_t thread = kEventThreadTraining);
  void end_op(double t_us, uint32_t name, EventPhase phase, int step,
              uint8_t thread = kEventThreadTraining);

  // Pool events (kind: one of the kPool* kinds) are recorded with the pool context: the step and
  // micro-batch whose block is acquired and released (-1: validation's), set before acquiring.
  void set_pool_context(int step, int micro_batch) {
    pool_step_ = step;
    pool_micro_batch_ = micro_batch;
  }
  void pool_event(EventKind kind, double t_us, uint32_t name, uint32_t category, uint32_t region,
                  uint64_t bytes, uint64_t offset);

 private:
  Event context(double t_us, EventKind kind) const;
  // An alloc or free of a planned buffer, in the current context.
  void append_buffer_event(EventKind kind, double t_us, const ScheduleBuffer& b);
  void release_live(double t_us);

  EventLog log_;
  std::vector<ScheduleOp> ops_;
  std::vector<ScheduleBuffer> buffers_;
  // Buffers that begin / end at each op (CSR: indices into buffers_ of op i are in
  // [*_start_[i], *_start_[i + 1]) of *_list_).
  std::vector<uint32_t> begin_start_, begin_list_, end_start_, end_list_;
  std::vector<uint8_t> live_;
  size_t live_count_ = 0;
  bool in_micro_batch_ = false;
  int step_ = -1, micro_batch_ = -1;
  int cur_op_ = -1;
  int pool_step_ = -1, pool_micro_batch_ = -1;
};

}  // namespace headroom
