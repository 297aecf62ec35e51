// Tests of the profile writers: trace.json parses and has every event kind, memory.json carries
// the figures, report.html is self-contained with a downsampled timeline that keeps the peak, and
// every file is written atomically. tests/report/browser_test.sh opens the page in Chromium.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "report/profile.h"

namespace headroom::report {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

#ifndef HEADROOM_SOURCE_DIR
#define HEADROOM_SOURCE_DIR "."
#endif

constexpr uint64_t kMiB = 1024ull * 1024;

const std::vector<std::string> kMemoryCategories = {
    "weights", "grads", "optimizer", "activations", "workspace", "logits", "staging"};

// A GPT-2-shaped profile: `steps` optimizer steps of `micro_batches` micro-batches through
// `layers` blocks, one span and one memory sample per op, data loading and copies on their own
// threads, a re-plan and an out-of-memory recovery. The peak is at the LM head of the last
// micro-batch of step `peak_step` (its logits are larger).
Profile make_profile(int steps, int micro_batches, int layers, int peak_step = 1) {
  Profile p;
  p.title = "headroom profile: gpt2-small on cpu";
  p.model = "gpt2 (124M), 12 layers, d_model 768";
  p.device = "cpu, budget 8.00 GiB";
  p.run = "seq 1024, micro-batch 4 x 8 accumulation, bf16";
  p.memory_categories = kMemoryCategories;
  const uint64_t weights = 475 * kMiB, grads = 475 * kMiB, optimizer = 950 * kMiB;
  const uint64_t staging = 32 * kMiB, per_layer = 96 * kMiB;
  static const char* kFwd[] = {"ln1", "qkv", "attn", "proj", "ln2", "fc", "gelu", "fc2"};
  static const char* kCat[] = {"norm", "gemm", "attention",   "gemm",
                               "norm", "gemm", "elementwise", "gemm"};
  static const double kDur[] = {40, 220, 310, 90, 40, 350, 60, 340};
  double t = 0;
  uint64_t activations = 0;
  auto sample = [&](uint64_t workspace, uint64_t logits) {
    p.memory.push_back({t, {weights, grads, optimizer, activations, workspace, logits, staging}});
  };
  for (int s = 0; s < steps; ++s) {
    for (int m = 0; m < micro_batches; ++m) {
      // The loader prepares the next micro-batch while this one computes; the copy uploads it.
      p.spans.push_back({"load micro-batch", "data", kThreadData, t, 120, s, m, -1});
      p.spans.push_back({"h2d tokens", "copy", kThreadCopy, t + 120, 30, s, m, -1});
      t += 150;
      for (int l = 0; l < layers; ++l) {
        for (int o = 0; o < 8; ++o) {
          p.spans.push_back({fmt::format("block{}.{}.fwd", l, kFwd[o]), kCat[o], kThreadCompute, t,
                             kDur[o], s, m, l});
          t += kDur[o];
          activations += per_layer / 8;
          sample(o == 2 ? 24 * kMiB : 8 * kMiB, 0);
        }
      }
      const uint64_t logits = (s == peak_step && m == micro_batches - 1) ? 640 * kMiB : 600 * kMiB;
      p.spans.push_back({"lm_head.fwd", "gemm", kThreadCompute, t, 900, s, m, -1});
      t += 900;
      sample(16 * kMiB, logits);
      p.spans.push_back({"loss", "loss", kThreadCompute, t, 200, s, m, -1});
      t += 200;
      sample(16 * kMiB, logits);
      for (int l = layers - 1; l >= 0; --l) {
        for (int o = 7; o >= 0; --o) {
          p.spans.push_back({fmt::format("block{}.{}.bwd", l, kFwd[o]), kCat[o], kThreadCompute, t,
                             2 * kDur[o], s, m, l});
          t += 2 * kDur[o];
          activations -= per_layer / 8;
          sample(o == 2 ? 32 * kMiB : 12 * kMiB, l == layers - 1 && o == 7 ? logits / 2 : 0);
        }
      }
    }
    p.spans.push_back({"adamw", "optimizer", kThreadCompute, t, 1500, s, -1, -1});
    t += 1500;
    sample(4 * kMiB, 0);
  }
  p.markers.push_back({p.memory[p.memory.size() / 3].t_us, "oom-recovery",
                       "allocation of 512.0 MiB failed in lm_head.fwd; re-planning", ""});
  p.markers.push_back({p.memory[p.memory.size() / 3 + 1].t_us, "re-plan",
                       "micro-batch 8 -> 4, accumulation 4 -> 8 (effective batch 32 kept)", ""});
  // The second step is what the page draws.
  if (steps > 1) {
    const double step_len = t / steps;
    p.window_start_us = step_len * peak_step;
    p.window_end_us = step_len * (peak_step + 1);
  }

  const long peak = detail::peak_sample(p.memory);
  p.peak_bytes = detail::sample_total(p.memory[peak]);
  p.planned_peak_bytes = p.peak_bytes;
  p.lower_bound_bytes = p.peak_bytes - 40 * kMiB;
  p.arena_bytes = p.peak_bytes;
  p.budget_bytes = 8192 * kMiB;
  for (int l = 0; l < layers; ++l) {
    for (const char* op : kFwd) {
      p.live_at_peak.push_back({fmt::format("block{}.{}.out", l, op), "activations", per_layer / 8,
                                static_cast<uint64_t>(l) * per_layer});
    }
  }
  p.live_at_peak.push_back({"lm_head.logits", "logits", 640 * kMiB, 0});
  p.live_at_peak.push_back({"wte", "weights", 147 * kMiB, 0});

  PlanCandidate chosen{
      4,     8, "bf16", "recompute=none attention=tiled", p.planned_peak_bytes, p.lower_bound_bytes,
      10450, {}};
  for (size_t i = 0; i < kMemoryCategories.size(); ++i) {
    chosen.by_category[kMemoryCategories[i]] = p.memory[peak].bytes[i];
  }
  p.plan.chosen = chosen;
  p.plan.runners_up = {
      {8, 4, "bf16", "recompute=selective attention=tiled", 3900 * kMiB, 3800 * kMiB, 10100, {}},
      {2, 16, "bf16", "recompute=none attention=tiled", 2700 * kMiB, 2650 * kMiB, 9800, {}},
      {4, 8, "fp32", "recompute=none attention=naive", 5200 * kMiB, 5100 * kMiB, 6100, {}}};
  p.plan.planning_ms = 3.2;
  const int mbs[] = {1, 2, 4, 8, 16, 32};
  for (int mb : mbs) {
    SweepRow r;
    r.micro_batch = mb;
    r.planned_peak = weights + grads + optimizer + staging + mb * 420 * kMiB;
    r.predicted_tokens_per_s = 12000.0 * mb / (mb + 0.8);
    r.fits = r.planned_peak <= p.budget_bytes;
    if (mb == 4) {
      r.measured_peak = p.peak_bytes;
      r.measured_tokens_per_s = 10210;
    } else if (mb == 2) {
      r.measured_peak = r.planned_peak;
      r.measured_tokens_per_s = 8020;
    }
    p.sweep.push_back(r);
  }
  return p;
}

// A fresh directory under the system's temporary directory, removed with the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "hr_report_test.XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path_)) out.push_back(e.path().filename());
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  std::string path_;
};

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string chart_lib_path() {
  return std::string(HEADROOM_SOURCE_DIR) +
         "/third_party/chartlib/node_modules/chart.js/dist/chart.umd.min.js";
}

