// Every report writer keeps its JSON valid whatever bytes the names hold (a path in the title, a
// prompt in a marker, a byte-level token in a span): trace.json, memory.json and report.html's
// data blob parse, and each string reads back as core/utf8.h's valid_utf8 of what was given
// (docs/notes/json-text.md; issue #26).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "../json_text_cases.h"
#include "core/utf8.h"
#include "report/json_writer.h"
#include "report/profile.h"

namespace headroom::report {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(JsonText, AppendJsonStringAndJsonWriterStayValidOnArbitraryBytes) {
  for (const std::string& s : test::json_text_cases()) {
    std::string quoted;
    detail::append_json_string(quoted, s);
    json back;
    ASSERT_NO_THROW(back = json::parse(quoted)) << testing::PrintToString(s);
    EXPECT_EQ(back.get<std::string>(), valid_utf8(s)) << testing::PrintToString(s);

    std::string out;
    detail::JsonWriter w(out);
    w.begin_object();
    w.field(s, s);
    w.key("list");
    w.begin_array();
    w.value(s);
    w.value(s.c_str());
    w.end_array();
    w.end_object();
    ASSERT_NO_THROW(back = json::parse(out)) << testing::PrintToString(s);
    EXPECT_EQ(back[valid_utf8(s)].get<std::string>(), valid_utf8(s));
    EXPECT_EQ(back["list"][0].get<std::string>(), valid_utf8(s));
  }
}

// A profile with `s` in every string it has.
Profile profile_with(const std::string& s) {
  Profile p;
  p.title = s;
  p.model = s;
  p.device = s;
  p.run = s;
  p.memory_categories = {"weights", s};
  p.memory.push_back({0, {1, 2}});
  p.memory.push_back({10, {1, 5}});
  p.spans.push_back({s, s, kThreadCompute, 0, 5, 0, 0, 0});
  p.spans.push_back({"gemm " + s, "gemm", kThreadData, 5, 5, 0, 0, -1});
  p.markers.push_back({3, s, s, s});
  p.thread_names[kThreadCompute] = s;
  p.live_at_peak.push_back({s, s, 5, 1});
  p.plan.chosen.precision = s;
  p.plan.chosen.techniques = s;
  p.plan.chosen.by_category[s] = 7;
  p.plan.runners_up.push_back(p.plan.chosen);
  p.time_by_category_ms[s] = 1.5;
  (void)p.events.intern(s);
  p.peak_bytes = p.planned_peak_bytes = p.arena_bytes = 6;
  p.budget_bytes = 100;
  return p;
}

TEST(JsonText, TraceMemoryJsonAndReportDataParseWithArbitraryBytesInEveryName) {
  std::string tmpl = (fs::temp_directory_path() / "hr_json_text.XXXXXX").string();
  const fs::path dir = ::mkdtemp(tmpl.data());
  for (const std::string& s : test::json_text_cases(100)) {
    const Profile p = profile_with(s);
    const std::string what = testing::PrintToString(s);
    ASSERT_TRUE(write_trace_json(p, (dir / "trace.json").string()).is_ok()) << what;
    ASSERT_TRUE(write_memory_json(p, (dir / "memory.json").string()).is_ok()) << what;
    ASSERT_TRUE(write_html_report(p, (dir / "report.html").string(), "window.Chart = 0;").is_ok())
        << what;
    json trace, memory, data;
    ASSERT_NO_THROW(trace = json::parse(read_file(dir / "trace.json"))) << what;
    ASSERT_NO_THROW(memory = json::parse(read_file(dir / "memory.json"))) << what;
    const std::string html = read_file(dir / "report.html");
    const std::string open = "<script type=\"application/json\" id=\"hr-data\">";
    const size_t a = html.find(open);
    ASSERT_NE(a, std::string::npos);
    const size_t b = html.find("</script>", a);
    ASSERT_NE(b, std::string::npos);
    ASSERT_NO_THROW(data = json::parse(html.substr(a + open.size(), b - a - open.size()))) << what;
    EXPECT_EQ(trace["otherData"]["title"].get<std::string>(), valid_utf8(s)) << what;
    EXPECT_TRUE(is_valid_utf8(html)) << what;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace headroom::report
