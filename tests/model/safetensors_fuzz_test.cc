// safetensors reader and weight loader on fuzzer-shaped input (docs/notes/fuzzing.md): the seed
// corpus is accepted, every committed crashing input is refused cleanly, and the bugs the fuzzer
// and its review found stay fixed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/gpt2.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace headroom::model {
namespace {

namespace fs = std::filesystem;

// The config whose weights fuzz/corpus/safetensors/tiny-*.safetensors hold
// (fuzz/safetensors_fuzzer.cc).
Gpt2Config tiny() {
  Gpt2Config c;
  c.n_layer = 1;
  c.n_head = 2;
  c.n_embd = 4;
  c.vocab_size = 8;
  c.n_positions = 4;
  return c;
}

class SafetensorsFuzz : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("hr_st_fuzz_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes the 8-byte length, `header` and `data`; returns the path.
  std::string write_raw(const std::string& header, const std::string& data = "") {
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; i++) bytes[i] = char((uint64_t(header.size()) >> (8 * i)) & 0xff);
    bytes += header + data;
    const std::string p = (dir_ / "t.safetensors").string();
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), std::streamsize(bytes.size()));
    EXPECT_TRUE(f.good());
    return p;
  }

  void expect_corrupt(const std::string& p, std::vector<std::string> parts) {
    Result<SafetensorsFile> r = SafetensorsFile::open(p);
    ASSERT_FALSE(r.is_ok()) << p << " opened but should not have";
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().to_string();
    parts.push_back(p);
    for (const std::string& part : parts) {
      EXPECT_NE(r.status().message().find(part), std::string::npos)
          << "message does not mention '" << part << "': " << r.status().to_string();
    }
  }

  fs::path dir_;
};

TEST_F(SafetensorsFuzz, SeedCorpusIsAcceptedAndTinyWeightsLoad) {
  const ParamTable table = gpt2_param_table(tiny());
  std::vector<float> params(size_t(table.total_floats));
  int seen = 0;
  for (const auto& e : fs::directory_iterator(HEADROOM_SOURCE_DIR "/fuzz/corpus/safetensors")) {
    const std::string p = e.path().string();
    Result<SafetensorsFile> f = SafetensorsFile::open(p);
    EXPECT_TRUE(f.is_ok()) << f.status().to_string();
    if (e.path().filename().string().starts_with("tiny-")) {
      Status s = load_weights(p, table, params.data());
      EXPECT_TRUE(s.is_ok()) << s.to_string();
    }
    seen++;
  }
  EXPECT_GT(seen, 0);
}

// Every input the fuzzer found a crash with is refused with an error naming the file (or, when
// the fix was elsewhere, read without a crash).
TEST_F(SafetensorsFuzz, RegressionInputsAreRefusedCleanly) {
  const fs::path dir = HEADROOM_SOURCE_DIR "/tests/fuzz_regressions/safetensors";
  if (!fs::exists(dir)) GTEST_SKIP() << "no committed inputs";
  const ParamTable table = gpt2_param_table(tiny());
  std::vector<float> params(size_t(table.total_floats));
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string p = e.path().string();
    Result<SafetensorsFile> f = SafetensorsFile::open(p);
    if (!f.is_ok()) {
      EXPECT_NE(f.status().message().find(p), std::string::npos) << f.status().to_string();
    }
    Status s = load_weights(p, table, params.data());
    if (!s.is_ok()) {
      EXPECT_NE(s.message().find(p), std::string::npos) << s.to_string();
    }
  }
}

// Regression (found in review, see docs/notes/fuzzing.md): the error for a malformed shape or
// data_offsets printed the value with json::dump, which recurses once per nesting level; a deeply
// nested value overflowed the stack.
TEST_F(SafetensorsFuzz, DeeplyNestedShapeIsAnErrorNotAStackOverflow) {
  const int depth = 200000;
  const std::string nested = std::string(depth, '[') + std::string(depth, ']');
  expect_corrupt(
      write_raw(R"({"w": {"dtype": "F32", "shape": )" + nested + R"(, "data_offsets": [0, 4]}})",
                std::string(4, '\0')),
      {"'w'", "shape [[...]]", "non-integer"});
  expect_corrupt(
      write_raw(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": )" + nested + "}}",
                std::string(4, '\0')),
      {"'w'", "data_offsets", "[[...]]"});
}

// Regression (found in review, see docs/notes/fuzzing.md): a shape whose partial product exceeds
// int64 but whose total is 0 (a zero dimension at the end) was accepted; Shape::numel() then
// overflowed int64 (undefined).
TEST_F(SafetensorsFuzz, ShapeWithPartialProductBeyondInt64IsRefused) {
  expect_corrupt(
      write_raw(
          R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 3, 0], "data_offsets": [0, 0]}})"),
      {"'w'", "too large"});
  // A zero dimension first keeps every partial product at 0: a valid empty tensor.
  Result<SafetensorsFile> f = SafetensorsFile::open(write_raw(
      R"({"w": {"dtype": "F32", "shape": [0, 4611686018427387904, 3], "data_offsets": [0, 0]}})"));
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ(f->find("w")->shape.numel(), 0);
}

// Long or many-element values are shortened in messages rather than copied whole.
TEST_F(SafetensorsFuzz, ErrorMessagesStayShort) {
  std::string dims = "[";
  for (int i = 0; i < 10000; i++) dims += (i ? ", " : "") + std::string("1");
  dims += ", 1.5]";
  const std::string p =
      write_raw(R"({"w": {"dtype": "F32", "shape": )" + dims + R"(, "data_offsets": [0, 4]}})",
                std::string(4, '\0'));
  Result<SafetensorsFile> r = SafetensorsFile::open(p);
  ASSERT_FALSE(r.is_ok());
  EXPECT_LT(r.status().message().size(), p.size() + 200) << r.status().to_string();
}

}  // namespace
}  // namespace headroom::model