// The JSON object inside <script type="application/json" id="hr-data">.
json page_data(const std::string& html) {
  const std::string open = "<script type=\"application/json\" id=\"hr-data\">";
  const size_t a = html.find(open);
  EXPECT_NE(a, std::string::npos);
  const size_t b = html.find("</script>", a);
  return json::parse(html.substr(a + open.size(), b - a - open.size()));
}

// A log of a known schedule: "wte" from the start, then per micro-batch three ops over two step
// buffers a0 [op 0, op 2] at offset 0 and a1 [op 1, op 1] at offset 32.
EventLog known_log(int micro_batches) {
  EventRecorder r;
  EventLog& log = r.log();
  const uint32_t act = log.intern("activations"), step = log.intern("step");
  r.set_schedule(
      {{log.intern("fwd0"), EventPhase::kForward, 0},
       {log.intern("fwd1"), EventPhase::kForward, 1},
       {log.intern("bwd0"), EventPhase::kBackward, 0}},
      {{log.intern("a0"), act, step, 30, 0, 0, 2}, {log.intern("a1"), act, step, 50, 32, 1, 1}});
  r.alloc(0, log.intern("wte"), log.intern("weights"), log.intern("parameters"), 100, 0);
  double t = 10;
  for (int m = 0; m < micro_batches; ++m) {
    r.begin_micro_batch(0, m);
    r.op_boundary(-1, 0, t);
    r.op_boundary(0, 1, t + 10);
    r.op_boundary(1, 2, t + 20);
    r.op_boundary(2, -1, t + 30);
    t += 40;
  }
  return log;
}

// known_log with the pool around the step region: a 128-byte chunk reserved at 0, one block
// (named after the region it serves, "step") acquired before and released after each
// micro-batch, the chunk handed back at the end; a re-plan marker with its cause.
EventLog pooled_log(int micro_batches) {
  EventRecorder r;
  EventLog& log = r.log();
  const uint32_t act = log.intern("activations"), step = log.intern("step"),
                 pool = log.intern("pool"), chunk = log.intern("chunk");
  r.set_schedule(
      {{log.intern("fwd0"), EventPhase::kForward, 0},
       {log.intern("fwd1"), EventPhase::kForward, 1},
       {log.intern("bwd0"), EventPhase::kBackward, 0}},
      {{log.intern("a0"), act, step, 30, 0, 0, 2}, {log.intern("a1"), act, step, 50, 32, 1, 1}});
  r.alloc(0, log.intern("wte"), log.intern("weights"), log.intern("parameters"), 100, 0);
  r.pool_event(EventKind::kPoolReserve, 0, chunk, act, pool, 128, 0);
  double t = 10;
  for (int m = 0; m < micro_batches; ++m) {
    r.set_pool_context(0, m);
    r.pool_event(EventKind::kPoolAcquire, t - 1, step, act, pool, 128, 0);
    r.begin_micro_batch(0, m);
    r.op_boundary(-1, 0, t);
    r.op_boundary(0, 1, t + 10);
    r.op_boundary(1, 2, t + 20);
    r.op_boundary(2, -1, t + 30);
    r.pool_event(EventKind::kPoolRelease, t + 31, step, act, pool, 128, 0);
    t += 40;
  }
  r.marker(t, "re-plan", "budget 1 GiB -> 512 MiB", "budget", 1);
  r.pool_event(EventKind::kPoolUnreserve, t, chunk, act, pool, 128, 0);
  return log;
}

