// trace.json in the Chrome trace event format, streamed, plus the helpers that all three writers
// share (JSON text, atomic files, the timeline). See docs/notes/report.md.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <map>
#include <tuple>
#include <unordered_map>

#include "core/utf8.h"
#include "report/json_writer.h"
#include "report/profile.h"

namespace headroom::report {

namespace detail {

void append_json_string(std::string& out, const std::string& s) {
  // JSON text is UTF-8: ill-formed bytes (a path, a prompt, a byte-level token) become U+FFFD
  // (core/utf8.h, docs/notes/json-text.md).
  if (!is_valid_utf8(s)) {
    append_json_string(out, valid_utf8(s));
    return;
  }
  out.push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      // Inside an HTML <script> element "</script>" or "<!--" would end or confuse the element.
      case '<':
        out += "\\u003c";
        break;
      case '>':
        out += "\\u003e";
        break;
      case '&':
        out += "\\u0026";
        break;
      default:
        if (c < 0x20) {
          fmt::format_to(std::back_inserter(out), "\\u{:04x}", c);
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  out.push_back('"');
}

void append_json_number(std::string& out, double v) {
  if (!std::isfinite(v)) {
    out += "null";
    return;
  }
  fmt::format_to(std::back_inserter(out), "{}", v);
}

AtomicFileWriter::AtomicFileWriter(std::string path)
    : path_(std::move(path)), tmp_(fmt::format("{}.tmp.{}", path_, ::getpid())) {}

AtomicFileWriter::~AtomicFileWriter() {
  if (file_ != nullptr) std::fclose(file_);
  if (!committed_) std::remove(tmp_.c_str());
}

Status AtomicFileWriter::open() {
  file_ = std::fopen(tmp_.c_str(), "wb");
  if (file_ == nullptr) {
    return Status::io_error(fmt::format("cannot write '{}': cannot create '{}': {}", path_, tmp_,
                                        std::strerror(errno)));
  }
  // A large buffer: the trace of 10^6 spans is ~200 MB, written in few system calls.
  std::setvbuf(file_, nullptr, _IOFBF, 1 << 20);
  return Status::ok();
}

void AtomicFileWriter::write(std::string& buf) {
  if (!failed_ && file_ != nullptr && !buf.empty()) {
    if (std::fwrite(buf.data(), 1, buf.size(), file_) != buf.size()) {
      failed_ = true;
      saved_errno_ = errno;
    }
  }
  buf.clear();
}

Status AtomicFileWriter::commit() {
  if (file_ == nullptr) return Status::internal(fmt::format("'{}': commit before open", path_));
  if (!failed_ && std::fflush(file_) != 0) {
    failed_ = true;
    saved_errno_ = errno;
  }
  // fsync so that the rename never exposes a file whose data is not on disk yet.
  if (!failed_ && ::fsync(::fileno(file_)) != 0) {
    failed_ = true;
    saved_errno_ = errno;
  }
  if (std::fclose(file_) != 0 && !failed_) {
    failed_ = true;
    saved_errno_ = errno;
  }
  file_ = nullptr;
  if (failed_) {
    return Status::io_error(
        fmt::format("cannot write '{}': {}", path_, std::strerror(saved_errno_)));
  }
  std::error_code ec;
  std::filesystem::rename(tmp_, path_, ec);
  if (ec) {
    return Status::io_error(
        fmt::format("cannot rename '{}' to '{}': {}", tmp_, path_, ec.message()));
  }
  committed_ = true;
  return Status::ok();
}

uint64_t sample_total(const MemorySample& s) {
  uint64_t total = 0;
  for (uint64_t b : s.bytes) total += b;
  return total;
}

long peak_sample(const std::vector<MemorySample>& samples) {
  long best = -1;
  uint64_t best_total = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    uint64_t t = sample_total(samples[i]);
    if (best < 0 || t > best_total) {
      best = static_cast<long>(i);
      best_total = t;
    }
  }
  return best;
}

const std::vector<MemorySample>& resolve_timeline(const Profile& profile,
                                                  std::vector<std::string>* categories,
                                                  std::vector<MemorySample>* storage) {
  if (!profile.memory.empty() || count_memory_events(profile.events) == 0) {
    *categories = profile.memory_categories;
    return profile.memory;
  }
  *storage = memory_timeline_from_events(profile.events, categories);
  return *storage;
}

size_t count_memory_events(const EventLog& log) {
  size_t n = 0;
  for (const Event& e : log.events()) n += is_memory_event(e);
  return n;
}

}  // namespace detail

std::vector<size_t> downsample_indices(const std::vector<double>& totals, size_t max_points) {
  const size_t n = totals.size();
  std::vector<size_t> keep;
  if (n <= max_points || max_points < 4) {
    keep.resize(n);
    for (size_t i = 0; i < n; ++i) keep[i] = i;
    return keep;
  }
  // Two samples per bucket, and the first and last sample may add two more: leave room for them.
  const size_t buckets = (max_points - 2) / 2;
  keep.reserve(2 * buckets + 2);
  keep.push_back(0);
  for (size_t b = 0; b < buckets; ++b) {
    const size_t lo = b * n / buckets, hi = (b + 1) * n / buckets;
    if (lo >= hi) continue;
    size_t imin = lo, imax = lo;
    for (size_t i = lo + 1; i < hi; ++i) {
      if (totals[i] < totals[imin]) imin = i;
      if (totals[i] > totals[imax]) imax = i;  // first maximum: ties keep the earliest
    }
    keep.push_back(std::min(imin, imax));
    keep.push_back(std::max(imin, imax));
  }
  keep.push_back(n - 1);
  std::sort(keep.begin(), keep.end());
  keep.erase(std::unique(keep.begin(), keep.end()), keep.end());
  return keep;
}

namespace {

// The alloc and free events of `log` in timeline order: by time, and at equal times frees first
// (one op's end is the next op's start). Recorded in time order already (one recording thread);
// the stable sort is for merged logs.
std::vector<uint32_t> memory_event_order(const EventLog& log) {
  const std::vector<Event>& events = log.events();
  std::vector<uint32_t> order;
  order.reserve(events.size());
  for (uint32_t i = 0; i < events.size(); ++i) {
    if (detail::is_memory_event(events[i])) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    const Event &x = events[a], &y = events[b];
    return x.t_us < y.t_us ||
           (x.t_us == y.t_us && x.kind == EventKind::kFree && y.kind == EventKind::kAlloc);
  });
  return order;
}

}  // namespace

