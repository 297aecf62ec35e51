// The data-file resolver: HEADROOM_DATA_DIR first, the source tree last and optional, and a
// missing file's error lists every place looked at.
#include "core/data_dir.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace headroom {
namespace {

namespace fs = std::filesystem;

struct EnvGuard {
  explicit EnvGuard(const char* name) : name_(name) {
    if (const char* v = std::getenv(name)) saved_ = v, had_ = true;
  }
  ~EnvGuard() { had_ ? (void)setenv(name_, saved_.c_str(), 1) : (void)unsetenv(name_); }
  const char* name_;
  std::string saved_;
  bool had_ = false;
};

TEST(DataDir, EnvironmentComesFirstInTheInstalledLayout) {
  EnvGuard g1("HEADROOM_DATA_DIR");
  const fs::path dir = fs::temp_directory_path() / ("hr_data_dir_" + std::to_string(getpid()));
  fs::create_directories(dir / "chartlib");
  std::ofstream(dir / "chartlib" / "chart.umd.min.js") << "Chart";
  setenv("HEADROOM_DATA_DIR", dir.c_str(), 1);
  Result<DataCandidate> found = find_data(DataItem::kChartLib);
  ASSERT_TRUE(found.is_ok()) << found.status().message();
  EXPECT_EQ(found->path, (dir / "chartlib" / "chart.umd.min.js").string());
  EXPECT_EQ(found->origin, "HEADROOM_DATA_DIR");
  // A vocabulary directory counts only with its files in it.
  fs::create_directories(dir / "gpt2");
  std::ofstream(dir / "gpt2" / "encoder.json") << "{}";
  Result<DataCandidate> vocab = find_data(DataItem::kGpt2Vocab);
  if (vocab.is_ok()) EXPECT_NE(vocab->origin, "HEADROOM_DATA_DIR");
  std::ofstream(dir / "gpt2" / "vocab.bpe") << "#version: 0.2\n";
  vocab = find_data(DataItem::kGpt2Vocab);
  ASSERT_TRUE(vocab.is_ok());
  EXPECT_EQ(vocab->origin, "HEADROOM_DATA_DIR");
  fs::remove_all(dir);
}

TEST(DataDir, MissingFileNamesEveryPlaceLookedAt) {
  EnvGuard g1("HEADROOM_DATA_DIR"), g2("HEADROOM_DATA_NO_SOURCE");
  setenv("HEADROOM_DATA_DIR", "/nonexistent/hr-data", 1);
  setenv("HEADROOM_DATA_NO_SOURCE", "1", 1);
  const std::vector<DataCandidate> c = data_candidates(DataItem::kChartLib);
  ASSERT_GE(c.size(), 2u);
  EXPECT_EQ(c[0].path, "/nonexistent/hr-data/chartlib/chart.umd.min.js");
  EXPECT_EQ(c[1].origin, "installed");  // beside this test program: build/share/headroom
  for (const DataCandidate& d : c) EXPECT_NE(d.origin, "source tree");
  Result<DataCandidate> found = find_data(DataItem::kChartLib);
  ASSERT_FALSE(found.is_ok());
  EXPECT_EQ(found.status().code(), StatusCode::kNotFound);
  const std::string& m = found.status().message();
  for (const DataCandidate& d : c) EXPECT_NE(m.find(d.path), std::string::npos) << m;
  EXPECT_NE(m.find("scripts/get-chart-lib"), std::string::npos) << m;
  EXPECT_NE(m.find("HEADROOM_DATA_DIR"), std::string::npos) << m;
}

TEST(DataDir, SourceTreeIsTheDevelopersFallback) {
  EnvGuard g1("HEADROOM_DATA_DIR"), g2("HEADROOM_DATA_NO_SOURCE");
  unsetenv("HEADROOM_DATA_DIR");
  unsetenv("HEADROOM_DATA_NO_SOURCE");
  const std::vector<DataCandidate> c = data_candidates(DataItem::kConfigs);
  ASSERT_FALSE(c.empty());
  EXPECT_EQ(c.back().origin, "source tree");
  EXPECT_EQ(c.back().path, fs::path(HEADROOM_SOURCE_DIR "/configs").lexically_normal().string());
  Result<DataCandidate> found = find_data(DataItem::kConfigs);
  ASSERT_TRUE(found.is_ok()) << found.status().message();
}

}  // namespace
}  // namespace headroom