// A GPT-2-shaped event log recorded through EventRecorder: `micro_batches` micro-batches of 2L+3
// ops (embedding, L blocks, head; head backward, L blocks, embedding) over 8 activations per
// block (live from the block's forward to its backward), the logits (head forward to head
// backward) and a workspace per op; parameters, gradients and optimizer state from the start.
// 2 * (9L + 4) memory events and 2 * (2L + 3) op events a micro-batch.
EventLog gpt2_like_log(int micro_batches, int layers) {
  EventRecorder r;
  EventLog& log = r.log();
  const int L = layers, nops = 2 * L + 3;
  const uint32_t act = log.intern("activations"), ws = log.intern("workspace"),
                 logits = log.intern("logits"), step = log.intern("step");
  std::vector<ScheduleOp> ops;
  ops.push_back({log.intern("forward embedding"), EventPhase::kForward, -1});
  for (int l = 0; l < L; ++l) {
    ops.push_back({log.intern(fmt::format("forward h.{}", l)), EventPhase::kForward, int16_t(l)});
  }
  ops.push_back({log.intern("forward head"), EventPhase::kForward, -1});
  ops.push_back({log.intern("backward head"), EventPhase::kBackward, -1});
  for (int l = L - 1; l >= 0; --l) {
    ops.push_back({log.intern(fmt::format("backward h.{}", l)), EventPhase::kBackward, int16_t(l)});
  }
  ops.push_back({log.intern("backward embedding"), EventPhase::kBackward, -1});
  std::vector<ScheduleBuffer> bufs;
  uint64_t offset = 0;
  for (int l = 0; l < L; ++l) {
    for (int k = 0; k < 8; ++k) {
      bufs.push_back({log.intern(fmt::format("h.{}.act{}", l, k)), act, step, 12 * kMiB, offset,
                      1 + l, nops - 2 - l});
      offset += 12 * kMiB;
    }
  }
  bufs.push_back({log.intern("logits"), logits, step, 600 * kMiB, offset, L + 1, L + 2});
  for (int o = 0; o < nops; ++o) {
    bufs.push_back({log.intern(fmt::format("workspace.{}", o)), ws, step,
                    uint64_t(4 + o % 3) * kMiB, offset + 600 * kMiB, o, o});
  }
  r.set_schedule(std::move(ops), std::move(bufs));
  const uint32_t weights = log.intern("weights"), grads = log.intern("grads"),
                 optimizer = log.intern("optimizer");
  r.alloc(0, log.intern("parameters"), weights, log.intern("parameters"), 475 * kMiB, 0);
  r.alloc(0, log.intern("gradients"), grads, log.intern("gradients"), 475 * kMiB, 0);
  r.alloc(0, log.intern("adam_m"), optimizer, log.intern("optimizer"), 475 * kMiB, 0);
  r.alloc(0, log.intern("adam_v"), optimizer, log.intern("optimizer"), 475 * kMiB, 475 * kMiB);
  log.reserve(size_t(micro_batches) * size_t(2 * (9 * L + 4) + 2 * nops) + 8);
  double t = 100;
  for (int m = 0; m < micro_batches; ++m) {
    r.begin_micro_batch(m / 4, m % 4);
    int cur = -1;
    for (int o = 0; o < nops; ++o) {
      r.op_boundary(cur, o, t);
      cur = o;
      t += 50 + 10 * (o % 7);
    }
    r.op_boundary(cur, -1, t);
    t += 200;
  }
  return log;
}

TEST(TraceJson, ParsesWithEveryEventKind) {
  TempDir dir;
  Profile p = make_profile(3, 2, 2);
  p.events = known_log(2);
  ASSERT_TRUE(write_trace_json(p, dir.file("trace.json")).is_ok());
  const json trace = json::parse(read_all(dir.file("trace.json")));
  ASSERT_TRUE(trace.contains("traceEvents"));
  EXPECT_EQ(trace["displayTimeUnit"], "ms");

  std::map<std::string, size_t> kinds;
  std::map<int, std::string> thread_names;
  std::set<std::string> marker_names;
  for (const json& e : trace["traceEvents"]) {
    const std::string ph = e.at("ph");
    ++kinds[ph];
    EXPECT_EQ(e.at("pid"), 1);
    if (ph == "M" && e["name"] == "thread_name") thread_names[e["tid"]] = e["args"]["name"];
    if (ph == "X") {
      EXPECT_TRUE(e["ts"].is_number());
      EXPECT_GT(e["dur"].get<double>(), 0);
      EXPECT_TRUE(e["args"].contains("step"));
    }
    if (ph == "C") {
      EXPECT_EQ(e["name"], "device memory");
      ASSERT_EQ(e["args"].size(), kMemoryCategories.size());
      for (const auto& c : kMemoryCategories) EXPECT_TRUE(e["args"][c].is_number_unsigned()) << c;
    }
    if (ph == "i" && e["s"] == "g") {
      marker_names.insert(e["name"]);
      EXPECT_FALSE(e["args"]["detail"].get<std::string>().empty());
    }
    if (ph == "i" && e["s"] == "t") {
      ++kinds[e["cat"].get<std::string>()];
      EXPECT_TRUE(e["args"]["bytes"].is_number_unsigned());
      EXPECT_TRUE(e["args"]["offset"].is_number_unsigned());
    }
  }
  EXPECT_EQ(kinds["X"], p.spans.size());
  EXPECT_EQ(kinds["C"], p.memory.size());
  EXPECT_EQ(kinds["alloc"], 5u);  // wte, and a0 and a1 of two micro-batches
  EXPECT_EQ(kinds["free"], 4u);
  EXPECT_EQ(kinds["i"], 2u + 9u);  // markers and memory events
  EXPECT_GE(kinds["M"], 5u);       // process name and four threads
  EXPECT_EQ(thread_names[kThreadCompute], "compute");
  EXPECT_EQ(thread_names[kThreadCopy], "copy");
  EXPECT_EQ(thread_names[kThreadData], "data loader");
  EXPECT_EQ(marker_names, (std::set<std::string>{"oom-recovery", "re-plan"}));
}

TEST(TraceJson, CounterValuesMatchSamples) {
  TempDir dir;
  const Profile p = make_profile(1, 1, 1);
  ASSERT_TRUE(write_trace_json(p, dir.file("t.json")).is_ok());
  const json trace = json::parse(read_all(dir.file("t.json")));
  size_t i = 0;
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] != "C") continue;
    ASSERT_LT(i, p.memory.size());
    EXPECT_NEAR(e["ts"].get<double>(), p.memory[i].t_us, 1e-3);
    for (size_t c = 0; c < kMemoryCategories.size(); ++c) {
      EXPECT_EQ(e["args"][kMemoryCategories[c]].get<uint64_t>(), p.memory[i].bytes[c]);
    }
    ++i;
  }
  EXPECT_EQ(i, p.memory.size());
}

TEST(TraceJson, CountersDerivedFromEventsWhenNoSamples) {
  TempDir dir;
  Profile p;
  p.events = known_log(1);
  ASSERT_TRUE(write_trace_json(p, dir.file("t.json")).is_ok());
  const json trace = json::parse(read_all(dir.file("t.json")));
  std::vector<std::pair<uint64_t, uint64_t>> seen;  // (weights, activations)
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] != "C") continue;
    seen.emplace_back(e["args"]["weights"].get<uint64_t>(),
                      e["args"]["activations"].get<uint64_t>());
  }
  // wte; a0 at op 0; a1 at op 1; a1 freed when op 1 ends; a0 freed when op 2 ends.
  const std::vector<std::pair<uint64_t, uint64_t>> want = {
      {100, 0}, {100, 30}, {100, 80}, {100, 30}, {100, 0}};
  EXPECT_EQ(seen, want);
}