std::vector<LiveBuffer> live_at_timeline_peak(const EventLog& log) {
  const std::vector<Event>& events = log.events();
  const std::vector<uint32_t> order = memory_event_order(log);
  // The first event after which the total is highest (as peak_sample picks the first maximum).
  uint64_t total = 0, best_total = 0;
  size_t best = SIZE_MAX;
  for (size_t k = 0; k < order.size(); ++k) {
    const Event& e = events[order[k]];
    total = e.kind == EventKind::kAlloc ? total + e.bytes : (e.bytes > total ? 0 : total - e.bytes);
    if (best == SIZE_MAX || total > best_total) {
      best = k;
      best_total = total;
    }
  }
  if (best == SIZE_MAX) return {};
  // Replay to it: a buffer is (name, region, offset); a free ends its latest alloc.
  std::map<std::tuple<uint32_t, uint32_t, uint64_t>, std::vector<uint32_t>> live;
  for (size_t k = 0; k <= best; ++k) {
    const Event& e = events[order[k]];
    auto& slot = live[{e.name, e.region, e.offset}];
    if (e.kind == EventKind::kAlloc) {
      slot.push_back(order[k]);
    } else if (!slot.empty()) {
      slot.pop_back();
    }
  }
  std::vector<uint32_t> alive;
  for (const auto& [key, idx] : live) alive.insert(alive.end(), idx.begin(), idx.end());
  std::sort(alive.begin(), alive.end());  // in allocation order
  std::vector<LiveBuffer> out;
  out.reserve(alive.size());
  for (uint32_t i : alive) {
    const Event& e = events[i];
    out.push_back({log.name(e.name), log.name(e.category), e.bytes, e.offset});
  }
  return out;
}

