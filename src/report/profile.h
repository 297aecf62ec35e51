// What `headroom train --profile DIR` writes: trace.json (Chrome trace events, for Perfetto and
// chrome://tracing), report.html (self-contained, offline) and memory.json (the same figures for
// scripts). The report layer sees only the plain structs below, never train/, model/ or plan/
// types: the trainer fills a Profile and calls the writers. See docs/notes/report.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/event_log.h"
#include "core/status.h"

namespace headroom::report {

// Units, everywhere in this file: times in microseconds (double) since the start of the profiled
// run; sizes in bytes; rates in tokens per second. Category names are the memory layer's
// ("weights", "grads", "optimizer", "master", "activations", "recompute", "workspace", "logits",
// "comm", "staging", "offload", "kv_cache", "other") for memory, and op categories ("gemm",
// "attention", "norm", "elementwise", "loss", "optimizer", "comm", "copy", "data", ...) for spans.

// Thread ids of the trace (Chrome's `tid`). Other ids are allowed; name them in
// Profile::thread_names.
constexpr int kThreadCompute = 0;
constexpr int kThreadCopy = 1;
constexpr int kThreadData = 2;
constexpr int kThreadMemory = 3;  // the alloc/free instant events of Profile::events

// One op or piece of work on one thread: a "complete" event in the trace.
struct Span {
  std::string name;      // "block3.attn.fwd", "adamw", "load micro-batch"
  std::string category;  // op category (see above)
  int thread = kThreadCompute;
  double start_us = 0;
  double dur_us = 0;
  int step = -1;         // optimizer step, -1 if not applicable
  int micro_batch = -1;  // micro-batch index within the step, -1 if not applicable
  int layer = -1;        // transformer block, -1 if not applicable
};

// Device bytes in use at one moment, by memory category. `bytes[i]` belongs to
// Profile::memory_categories[i] (a sample may be shorter: missing columns are 0).
struct MemorySample {
  double t_us = 0;
  std::vector<uint64_t> bytes;
};

// A point event: a re-plan, an out-of-memory recovery, a checkpoint.
struct Marker {
  double t_us = 0;
  std::string name;    // "re-plan", "plan kept", "resume", "oom-recovery"
  std::string detail;  // "micro-batch 8 -> 4 (accumulation 2 -> 4)"
  std::string cause;   // "budget", "out of memory", "resume"; empty if not known
};

// The pool that serves a region at run time (the step region, once per micro-batch), from the
// pool events of the log: what it holds from its upstream (reserved) and what it has handed out
// (in_use), and what the device holds: the bytes of the planned buffers outside pool blocks plus
// the pool's reserved bytes (`device`; the planned buffers inside pool blocks are counted once,
// as the block's reserved bytes). The gap between `device` and the stacked timeline is memory
// reserved but not holding a live buffer.
struct PoolSample {
  double t_us = 0;
  uint64_t reserved = 0, in_use = 0, device = 0;
};

// One configuration the planner priced.
struct PlanCandidate {
  int micro_batch = 0;
  int accumulation = 0;
  std::string precision;   // "fp32", "bf16"
  std::string techniques;  // "recompute=selective attention=tiled"
  uint64_t peak_bytes = 0;
  uint64_t lower_bound_bytes = 0;
  double predicted_tokens_per_s = 0;
  std::map<std::string, uint64_t> by_category;  // bytes at the planned peak
};

// The plan that ran and the best of the others (fastest first), with the search's time.
struct PlanSummary {
  PlanCandidate chosen;
  std::vector<PlanCandidate> runners_up;
  double planning_ms = 0;
};

// One micro-batch size of the planner's sweep; measured values where that size was run.
struct SweepRow {
  int micro_batch = 0;
  uint64_t planned_peak = 0;
  std::optional<uint64_t> measured_peak;
  double predicted_tokens_per_s = 0;
  std::optional<double> measured_tokens_per_s;
  bool fits = true;  // planned_peak within the budget
  // The plan's techniques at this micro-batch ("tiled attention, fused LM head, recompute full"):
  // the planned peak jumps between two points where they change.
  std::string techniques;
};

// A buffer live at the peak.
struct LiveBuffer {
  std::string name;
  std::string category;
  uint64_t bytes = 0;
  uint64_t offset = 0;
};

struct Profile {
  // Description, shown in the report's header and copied to memory.json.
  std::string title = "headroom profile";
  std::string model;   // "gpt2 (124M)"
  std::string device;  // "cpu (budget 8.00 GiB)"
  std::string run;     // free text: "seq 1024, global batch 32, 4 steps"