TEST(LiveAtPeak, TheBuffersLiveAfterThePeakEvent) {
  const EventLog log = known_log(2);
  const std::vector<LiveBuffer> live = live_at_timeline_peak(log);
  ASSERT_EQ(live.size(), 3u);  // the peak (180 bytes) is first reached in micro-batch 0, op 1
  EXPECT_EQ(live[0].name, "wte");
  EXPECT_EQ(live[0].category, "weights");
  EXPECT_EQ(live[1].name, "a0");
  EXPECT_EQ(live[2].name, "a1");
  EXPECT_EQ(live[2].bytes, 50u);
  EXPECT_EQ(live[2].offset, 32u);
  uint64_t total = 0;
  for (const LiveBuffer& b : live) total += b.bytes;
  std::vector<std::string> categories;
  const auto samples = memory_timeline_from_events(log, &categories);
  EXPECT_EQ(total, detail::sample_total(samples[size_t(detail::peak_sample(samples))]));
  EXPECT_TRUE(live_at_timeline_peak(EventLog()).empty());
}

TEST(TraceJson, EveryAllocAndFreeIsAnInstantEventWithItsContext) {
  TempDir dir;
  Profile p;
  p.events = known_log(2);
  ASSERT_TRUE(write_trace_json(p, dir.file("t.json")).is_ok());
  const json trace = json::parse(read_all(dir.file("t.json")));
  std::vector<std::string> seen;
  std::map<int, std::string> thread_names;
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") thread_names[e["tid"]] = e["args"]["name"];
    if (e["ph"] != "i") continue;
    EXPECT_EQ(e["s"], "t");
    EXPECT_EQ(e["tid"], kThreadMemory);
    const json& a = e["args"];
    if (e["name"] == "wte") {
      EXPECT_EQ(a["region"], "parameters");
      EXPECT_FALSE(a.contains("op"));
      EXPECT_FALSE(a.contains("step"));
      seen.push_back("wte");
      continue;
    }
    const bool alloc = e["cat"] == "alloc";
    EXPECT_EQ(a["category"], "activations");
    EXPECT_EQ(a["region"], "step");
    EXPECT_EQ(a["step"], 0);
    const std::string name = e["name"];
    if (name == "a0") {
      EXPECT_EQ(a["bytes"], 30);
      EXPECT_EQ(a["offset"], 0);
      EXPECT_EQ(a["op"], alloc ? "fwd0" : "bwd0");
      EXPECT_EQ(a["phase"], alloc ? "forward" : "backward");
      EXPECT_EQ(a["layer"], 0);
    } else {
      EXPECT_EQ(name, "a1");
      EXPECT_EQ(a["bytes"], 50);
      EXPECT_EQ(a["offset"], 32);
      EXPECT_EQ(a["op"], "fwd1");
      EXPECT_EQ(a["op_index"], 1);
      EXPECT_EQ(a["layer"], 1);
    }
    seen.push_back(
        fmt::format("{} {} mb{}", e["cat"].get<std::string>(), name, a["micro_batch"].get<int>()));
  }
  const std::vector<std::string> want = {"wte",          "alloc a0 mb0", "alloc a1 mb0",
                                         "free a1 mb0",  "free a0 mb0",  "alloc a0 mb1",
                                         "alloc a1 mb1", "free a1 mb1",  "free a0 mb1"};
  EXPECT_EQ(seen, want);
  EXPECT_EQ(thread_names[kThreadMemory], "memory events");
}

TEST(TraceJson, EscapesNamesAndRoundTrips) {
  TempDir dir;
  Profile p;
  const std::string odd = "say \"hi\"\\ </script><!-- \n\t\x01 é";
  p.title = odd;
  p.spans.push_back({odd, "gemm", kThreadCompute, 0, 1, 0, 0, 0});
  p.markers.push_back({0, "re-plan", odd, ""});
  ASSERT_TRUE(write_trace_json(p, dir.file("t.json")).is_ok());
  const json trace = json::parse(read_all(dir.file("t.json")));
  bool found = false;
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] == "X") {
      EXPECT_EQ(e["name"], odd);
      found = true;
    }
    if (e["ph"] == "i") {
      EXPECT_EQ(e["args"]["detail"], odd);
    }
  }
  EXPECT_TRUE(found);
  EXPECT_EQ(trace["otherData"]["title"], odd);
}

TEST(TraceJson, NonFiniteTimesStayValidJson) {
  TempDir dir;
  Profile p;
  p.spans.push_back({"x", "gemm", 0, std::nan(""), INFINITY, -1, -1, -1});
  ASSERT_TRUE(write_trace_json(p, dir.file("t.json")).is_ok());
  EXPECT_NO_THROW(json::parse(read_all(dir.file("t.json"))));
}

TEST(AtomicWrite, LeavesOnlyTheFinalFiles) {
  TempDir dir;
  const Profile p = make_profile(2, 1, 2);
  ASSERT_TRUE(write_trace_json(p, dir.file("trace.json")).is_ok());
  ASSERT_TRUE(write_memory_json(p, dir.file("memory.json")).is_ok());
  ASSERT_TRUE(
      write_html_report(p, dir.file("report.html"), "window.Chart = function () {};").is_ok());
  // Writing again replaces the files in place.
  ASSERT_TRUE(write_trace_json(p, dir.file("trace.json")).is_ok());
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"memory.json", "report.html", "trace.json"}));
}

TEST(AtomicWrite, MissingDirectoryIsAnIoErrorNamingThePath) {
  TempDir dir;
  const std::string path = dir.file("no/such/dir/trace.json");
  const Status s = write_trace_json(make_profile(1, 1, 1), path);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_TRUE(dir.entries().empty());
}