std::vector<MemorySample> memory_timeline_from_events(const EventLog& log,
                                                      std::vector<std::string>* categories) {
  categories->clear();
  const std::vector<Event>& events = log.events();
  const std::vector<uint32_t> order = memory_event_order(log);
  std::vector<size_t> column(log.names().size() + 1, SIZE_MAX);  // by category id; last: none
  std::vector<uint64_t> current;
  std::vector<MemorySample> out;
  out.reserve(order.size());
  for (uint32_t i : order) {
    const Event& e = events[i];
    const size_t id = e.category < log.names().size() ? e.category : log.names().size();
    if (column[id] == SIZE_MAX) {
      column[id] = categories->size();
      categories->push_back(id < log.names().size() ? log.name(e.category) : "other");
      current.push_back(0);
    }
    uint64_t& c = current[column[id]];
    // A free of more than is live means a missing alloc event; clamp rather than wrap around.
    c = e.kind == EventKind::kAlloc ? c + e.bytes : (e.bytes > c ? 0 : c - e.bytes);
    out.push_back({e.t_us, current});
  }
  for (auto& s : out) s.bytes.resize(categories->size(), 0);
  return out;
}

std::vector<PoolSample> pool_timeline_from_events(const EventLog& log) {
  const std::vector<Event>& events = log.events();
  // The regions that pool blocks serve: a block is named after its region.
  std::vector<uint8_t> pooled(log.names().size() + 1, 0);
  bool any = false;
  for (const Event& e : events) {
    if (!is_pool_event(e.kind)) continue;
    any = true;
    if (e.kind == EventKind::kPoolAcquire && e.name < log.names().size()) pooled[e.name] = 1;
  }
  if (!any) return {};
  auto inside_pool = [&](const Event& e) {
    return e.region < log.names().size() && pooled[e.region];
  };
  std::vector<uint32_t> order;
  for (uint32_t i = 0; i < events.size(); ++i) {
    const Event& e = events[i];
    if (is_pool_event(e.kind) || (detail::is_memory_event(e) && !inside_pool(e)))
      order.push_back(i);
  }
  auto releases = [](EventKind k) {
    return k == EventKind::kFree || k == EventKind::kPoolRelease || k == EventKind::kPoolUnreserve;
  };
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    const Event &x = events[a], &y = events[b];
    return x.t_us < y.t_us || (x.t_us == y.t_us && releases(x.kind) && !releases(y.kind));
  });
  auto sub = [](uint64_t a, uint64_t b) { return b > a ? 0 : a - b; };  // clamp a missing event
  uint64_t reserved = 0, in_use = 0, outside = 0;
  std::vector<PoolSample> out;
  out.reserve(order.size());
  for (uint32_t i : order) {
    const Event& e = events[i];
    switch (e.kind) {
      case EventKind::kPoolReserve:
        reserved += e.bytes;
        break;
      case EventKind::kPoolUnreserve:
        reserved = sub(reserved, e.bytes);
        break;
      case EventKind::kPoolAcquire:
        in_use += e.bytes;
        break;
      case EventKind::kPoolRelease:
        in_use = sub(in_use, e.bytes);
        break;
      case EventKind::kAlloc:
        outside += e.bytes;
        break;
      case EventKind::kFree:
        outside = sub(outside, e.bytes);
        break;
      default:
        break;
    }
    out.push_back({e.t_us, reserved, in_use, outside + reserved});
  }
  return out;
}

PoolSummary summarize_pool(const std::vector<PoolSample>& samples, const EventLog& log) {
  PoolSummary s;
  for (const Event& e : log.events()) {
    s.acquisitions += e.kind == EventKind::kPoolAcquire;
    s.releases += e.kind == EventKind::kPoolRelease;
    s.reserves += e.kind == EventKind::kPoolReserve;
    s.unreserves += e.kind == EventKind::kPoolUnreserve;
  }
  for (const PoolSample& p : samples) {
    s.peak_reserved = std::max(s.peak_reserved, p.reserved);
    s.peak_device = std::max(s.peak_device, p.device);
    if (p.in_use > s.peak_in_use) {
      s.peak_in_use = p.in_use;
      s.reserved_at_peak_in_use = p.reserved;
    }
  }
  if (!samples.empty()) s.final_reserved = samples.back().reserved;
  if (s.reserved_at_peak_in_use > 0) {
    s.fragmentation = 1.0 - double(s.peak_in_use) / double(s.reserved_at_peak_in_use);
  }
  return s;
}

std::map<std::string, double> time_by_category_ms(const std::vector<Span>& spans) {
  std::map<std::string, double> out;
  for (const Span& s : spans) out[s.category] += s.dur_us / 1000.0;
  return out;
}