  std::vector<Span> spans;
  // The recorded event stream (core/event_log.h): every allocation and release with its buffer,
  // category, bytes, offset, region, op, phase, layer, micro-batch and step. Its op_begin/op_end
  // events are not drawn (spans are); its alloc/free events become trace.json instant events and,
  // when `memory` is empty, the memory timeline (memory_timeline_from_events).
  EventLog events;
  std::vector<std::string> memory_categories;  // column names of MemorySample::bytes
  std::vector<MemorySample> memory;            // in time order
  std::vector<Marker> markers;
  std::map<int, std::string> thread_names;  // empty: compute, copy, data loader for 0, 1, 2

  // report.html draws the memory timeline of [window_start_us, window_end_us) only (typically the
  // step with the peak); when window_end_us <= window_start_us it draws all samples.
  double window_start_us = 0;
  double window_end_us = 0;

  PlanSummary plan;
  std::vector<SweepRow> sweep;
  std::vector<LiveBuffer> live_at_peak;

  uint64_t peak_bytes = 0;          // measured device peak
  uint64_t planned_peak_bytes = 0;  // the plan's peak
  uint64_t arena_bytes = 0;         // bytes the arenas reserve (the offset plan's size)
  uint64_t lower_bound_bytes = 0;   // most bytes live at one moment (no allocator can do better)
  uint64_t budget_bytes = 0;        // device memory budget; 0 if unknown
  std::map<std::string, double> time_by_category_ms;  // empty: summed from spans
  // The cost model's time per step of each kind (gemm, ..., optimizer), for the run's plan, to
  // show next to the measured time_by_category_ms of the same names; empty: not drawn.
  std::map<std::string, double> predicted_time_by_category_ms;
};

// Writes the Chrome trace event format: "X" events for spans (pid 1, tid = thread), "C" counter
// events "device memory" with one argument per memory category (bytes), "i" thread instant
// events (tid kThreadMemory, cat "alloc" or "free") for the alloc/free events of
// Profile::events, "i" global instant events for markers, "M" metadata naming the process and
// threads. Streams through a buffer, so 10^6 spans cost no more memory than the Profile itself;
// written atomically (a temporary file renamed over `path`): a reader never sees half a file.
// Errors: IoError naming the path.
Status write_trace_json(const Profile& profile, const std::string& path);

// Writes the figures of the report for scripts: peak, planned peak, budget, arena and lower
// bound, fragmentation, bytes by category at the peak, live buffers at the peak, the sweep, time
// by op category, the plan and its runners-up, marker list. Atomic like the trace.
Status write_memory_json(const Profile& profile, const std::string& path);

// The charting library inlined into report.html (Chart.js's UMD build).
struct ChartLib {
  std::string js;
};

// The data directory's chartlib/chart.umd.min.js (core/data_dir.h: $HEADROOM_DATA_DIR, the
// installed share/headroom, the source tree's third_party/chartlib/node_modules/chart.js/dist/,
// where scripts/get-chart-lib installs it), or "" where there is none.
std::string default_chart_lib_path();

// Reads the library. Errors: NotFound naming the path and "run scripts/get-chart-lib".
Result<ChartLib> load_chart_lib(const std::string& js_path);

// Reads the data directory's library. Errors: NotFound listing every place looked at.
Result<ChartLib> load_chart_lib();

// Writes one self-contained HTML file (no network, no other files): the library inlined, the data
// as an inline JSON blob, and charts: the memory timeline stacked by category with the peak
// marked and the buffers live at the peak; planned and measured memory versus micro-batch (chart
// and table); throughput versus micro-batch; the plan and runners-up; fragmentation; time per op
// category. The timeline (the window) and its overview (the whole run) are downsampled to at most
// kMaxTimelinePoints samples, keeping each bucket's highest (and lowest) sample, so the peak
// survives and 10^6 events open in seconds; the whole timeline also goes in at full resolution
// (up to kMaxDetailChanges changes, 10 bytes each) for zooming in. Each chart's container gets
// data-rendered="1" once drawn and the body records page errors in data-errors (see
// tests/report/browser_test.sh and docs/notes/report.md). Atomic like the trace.
Status write_html_report(const Profile& profile, const std::string& path,
                         const std::string& chart_lib_js);

constexpr size_t kMaxTimelinePoints = 5000;
// Above this many changes of the timeline (about one per alloc/free event) report.html keeps only
// the downsampled timeline: zooming then shows no more detail than the overview.
constexpr size_t kMaxDetailChanges = 4'000'000;

// Indices (ascending) of the samples to keep so that at most `max_points` remain: the series is
// cut into max_points / 2 buckets and each keeps its lowest and highest value (first and last
// sample kept too). The global maximum is always kept. All indices when totals.size() <=
// max_points. REQUIRES: max_points >= 4.
std::vector<size_t> downsample_indices(const std::vector<double>& totals, size_t max_points);

// The bytes-by-category timeline implied by the log's alloc and free events (sorted by time,
// frees first at equal times; categories in first-seen order into `categories`). One sample per
// alloc or free event.
std::vector<MemorySample> memory_timeline_from_events(const EventLog& events,
                                                      std::vector<std::string>* categories);

// One sample per pool event and per alloc/free of a buffer outside pool blocks, in time order
// (frees and releases first at equal times). Empty when the log has no pool events.
std::vector<PoolSample> pool_timeline_from_events(const EventLog& events);

// The pool's figures over the run: acquisitions and releases of blocks, the most bytes reserved
// and in use, the device line's peak, and fragmentation = 1 - in use / reserved at the moment
// the pool's blocks in use were largest (0 when every reserved byte serves a block then).
struct PoolSummary {
  uint64_t acquisitions = 0, releases = 0, reserves = 0, unreserves = 0;
  uint64_t peak_reserved = 0, peak_in_use = 0, reserved_at_peak_in_use = 0, final_reserved = 0;
  uint64_t peak_device = 0;
  double fragmentation = 0;
};
PoolSummary summarize_pool(const std::vector<PoolSample>& samples, const EventLog& events);

// The buffers live at the peak of memory_timeline_from_events(events): the allocations not yet
// released after the event whose sample is the (first) peak. Empty without memory events.
std::vector<LiveBuffer> live_at_timeline_peak(const EventLog& events);

// Milliseconds per span category, summed over spans (what report.html shows when
// Profile::time_by_category_ms is empty).
std::map<std::string, double> time_by_category_ms(const std::vector<Span>& spans);

// Internals shared by the writers.
namespace detail {

// Appends `s` as a JSON string literal (quoted, escaped). `<` and `>` become \u003c / \u003e so
// the text is also safe inside an HTML <script> element.
// Ill-formed UTF-8 in `s` becomes U+FFFD (core/utf8.h), as in every JSON the engine writes.
void append_json_string(std::string& out, const std::string& s);
// A JSON number: finite values as the shortest round-trip text, NaN and infinities as null.
void append_json_number(std::string& out, double v);

// The timeline the writers use: profile.memory, or when it is empty one derived from
// profile.events (stored in *storage, categories in *categories).
const std::vector<MemorySample>& resolve_timeline(const Profile& profile,
                                                  std::vector<std::string>* categories,
                                                  std::vector<MemorySample>* storage);
// Alloc and free events (not op or pool events: the planned buffers inside a pool block are
// counted once, by their own alloc/free).
inline bool is_memory_event(const Event& e) {
  return e.kind == EventKind::kAlloc || e.kind == EventKind::kFree;
}
size_t count_memory_events(const EventLog& log);
// Sum of a sample's columns.
uint64_t sample_total(const MemorySample& s);
// Index of the sample with the most bytes (the first such); -1 when empty.
long peak_sample(const std::vector<MemorySample>& samples);

// The figures of memory.json as one JSON object (report.html embeds the same object).
std::string figures_json(const Profile& profile);

// Writes text produced in chunks to `path` atomically: the chunks go to `path`.tmp.<pid> through
// a large stdio buffer, then fsync and rename. On any error the temporary file is removed.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();  // removes the temporary file unless commit() succeeded
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  Status open();
  // Writes `buf` and clears it. Errors are remembered and returned by commit().
  void write(std::string& buf);
  Status commit();

 private:
  std::string path_, tmp_;
  std::FILE* file_ = nullptr;
  bool failed_ = false;
  int saved_errno_ = 0;
  bool committed_ = false;
};

}  // namespace detail

}  // namespace headroom::report