TEST(AtomicWrite, FailedRenameRemovesTheTemporaryFile) {
  // A directory standing where the file should go: rename fails, the temporary file goes.
  TempDir dir;
  fs::create_directory(dir.file("trace.json"));
  fs::create_directory(dir.file("trace.json/keep"));
  const Status s = write_trace_json(make_profile(1, 1, 1), dir.file("trace.json"));
  EXPECT_FALSE(s.is_ok());
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"trace.json"}));
  EXPECT_TRUE(fs::is_directory(dir.file("trace.json/keep")));
}

TEST(MemoryJson, CarriesTheFigures) {
  TempDir dir;
  const Profile p = make_profile(3, 2, 3);
  ASSERT_TRUE(write_memory_json(p, dir.file("memory.json")).is_ok());
  const json m = json::parse(read_all(dir.file("memory.json")));
  EXPECT_EQ(m["peak_bytes"].get<uint64_t>(), p.peak_bytes);
  EXPECT_EQ(m["planned_peak_bytes"].get<uint64_t>(), p.planned_peak_bytes);
  EXPECT_EQ(m["budget_bytes"].get<uint64_t>(), p.budget_bytes);
  EXPECT_NEAR(m["fragmentation"].get<double>(),
              static_cast<double>(p.arena_bytes) / static_cast<double>(p.lower_bound_bytes), 1e-12);
  EXPECT_EQ(m["timeline_peak"]["bytes"].get<uint64_t>(), p.peak_bytes);
  EXPECT_EQ(m["timeline_peak"]["by_category"]["logits"].get<uint64_t>(), 640 * kMiB);
  EXPECT_EQ(m["live_at_peak"].size(), p.live_at_peak.size());
  ASSERT_EQ(m["sweep"].size(), p.sweep.size());
  EXPECT_TRUE(m["sweep"][0]["measured_peak_bytes"].is_null());
  EXPECT_EQ(m["sweep"][2]["measured_peak_bytes"].get<uint64_t>(), p.peak_bytes);
  EXPECT_FALSE(m["sweep"][5]["fits"].get<bool>());
  EXPECT_EQ(m["plan"]["chosen"]["micro_batch"], 4);
  EXPECT_EQ(m["plan"]["runners_up"].size(), 3u);
  // Time by category summed from the spans: milliseconds.
  double gemm_ms = 0;
  for (const Span& s : p.spans) {
    if (s.category == "gemm") gemm_ms += s.dur_us / 1000;
  }
  EXPECT_NEAR(m["time_by_category_ms"]["gemm"].get<double>(), gemm_ms, 1e-6);
  EXPECT_EQ(m["markers"].size(), 2u);
  EXPECT_EQ(m["counts"]["spans"].get<size_t>(), p.spans.size());
}

TEST(MemoryJson, CountsTheRecordedEvents) {
  TempDir dir;
  Profile p;
  p.events = known_log(2);
  ASSERT_TRUE(write_memory_json(p, dir.file("m.json")).is_ok());
  const json m = json::parse(read_all(dir.file("m.json")));
  EXPECT_EQ(m["counts"]["alloc_events"], 9);  // wte; a0, a1 allocated and freed twice
  EXPECT_EQ(m["counts"]["op_events"], 12);    // three ops begin and end twice
  EXPECT_EQ(m["counts"]["memory_samples"], 9);
  EXPECT_EQ(m["timeline_peak"]["bytes"], 180);  // wte + a0 + a1
}

// The pool block holds the planned buffers: it is a line (device reserved, pool reserved and in
// use), never a stacked category, so the bytes-by-category timeline is not doubled.
TEST(PoolTimeline, BlockIsALineNotACategory) {
  const EventLog log = pooled_log(2);
  std::vector<std::string> cats;
  const std::vector<MemorySample> stacked = memory_timeline_from_events(log, &cats);
  uint64_t peak = 0;
  for (const MemorySample& m : stacked) peak = std::max(peak, detail::sample_total(m));
  EXPECT_EQ(peak, 180u);  // wte + a0 + a1: the block's 128 bytes are not added
  EXPECT_EQ(stacked.size(), 9u);
  const std::vector<PoolSample> pool = pool_timeline_from_events(log);
  // reserve, 2 x (acquire, release), unreserve, and wte's alloc (outside the pool); a0 and a1
  // lie inside the block (region "step", which the block serves) and add no sample.
  ASSERT_EQ(pool.size(), 7u);
  uint64_t dev = 0, in_use = 0;
  for (const PoolSample& p : pool) {
    dev = std::max(dev, p.device);
    in_use = std::max(in_use, p.in_use);
    EXPECT_LE(p.in_use, p.reserved);
  }
  EXPECT_EQ(dev, 228u);  // wte + the chunk
  EXPECT_EQ(in_use, 128u);
  EXPECT_EQ(pool.back().reserved, 0u);
  EXPECT_EQ(pool.back().device, 100u);
  const PoolSummary ps = summarize_pool(pool, log);
  EXPECT_EQ(ps.acquisitions, 2u);
  EXPECT_EQ(ps.releases, 2u);
  EXPECT_EQ(ps.reserves, 1u);
  EXPECT_EQ(ps.unreserves, 1u);
  EXPECT_EQ(ps.peak_reserved, 128u);
  EXPECT_EQ(ps.reserved_at_peak_in_use, 128u);
  EXPECT_EQ(ps.fragmentation, 0.0);
  EXPECT_EQ(ps.peak_device, 228u);
  // Without pool events: no pool timeline.
  EXPECT_TRUE(pool_timeline_from_events(known_log(2)).empty());
}

