// Tests of the profile writers: trace.json parses and has every event kind, memory.json carries
// the figures, report.html is self-contained with a downsampled timeline that keeps the peak, and
// every file is written atomically. tests/report/browser_test.sh opens the page in Chromium.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
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
                       "allocation of 512.0 MiB failed in lm_head.fwd; re-planning"});
  p.markers.push_back({p.memory[p.memory.size() / 3 + 1].t_us, "re-plan",
                       "micro-batch 8 -> 4, accumulation 4 -> 8 (effective batch 32 kept)"});
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

TEST(TraceJson, ParsesWithEveryEventKind) {
  TempDir dir;
  const Profile p = make_profile(3, 2, 2);
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
    if (ph == "i") {
      EXPECT_EQ(e["s"], "g");
      marker_names.insert(e["name"]);
      EXPECT_FALSE(e["args"]["detail"].get<std::string>().empty());
    }
  }
  EXPECT_EQ(kinds["X"], p.spans.size());
  EXPECT_EQ(kinds["C"], p.memory.size());
  EXPECT_EQ(kinds["i"], 2u);
  EXPECT_GE(kinds["M"], 4u);  // process name and three threads
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

TEST(TraceJson, CountersDerivedFromAllocEventsWhenNoSamples) {
  TempDir dir;
  Profile p;
  p.allocs = {{10, "wte", "weights", 100, 0, true, "init"},
              {20, "a0", "activations", 30, 0, true, "fwd0"},
              {30, "a1", "activations", 50, 32, true, "fwd1"},
              {40, "a0", "activations", 30, 0, false, "bwd0"}};
  ASSERT_TRUE(write_trace_json(p, dir.file("t.json")).is_ok());
  const json trace = json::parse(read_all(dir.file("t.json")));
  std::vector<std::pair<uint64_t, uint64_t>> seen;  // (weights, activations)
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] != "C") continue;
    seen.emplace_back(e["args"]["weights"].get<uint64_t>(),
                      e["args"]["activations"].get<uint64_t>());
  }
  const std::vector<std::pair<uint64_t, uint64_t>> want = {
      {100, 0}, {100, 30}, {100, 80}, {100, 50}};
  EXPECT_EQ(seen, want);
}

TEST(TraceJson, EscapesNamesAndRoundTrips) {
  TempDir dir;
  Profile p;
  const std::string odd = "say \"hi\"\\ </script><!-- \n\t\x01 é";
  p.title = odd;
  p.spans.push_back({odd, "gemm", kThreadCompute, 0, 1, 0, 0, 0});
  p.markers.push_back({0, "re-plan", odd});
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
  for (const char* chart :
       {"timeline", "sweep-memory", "sweep-throughput", "fragmentation", "time-by-category"}) {
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
  EXPECT_LT(fs::file_size(dir.file("report.html")), 4'000'000u);
  const json d = page_data(read_all(dir.file("report.html")));
  EXPECT_LE(d["timeline"]["t_us"].size(), kMaxTimelinePoints);
  EXPECT_EQ(d["timeline"]["peak"]["bytes"].get<uint64_t>(), p.peak_bytes);
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
  Profile p = large ? make_profile(1276, 4, 12) : make_profile(3, 4, 12);
  if (large) p.window_end_us = 0;
  const std::string dir = out;
  ASSERT_TRUE(write_trace_json(p, dir + "/trace.json").is_ok());
  ASSERT_TRUE(write_memory_json(p, dir + "/memory.json").is_ok());
  ASSERT_TRUE(write_html_report(p, dir + "/report.html", lib->js).is_ok());
}

}  // namespace
}  // namespace headroom::report
