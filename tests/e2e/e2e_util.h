// Shared by the end-to-end tests: run the headroom executable and capture what it prints, and a
// fixture with a fresh temporary directory per test and a small corpus in it.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace headroom::e2e {

namespace fs = std::filesystem;

struct Outcome {
  int code;
  std::string out;  // stdout and stderr together
};

// Runs `headroom ARGS`. Every run shares one cache directory (calibration, default corpus) under
// the test's temp dir, so tests never write to the user's ~/.cache.
inline Outcome run(const std::string& args) {
  static const std::string cache = (fs::path(testing::TempDir()) / "headroom_e2e_cache").string();
  std::string cmd =
      "HEADROOM_CACHE_DIR=" + cache + " " + std::string(HEADROOM_BINARY) + " " + args + " 2>&1";
  Outcome r{-1, ""};
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Whether `what` occurs in `out`.
inline bool has(const std::string& out, const std::string& what) {
  return out.find(what) != std::string::npos;
}

// The JSON object a `--json` command printed: from its first line that opens an object to the end
// (calibration or progress may print before it). Throws, quoting the output, when there is none.
inline std::string json_text(const std::string& out) {
  const size_t at = out.find("{\n");
  if (at == std::string::npos) throw std::runtime_error("no JSON object in the output:\n" + out);
  return out.substr(at);
}
inline nlohmann::json json_of(const std::string& out) {
  return nlohmann::json::parse(json_text(out));
}

// A fresh directory per test, removed after it.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(testing::TempDir()) /
           ("headroom_e2e_" + std::to_string(getpid()) + "_" +
            testing::UnitTest::GetInstance()->current_test_info()->test_suite_name() + "_" +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path(name), std::ios::binary) << text;
  }
  // A small corpus: one fortune file from Debian's package, tokenised into the test's directory.
  std::string corpus() const {
    std::string out = path("corpus.tokens");
    Outcome r = run("prepare /usr/share/games/fortunes/computers --doc-separator % --out " + out);
    EXPECT_EQ(r.code, 0) << r.out;
    return out;
  }
  fs::path dir_;
};

}  // namespace headroom::e2e