TEST(PoolTimeline, TraceAndMemoryJsonShowThePool) {
  TempDir dir;
  Profile p;
  p.events = pooled_log(2);
  p.markers.push_back({90, "re-plan", "budget 1 GiB -> 512 MiB", "budget"});
  ASSERT_TRUE(write_trace_json(p, dir.file("trace.json")).is_ok());
  const json trace = json::parse(read_all(dir.file("trace.json")));
  std::map<std::string, int> cats;
  int pool_counters = 0, device_counters = 0;
  uint64_t max_reserved = 0;
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] == "i" && e["s"] == "t") ++cats[e["cat"].get<std::string>()];
    if (e["ph"] == "C" && e["name"] == "pool") {
      ++pool_counters;
      EXPECT_LE(e["args"]["in_use"].get<uint64_t>(), e["args"]["reserved"].get<uint64_t>());
      max_reserved = std::max(max_reserved, e["args"]["reserved"].get<uint64_t>());
    }
    if (e["ph"] == "C" && e["name"] == "device reserved") ++device_counters;
    if (e["ph"] == "i" && e["s"] == "g") {
      EXPECT_EQ(e["args"]["cause"], "budget");
    }
    if (e["ph"] == "C" && e["name"] == "device memory") {
      uint64_t total = 0;
      for (const auto& [k, v] : e["args"].items()) total += v.get<uint64_t>();
      EXPECT_LE(total, 180u);
    }
  }
  EXPECT_EQ(cats["pool_acquire"], 2);
  EXPECT_EQ(cats["pool_release"], 2);
  EXPECT_EQ(cats["pool_reserve"], 1);
  EXPECT_EQ(cats["pool_unreserve"], 1);
  EXPECT_EQ(cats["alloc"], 5);
  EXPECT_EQ(pool_counters, 7);
  EXPECT_EQ(device_counters, 7);
  EXPECT_EQ(max_reserved, 128u);

  ASSERT_TRUE(write_memory_json(p, dir.file("m.json")).is_ok());
  const json m = json::parse(read_all(dir.file("m.json")));
  EXPECT_EQ(m["pool"]["block_acquisitions"], 2);
  EXPECT_EQ(m["pool"]["block_releases"], 2);
  EXPECT_EQ(m["pool"]["peak_reserved_bytes"], 128);
  EXPECT_EQ(m["pool"]["peak_in_use_bytes"], 128);
  EXPECT_EQ(m["pool"]["peak_device_bytes"], 228);
  EXPECT_EQ(m["counts"]["pool_events"], 6);
  EXPECT_EQ(m["timeline_peak"]["bytes"], 180);
  EXPECT_EQ(m["markers"][0]["cause"], "budget");
  // Without pool events memory.json says so.
  Profile q;
  q.events = known_log(1);
  ASSERT_TRUE(write_memory_json(q, dir.file("q.json")).is_ok());
  EXPECT_TRUE(json::parse(read_all(dir.file("q.json")))["pool"].is_null());
}

TEST(MemoryJson, EmptyProfileIsValid) {
  TempDir dir;
  ASSERT_TRUE(write_memory_json(Profile{}, dir.file("m.json")).is_ok());
  const json m = json::parse(read_all(dir.file("m.json")));
  EXPECT_TRUE(m["fragmentation"].is_null());
  EXPECT_TRUE(m["timeline_peak"].is_null());
}

TEST(Downsample, KeepsThePeakAndTheEnds) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0, 100);
  std::vector<double> v(1'000'000);
  for (double& x : v) x = u(rng);
  const size_t spike = 612'345;
  v[spike] = 1000;
  const auto keep = downsample_indices(v, kMaxTimelinePoints);
  EXPECT_LE(keep.size(), kMaxTimelinePoints);
  EXPECT_GT(keep.size(), kMaxTimelinePoints / 2);
  EXPECT_TRUE(std::is_sorted(keep.begin(), keep.end()));
  EXPECT_EQ(std::adjacent_find(keep.begin(), keep.end()), keep.end());
  EXPECT_EQ(keep.front(), 0u);
  EXPECT_EQ(keep.back(), v.size() - 1);
  EXPECT_TRUE(std::binary_search(keep.begin(), keep.end(), spike));
  // Every bucket's maximum survives, so the kept series' maximum is the true one.
  double kept_max = 0;
  for (size_t i : keep) kept_max = std::max(kept_max, v[i]);
  EXPECT_EQ(kept_max, 1000);
}

TEST(Downsample, ShortSeriesKeptWhole) {
  const std::vector<double> v = {3, 1, 4, 1, 5};
  EXPECT_EQ(downsample_indices(v, 10), (std::vector<size_t>{0, 1, 2, 3, 4}));
  EXPECT_TRUE(downsample_indices({}, 10).empty());
}

TEST(Downsample, EveryPointCountFits) {
  std::vector<double> v(10'007);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>((i * 7919) % 1013);
  for (size_t max_points : {4, 5, 6, 100, 1001, 10'006}) {
    const auto keep = downsample_indices(v, max_points);
    EXPECT_LE(keep.size(), max_points) << max_points;
    const size_t imax = *std::max_element(keep.begin(), keep.end(),
                                          [&](size_t a, size_t b) { return v[a] < v[b]; });
    EXPECT_EQ(v[imax], 1012) << max_points;
  }
}

TEST(HtmlReport, SelfContainedWithDownsampledTimeline) {
  TempDir dir;
  Profile p = make_profile(40, 4, 12);  // ~31k samples in all, ~800 in the drawn step
  p.window_end_us = 0;                  // draw all of them: forces downsampling
  ASSERT_TRUE(
      write_html_report(p, dir.file("report.html"), "window.Chart = function () {};").is_ok());
  const std::string html = read_all(dir.file("report.html"));
  EXPECT_NE(html.find("window.Chart = function () {};"), std::string::npos);
  // Nothing to fetch: no external scripts, styles or images.
  EXPECT_EQ(html.find("<link"), std::string::npos);
  EXPECT_EQ(html.find(" src="), std::string::npos);
  EXPECT_EQ(html.find("@@"), std::string::npos);
  const json d = page_data(html);
  const json& t = d["timeline"];
  EXPECT_EQ(t["total_samples"].get<size_t>(), p.memory.size());
  EXPECT_LE(t["t_us"].size(), kMaxTimelinePoints);
  ASSERT_EQ(t["bytes"].size(), kMemoryCategories.size());
  EXPECT_EQ(t["peak"]["bytes"].get<uint64_t>(), p.peak_bytes);
  // The peak sample itself is among those drawn.
  uint64_t drawn_max = 0;
  for (size_t k = 0; k < t["t_us"].size(); ++k) {
    uint64_t total = 0;
    for (const json& col : t["bytes"]) total += col[k].get<uint64_t>();
    drawn_max = std::max(drawn_max, total);
  }
  EXPECT_EQ(drawn_max, p.peak_bytes);
  for (const char* chart : {"timeline", "timeline-overview", "sweep-memory", "sweep-throughput",
                            "fragmentation", "time-by-category"}) {
    EXPECT_NE(html.find(fmt::format("data-chart=\"{}\"", chart)), std::string::npos) << chart;
  }
}

TEST(HtmlReport, WindowSelectsOneStep) {
  TempDir dir;
  const Profile p = make_profile(3, 2, 2);
  ASSERT_TRUE(write_html_report(p, dir.file("r.html"), "x").is_ok());
  const json t = page_data(read_all(dir.file("r.html")))["timeline"];
  EXPECT_EQ(t["total_samples"].get<size_t>(), p.memory.size() / 3);
  for (const json& ts : t["t_us"]) {
    EXPECT_GE(ts.get<double>(), p.window_start_us);
    EXPECT_LT(ts.get<double>(), p.window_end_us);
  }
  EXPECT_EQ(t["peak"]["bytes"].get<uint64_t>(), p.peak_bytes);
}

std::vector<uint8_t> from_base64(const std::string& s) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
  };
  std::vector<uint8_t> out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : s) {
    const int v = value(c);
    if (v < 0) break;  // '=' padding
    acc = acc << 6 | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(uint8_t(acc >> bits));
    }
  }
  return out;
}