namespace {

constexpr size_t kFlushBytes = 1 << 20;

// Microseconds with nanosecond resolution; non-finite values (a bug upstream) as 0 so the file
// stays valid JSON.
void append_us(std::string& out, double us) {
  if (!std::isfinite(us)) us = 0;
  fmt::format_to(std::back_inserter(out), "{:.3f}", us);
}

}  // namespace

Status write_trace_json(const Profile& profile, const std::string& path) {
  detail::AtomicFileWriter file(path);
  HR_RETURN_IF_ERROR(file.open());
  std::string buf;
  buf.reserve(kFlushBytes + 4096);
  using detail::append_json_string;

  {
    detail::JsonWriter j(buf);
    j.begin_object();
    j.field("displayTimeUnit", "ms");
    j.key("otherData");
    j.begin_object();
    j.field("title", profile.title);
    j.field("model", profile.model);
    j.field("device", profile.device);
    j.field("run", profile.run);
    j.end_object();
  }
  buf += ",\n\"traceEvents\":[\n";

  // Metadata ("M" events): the process and one name per thread that appears.
  auto metadata = [&](const char* name, int tid, const char* arg, auto value) {
    detail::JsonWriter j(buf);
    j.begin_object();
    j.field("name", name);
    j.field("ph", "M");
    j.field("pid", 1);
    j.field("tid", tid);
    j.key("args");
    j.begin_object();
    j.field(arg, value);
    j.end_object();
    j.end_object();
  };
  metadata("process_name", 0, "name", profile.title);
  std::map<int, std::string> threads = profile.thread_names;
  if (threads.empty()) {
    threads = {{kThreadCompute, "compute"}, {kThreadCopy, "copy"}, {kThreadData, "data loader"}};
  }
  for (const Span& s : profile.spans) {
    if (!threads.count(s.thread)) threads[s.thread] = fmt::format("thread {}", s.thread);
  }
  size_t memory_events = 0;  // alloc/free and pool events: the instant events below
  for (const Event& e : profile.events.events()) {
    memory_events += detail::is_memory_event(e) || is_pool_event(e.kind);
  }
  if (memory_events && !threads.count(kThreadMemory)) threads[kThreadMemory] = "memory events";
  for (const auto& [tid, name] : threads) {
    buf += ",\n";
    metadata("thread_name", tid, "name", name);
    buf += ",\n";
    metadata("thread_sort_index", tid, "sort_index", tid);
  }

  for (const Span& s : profile.spans) {
    buf += ",\n{\"name\":";
    append_json_string(buf, s.name);
    buf += ",\"cat\":";
    append_json_string(buf, s.category);
    buf += ",\"ph\":\"X\",\"ts\":";
    append_us(buf, s.start_us);
    buf += ",\"dur\":";
    append_us(buf, s.dur_us);
    fmt::format_to(std::back_inserter(buf), ",\"pid\":1,\"tid\":{},\"args\":{{", s.thread);
    const char* sep = "";
    if (s.step >= 0) {
      fmt::format_to(std::back_inserter(buf), "\"step\":{}", s.step);
      sep = ",";
    }
    if (s.micro_batch >= 0) {
      fmt::format_to(std::back_inserter(buf), "{}\"micro_batch\":{}", sep, s.micro_batch);
      sep = ",";
    }
    if (s.layer >= 0) fmt::format_to(std::back_inserter(buf), "{}\"layer\":{}", sep, s.layer);
    buf += "}}";
    if (buf.size() >= kFlushBytes) file.write(buf);
  }

  // One counter event per sample, one argument per category: chrome://tracing stacks them,
  // Perfetto shows one track per category.
  std::vector<std::string> categories;
  std::vector<MemorySample> derived;
  const auto& samples = detail::resolve_timeline(profile, &categories, &derived);
  std::vector<std::string> keys;
  for (const auto& c : categories) {
    std::string k;
    append_json_string(k, c);
    keys.push_back(std::move(k));
  }
  for (const MemorySample& m : samples) {
    buf += ",\n{\"name\":\"device memory\",\"cat\":\"memory\",\"ph\":\"C\",\"ts\":";
    append_us(buf, m.t_us);
    buf += ",\"pid\":1,\"tid\":0,\"args\":{";
    for (size_t i = 0; i < keys.size(); ++i) {
      if (i) buf.push_back(',');
      buf += keys[i];
      fmt::format_to(std::back_inserter(buf), ":{}", i < m.bytes.size() ? m.bytes[i] : 0);
    }
    buf += "}}";
    if (buf.size() >= kFlushBytes) file.write(buf);
  }

  // The pool (the step region's blocks): what it holds from the device and what it has handed out,
  // and what the device holds (buffers outside pool blocks plus the pool's reserved bytes).
  for (const PoolSample& ps : pool_timeline_from_events(profile.events)) {
    buf += ",\n{\"name\":\"pool\",\"cat\":\"memory\",\"ph\":\"C\",\"ts\":";
    append_us(buf, ps.t_us);
    fmt::format_to(std::back_inserter(buf),
                   ",\"pid\":1,\"tid\":0,\"args\":{{\"reserved\":{},\"in_use\":{}}}}}", ps.reserved,
                   ps.in_use);
    buf += ",\n{\"name\":\"device reserved\",\"cat\":\"memory\",\"ph\":\"C\",\"ts\":";
    append_us(buf, ps.t_us);
    fmt::format_to(std::back_inserter(buf), ",\"pid\":1,\"tid\":0,\"args\":{{\"bytes\":{}}}}}",
                   ps.device);
    if (buf.size() >= kFlushBytes) file.write(buf);
  }

  // Every allocation and release (and every pool block and chunk) as a thread-scoped instant
  // event: name = buffer, cat = alloc, free or pool_*, the rest in args. Names are escaped once
  // each, not once per event.
  if (memory_events) {
    const EventLog& log = profile.events;
    std::vector<std::string> quoted(log.names().size());
    for (size_t i = 0; i < quoted.size(); ++i) append_json_string(quoted[i], log.names()[i]);
    auto q = [&](uint32_t id) -> const std::string& {
      static const std::string kEmpty = "\"\"";
      return id < quoted.size() ? quoted[id] : kEmpty;
    };
    for (const Event& e : log.events()) {
      if (!detail::is_memory_event(e) && !is_pool_event(e.kind)) continue;
      buf += ",\n{\"name\":";
      buf += q(e.name);
      fmt::format_to(std::back_inserter(buf), ",\"cat\":\"{}\"", event_kind_name(e.kind));
      buf += ",\"ph\":\"i\",\"s\":\"t\",\"ts\":";
      append_us(buf, e.t_us);
      fmt::format_to(std::back_inserter(buf),
                     ",\"pid\":1,\"tid\":{},\"args\":{{\"bytes\":{},\"offset\":{},\"category\":",
                     kThreadMemory, e.bytes, e.offset);
      buf += q(e.category);
      buf += ",\"region\":";
      buf += q(e.region);
      if (e.op >= 0) {
        fmt::format_to(std::back_inserter(buf), ",\"op_index\":{},\"op\":", e.op);
        buf += q(e.op_name);
      }
      if (e.phase != EventPhase::kNone) {
        fmt::format_to(std::back_inserter(buf), ",\"phase\":\"{}\"", event_phase_name(e.phase));
      }
      if (e.layer >= 0) fmt::format_to(std::back_inserter(buf), ",\"layer\":{}", e.layer);
      if (e.step >= 0) fmt::format_to(std::back_inserter(buf), ",\"step\":{}", e.step);
      if (e.micro_batch >= 0) {
        fmt::format_to(std::back_inserter(buf), ",\"micro_batch\":{}", e.micro_batch);
      }
      buf += "}}";
      if (buf.size() >= kFlushBytes) file.write(buf);
    }
  }

  // Markers: global instant events.
  for (const Marker& mk : profile.markers) {
    buf += ",\n";
    detail::JsonWriter j(buf);
    j.begin_object();
    j.field("name", mk.name);
    j.field("cat", "marker");
    j.field("ph", "i");
    j.field("s", "g");
    j.field("ts", std::isfinite(mk.t_us) ? mk.t_us : 0.0);
    j.field("pid", 1);
    j.field("tid", 0);
    j.key("args");
    j.begin_object();
    j.field("detail", mk.detail);
    if (!mk.cause.empty()) j.field("cause", mk.cause);
    j.end_object();
    j.end_object();
  }
  buf += "\n]}\n";
  file.write(buf);
  return file.commit();
}

}  // namespace headroom::report
