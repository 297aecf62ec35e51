// memory.json: the report's figures for scripts (the same object report.html embeds).
#include <fmt/format.h>

#include <iterator>

#include "report/json_writer.h"
#include "report/profile.h"

namespace headroom::report {

namespace {

using Json = detail::JsonWriter;

void write_bytes_map(Json& j, const std::map<std::string, uint64_t>& m) {
  j.begin_object();
  for (const auto& [k, v] : m) j.field(k, v);
  j.end_object();
}

void write_candidate(Json& j, const PlanCandidate& c) {
  j.begin_object();
  j.field("micro_batch", c.micro_batch);
  j.field("accumulation", c.accumulation);
  j.field("precision", c.precision);
  j.field("techniques", c.techniques);
  j.field("peak_bytes", c.peak_bytes);
  j.field("lower_bound_bytes", c.lower_bound_bytes);
  j.field("predicted_tokens_per_s", c.predicted_tokens_per_s);
  j.key("by_category");
  write_bytes_map(j, c.by_category);
  j.end_object();
}

}  // namespace

namespace detail {

std::string figures_json(const Profile& p) {
  std::string out;
  Json j(out);
  j.begin_object();
  j.field("title", p.title);
  j.field("model", p.model);
  j.field("device", p.device);
  j.field("run", p.run);
  j.field("peak_bytes", p.peak_bytes);
  j.field("planned_peak_bytes", p.planned_peak_bytes);
  j.field("budget_bytes", p.budget_bytes);
  j.field("arena_bytes", p.arena_bytes);
  j.field("lower_bound_bytes", p.lower_bound_bytes);
  // Fragmentation as the arena's overhead over the lower bound: 1.0 is a perfect packing.
  j.key("fragmentation");
  if (p.lower_bound_bytes > 0) {
    j.value(static_cast<double>(p.arena_bytes) / static_cast<double>(p.lower_bound_bytes));
  } else {
    j.null();
  }

  // Bytes by category at the measured peak (from the timeline), and what the plan predicted.
  std::vector<std::string> categories;
  std::vector<MemorySample> derived;
  const auto& samples = resolve_timeline(p, &categories, &derived);
  const long peak = peak_sample(samples);
  j.key("timeline_peak");
  if (peak >= 0) {
    const MemorySample& s = samples[static_cast<size_t>(peak)];
    j.begin_object();
    j.field("t_us", s.t_us);
    j.field("bytes", sample_total(s));
    j.key("by_category");
    j.begin_object();
    for (size_t i = 0; i < categories.size(); ++i) {
      j.field(categories[i], i < s.bytes.size() ? s.bytes[i] : uint64_t{0});
    }
    j.end_object();
    j.end_object();
  } else {
    j.null();
  }
  // The pool that serves the step region: reserved vs in use (its fragmentation), and the device
  // line (buffers outside the pool plus the pool's reserved bytes). Null without pool events.
  j.key("pool");
  const std::vector<PoolSample> pool = pool_timeline_from_events(p.events);
  if (pool.empty()) {
    j.null();
  } else {
    const PoolSummary ps = summarize_pool(pool, p.events);
    j.begin_object();
    j.field("block_acquisitions", ps.acquisitions);
    j.field("block_releases", ps.releases);
    j.field("chunks_reserved", ps.reserves);
    j.field("chunks_unreserved", ps.unreserves);
    j.field("peak_reserved_bytes", ps.peak_reserved);
    j.field("peak_in_use_bytes", ps.peak_in_use);
    j.field("reserved_at_peak_in_use_bytes", ps.reserved_at_peak_in_use);
    j.field("final_reserved_bytes", ps.final_reserved);
    j.field("peak_device_bytes", ps.peak_device);
    j.field("fragmentation", ps.fragmentation);
    j.end_object();
  }
  j.key("planned_by_category");
  write_bytes_map(j, p.plan.chosen.by_category);

  j.key("live_at_peak");
  j.begin_array();
  for (const LiveBuffer& b : p.live_at_peak) {
    j.begin_object();
    j.field("name", b.name);
    j.field("category", b.category);
    j.field("bytes", b.bytes);
    j.field("offset", b.offset);
    j.end_object();
  }
  j.end_array();

  j.key("sweep");
  j.begin_array();
  for (const SweepRow& r : p.sweep) {
    j.begin_object();
    j.field("micro_batch", r.micro_batch);
    j.field("planned_peak_bytes", r.planned_peak);
    j.optional_field("measured_peak_bytes", r.measured_peak);
    j.field("predicted_tokens_per_s", r.predicted_tokens_per_s);
    j.optional_field("measured_tokens_per_s", r.measured_tokens_per_s);
    j.field("fits", r.fits);
    j.field("techniques", r.techniques);
    j.end_object();
  }
  j.end_array();

  j.key("time_by_category_ms");
  j.begin_object();
  const auto times =
      p.time_by_category_ms.empty() ? time_by_category_ms(p.spans) : p.time_by_category_ms;
  for (const auto& [k, v] : times) j.field(k, v);
  j.end_object();
  j.key("predicted_time_by_category_ms");
  j.begin_object();
  for (const auto& [k, v] : p.predicted_time_by_category_ms) j.field(k, v);
  j.end_object();

  j.key("plan");
  j.begin_object();
  j.key("chosen");
  write_candidate(j, p.plan.chosen);
  j.key("runners_up");
  j.begin_array();
  for (const auto& c : p.plan.runners_up) write_candidate(j, c);
  j.end_array();
  j.field("planning_ms", p.plan.planning_ms);
  j.end_object();

  j.key("markers");
  j.begin_array();
  for (const Marker& m : p.markers) {
    j.begin_object();
    j.field("t_us", m.t_us);
    j.field("name", m.name);
    j.field("detail", m.detail);
    j.field("cause", m.cause);
    j.end_object();
  }
  j.end_array();

  j.key("counts");
  j.begin_object();
  j.field("spans", static_cast<uint64_t>(p.spans.size()));
  uint64_t memory_events = 0, pool_events = 0, op_events = 0;
  for (const Event& e : p.events.events()) {
    memory_events += is_memory_event(e);
    pool_events += is_pool_event(e.kind);
    op_events += e.kind == EventKind::kOpBegin || e.kind == EventKind::kOpEnd;
  }
  j.field("alloc_events", memory_events);  // allocations and releases
  j.field("pool_events", pool_events);
  j.field("op_events", op_events);
  j.field("memory_samples", static_cast<uint64_t>(samples.size()));
  j.field("markers", static_cast<uint64_t>(p.markers.size()));
  j.end_object();
  j.end_object();
  return out;
}

}  // namespace detail

Status write_memory_json(const Profile& profile, const std::string& path) {
  detail::AtomicFileWriter file(path);
  HR_RETURN_IF_ERROR(file.open());
  std::string text = detail::figures_json(profile);
  text.push_back('\n');
  file.write(text);
  return file.commit();
}

}  // namespace headroom::report