// The page's full-resolution timeline, replayed as the page's zoom does, gives back every sample
// of the profile (all of them, not only the window's), and the overview keeps the run's peak.
TEST(HtmlReport, FullResolutionChangesReplayEverySample) {
  TempDir dir;
  Profile p = make_profile(3, 2, 2);
  p.events = known_log(1);  // ignored for the timeline: samples are given
  ASSERT_TRUE(write_html_report(p, dir.file("r.html"), "x").is_ok());
  const json t = page_data(read_all(dir.file("r.html")))["timeline"];
  const json& f = t["full"];
  const size_t n = f["n"].get<size_t>();
  ASSERT_EQ(f["width"], 2);
  const std::vector<uint8_t> tb = from_base64(f["t"]), ib = from_base64(f["id"]);
  ASSERT_EQ(tb.size(), n * sizeof(double));
  ASSERT_EQ(ib.size(), n * sizeof(uint16_t));
  std::vector<double> times(n);
  std::vector<uint16_t> ids(n);
  std::memcpy(times.data(), tb.data(), tb.size());
  std::memcpy(ids.data(), ib.data(), ib.size());
  std::vector<int64_t> cur(kMemoryCategories.size(), 0);
  size_t k = 0;
  for (const MemorySample& m : p.memory) {
    for (; k < n && times[k] <= m.t_us; ++k) {
      cur[f["dict_cat"][ids[k]].get<size_t>()] += f["dict_delta"][ids[k]].get<int64_t>();
    }
    for (size_t c = 0; c < cur.size(); ++c) ASSERT_EQ(uint64_t(cur[c]), m.bytes[c]) << m.t_us;
  }
  EXPECT_EQ(k, n);
  const json& o = t["overview"];
  EXPECT_EQ(o["total_samples"].get<size_t>(), p.memory.size());
  uint64_t overview_max = 0;
  for (const json& v : o["total"]) overview_max = std::max(overview_max, v.get<uint64_t>());
  EXPECT_EQ(overview_max, p.peak_bytes);
}

TEST(HtmlReport, ScriptCloseInLibraryAndTitleIsNeutralised) {
  TempDir dir;
  Profile p;
  p.title = "</title><script>alert(1)</script> @@DATA@@";
  ASSERT_TRUE(
      write_html_report(p, dir.file("r.html"), "var s = '</script>'; //# sourceMappingURL=x.map")
          .is_ok());
  const std::string html = read_all(dir.file("r.html"));
  EXPECT_NE(html.find("var s = '<\\/script>';"), std::string::npos);
  EXPECT_EQ(html.find("sourceMappingURL"), std::string::npos);
  EXPECT_EQ(html.find("<script>alert(1)"), std::string::npos);
  EXPECT_NO_THROW(page_data(html));
}

TEST(HtmlReport, MissingLibrarySaysHowToGetIt) {
  const auto lib = load_chart_lib("/nonexistent/chart.umd.min.js");
  ASSERT_FALSE(lib.is_ok());
  EXPECT_EQ(lib.status().code(), StatusCode::kNotFound);
  EXPECT_NE(lib.status().message().find("scripts/get-chart-lib"), std::string::npos);
  EXPECT_NE(lib.status().message().find("/nonexistent/chart.umd.min.js"), std::string::npos);
  const Status s = write_html_report(Profile{}, "/tmp/unused.html", "");
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("scripts/get-chart-lib"), std::string::npos);
}

TEST(HtmlReport, DefaultLibraryPathPointsIntoThirdParty) {
  EXPECT_NE(default_chart_lib_path().find("third_party/chartlib/node_modules/chart.js/dist/"),
            std::string::npos);
}

// 10^6 spans and 10^6 memory samples: all three files are written in seconds and the page stays
// small. Timing is printed, never asserted (STYLE.md).
TEST(LargeProfile, MillionEventsWrite) {
  TempDir dir;
  const auto t0 = std::chrono::steady_clock::now();
  Profile p = make_profile(1276, 4, 12);
  p.window_end_us = 0;
  ASSERT_GE(p.spans.size(), 1'000'000u);
  const auto t1 = std::chrono::steady_clock::now();
  ASSERT_TRUE(write_trace_json(p, dir.file("trace.json")).is_ok());
  const auto t2 = std::chrono::steady_clock::now();
  ASSERT_TRUE(write_memory_json(p, dir.file("memory.json")).is_ok());
  ASSERT_TRUE(write_html_report(p, dir.file("report.html"), "x").is_ok());
  const auto t3 = std::chrono::steady_clock::now();
  const auto ms = [](auto a, auto b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  std::cout << fmt::format(
      "[ info     ] {} spans, {} samples: build {:.0f} ms, trace.json {:.0f} ms ({:.0f} MB), "
      "memory.json + report.html {:.0f} ms (page {:.2f} MB)\n",
      p.spans.size(), p.memory.size(), ms(t0, t1), ms(t1, t2),
      fs::file_size(dir.file("trace.json")) / 1e6, ms(t2, t3),
      fs::file_size(dir.file("report.html")) / 1e6);
  const json d = page_data(read_all(dir.file("report.html")));
  // The downsampled charts take well under a megabyte; the full-resolution changes for the zoom
  // take 10 bytes each (float64 time, uint16 id) as base64.
  const uint64_t changes = d["timeline"]["full"]["n"].get<uint64_t>();
  EXPECT_GE(changes, p.memory.size());
  EXPECT_LT(fs::file_size(dir.file("report.html")), 1'000'000u + changes * 10 * 4 / 3 + 4);
  EXPECT_LE(d["timeline"]["t_us"].size(), kMaxTimelinePoints);
  EXPECT_LE(d["timeline"]["overview"]["t_us"].size(), kMaxTimelinePoints);
  EXPECT_EQ(d["timeline"]["peak"]["bytes"].get<uint64_t>(), p.peak_bytes);
}

// 10^6 recorded alloc/free events (and as many spans): the timeline, the trace's instant events,
// the live-at-peak list and the page's full-resolution data all come from the log.
TEST(LargeProfile, MillionRecordedEventsWrite) {
  TempDir dir;
  Profile p = make_profile(1276, 4, 12);
  p.window_end_us = 0;
  p.memory.clear();
  p.memory_categories.clear();
  const auto t0 = std::chrono::steady_clock::now();
  p.events = gpt2_like_log(4040, 12);
  const auto t1 = std::chrono::steady_clock::now();
  const size_t n = detail::count_memory_events(p.events);
  ASSERT_GE(n, 1'000'000u);
  ASSERT_TRUE(write_trace_json(p, dir.file("trace.json")).is_ok());
  const auto t2 = std::chrono::steady_clock::now();
  ASSERT_TRUE(write_memory_json(p, dir.file("memory.json")).is_ok());
  ASSERT_TRUE(write_html_report(p, dir.file("report.html"), "x").is_ok());
  const auto t3 = std::chrono::steady_clock::now();
  const auto ms = [](auto x, auto y) {
    return std::chrono::duration<double, std::milli>(y - x).count();
  };
  std::cout << fmt::format(
      "[ info     ] {} events ({} alloc/free): recorded in {:.0f} ms, trace.json {:.0f} ms "
      "({:.0f} MB), memory.json + report.html {:.0f} ms (page {:.2f} MB)\n",
      p.events.size(), n, ms(t0, t1), ms(t1, t2), fs::file_size(dir.file("trace.json")) / 1e6,
      ms(t2, t3), fs::file_size(dir.file("report.html")) / 1e6);
  const json m = json::parse(read_all(dir.file("memory.json")));
  EXPECT_EQ(m["counts"]["alloc_events"].get<size_t>(), n);
  EXPECT_EQ(m["counts"]["memory_samples"].get<size_t>(), n);
  // The peak: the persistent 1900 MiB, every block's activations and the logits, and the head's
  // workspace (op L + 1 or L + 2).
  const uint64_t peak = m["timeline_peak"]["bytes"];
  EXPECT_EQ(peak, (4 * 475 + 12 * 8 * 12 + 600) * kMiB +
                      std::max<uint64_t>(4 + 13 % 3, 4 + 14 % 3) * kMiB);
  const json d = page_data(read_all(dir.file("report.html")));
  EXPECT_EQ(d["timeline"]["full"]["n"].get<size_t>(), n);
  EXPECT_EQ(d["timeline"]["peak"]["bytes"].get<uint64_t>(), peak);
  uint64_t live = 0;
  for (const LiveBuffer& b : live_at_timeline_peak(p.events)) live += b.bytes;
  EXPECT_EQ(live, peak);
}

// Writes a sample profile's three files into $HR_REPORT_OUT_DIR for tests/report/browser_test.sh
// (the real Chart.js is inlined); skipped when the variable is unset. HR_REPORT_SPANS=large makes
// it the 10^6-span profile.
TEST(BrowserFixture, WritesSampleReport) {
  const char* out = std::getenv("HR_REPORT_OUT_DIR");
  if (out == nullptr || *out == '\0') GTEST_SKIP() << "HR_REPORT_OUT_DIR not set";
  const auto lib = load_chart_lib(chart_lib_path());
  ASSERT_TRUE(lib.is_ok()) << lib.status().to_string();
  const char* size = std::getenv("HR_REPORT_SPANS");
  const bool large = size != nullptr && std::string(size) == "large";
  // Large: 10^6 spans and a recorded log of 10^6 alloc/free events (the timeline derived from it).
  Profile p = large ? make_profile(1276, 4, 12) : make_profile(3, 4, 12);
  if (large) {
    p.window_end_us = 0;
    p.memory.clear();
    p.memory_categories.clear();
    p.events = gpt2_like_log(4040, 12);
    ASSERT_GE(detail::count_memory_events(p.events), 1'000'000u);
  }
  const std::string dir = out;
  // A range for the browser test to zoom into (report.html#zoom=A,B) and the moments (times at
  // which some category's bytes change) the page must draw in it at full resolution.
  std::vector<std::string> categories;
  std::vector<MemorySample> derived;
  const auto& samples = detail::resolve_timeline(p, &categories, &derived);
  const size_t mid = samples.size() / 2, len = std::min<size_t>(300, samples.size() - mid - 1);
  const double a = (samples[mid - 1].t_us + samples[mid].t_us) / 2, b = samples[mid + len].t_us;
  std::set<double> moments;
  for (size_t i = 1; i < samples.size(); ++i) {
    const double t = samples[i].t_us;
    if (a < t && t <= b && samples[i].bytes != samples[i - 1].bytes) moments.insert(t);
  }
  std::ofstream(dir + "/zoom.txt") << fmt::format("{} {} {}\n", a, b, moments.size());
  ASSERT_TRUE(write_trace_json(p, dir + "/trace.json").is_ok());
  ASSERT_TRUE(write_memory_json(p, dir + "/memory.json").is_ok());
  ASSERT_TRUE(write_html_report(p, dir + "/report.html", lib->js).is_ok());
}

}  // namespace
}  // namespace headroom::report
