// Reading a checkpoint's trainer_state.json and files: every malformed value (including the cases
// the fuzzer found, docs/notes/fuzzing.md) is an error naming the file, the field and the value,
// never a crash, an undefined conversion or an overflow later in the trainer or the CLI.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "model/gpt2.h"
#include "train/checkpoint.h"

namespace headroom::train {
namespace {

namespace fs = std::filesystem;

constexpr const char* kFiles[] = {"config.json", "trainer_state.json", "model.safetensors",
                                  "optimizer.safetensors"};
constexpr std::string_view kSeparator =
    "\n--headroom-fuzz-next-file--\n";  // fuzz/checkpoint_fuzzer.cc

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_file(const fs::path& p, std::string_view bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(f.good()) << p;
}

// The tiny config of fuzz/corpus/checkpoint/ (n_positions 4).
const char* kConfig =
    R"({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 4, "vocab_size": 8,
        "n_positions": 4})";

// A valid trainer_state.json with `field` replaced by the JSON text `value` ("" removes it).
std::string state_with(const std::string& field, const std::string& value) {
  const std::vector<std::pair<std::string, std::string>> fields = {
      {"version", "1"},      {"step", "7"},    {"data_position", "96"}, {"total_steps", "20"},
      {"warmup_steps", "3"}, {"lr", "0.0006"}, {"min_lr_ratio", "0.1"}, {"micro_batch", "2"},
      {"accumulation", "2"}, {"seq", "4"},     {"seed", "1337"},        {"data", "\"d.tok\""}};
  std::string text = "{";
  for (const auto& [name, v] : fields) {
    const std::string& out = name == field ? value : v;
    if (out.empty()) continue;
    if (text.size() > 1) text += ", ";
    text += "\"" + name + "\": " + out;
  }
  return text + "}";
}

class CheckpointState : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) /
            ("hr_ckpt_state_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    dir_ = root_ / "checkpoints" / "step-000007";
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // Writes config.json and `state` as trainer_state.json; expects find_checkpoint to refuse
  // them with a message naming trainer_state.json and each of `parts`.
  void expect_refused(const std::string& state, std::vector<std::string> parts,
                      const std::string& config = kConfig) {
    write_file(dir_ / "config.json", config);
    write_file(dir_ / "trainer_state.json", state);
    Result<LoadedCheckpoint> c = find_checkpoint(root_.string());
    ASSERT_FALSE(c.is_ok()) << "accepted: " << state.substr(0, 200);
    parts.push_back((dir_ / "trainer_state.json").string());
    for (const std::string& part : parts) {
      EXPECT_NE(c.status().message().find(part), std::string::npos)
          << "message does not mention '" << part << "': " << c.status().to_string();
    }
  }

  // Writes the files of a fuzz input (fuzz/checkpoint_fuzzer.cc's format) into dir_.
  void write_fuzz_input(std::string_view rest) {
    for (const char* name : kFiles) {
      fs::remove(dir_ / name);
      if (rest.data() == nullptr) continue;
      const size_t cut = rest.find(kSeparator);
      write_file(dir_ / name, rest.substr(0, cut));
      rest =
          cut == std::string_view::npos ? std::string_view() : rest.substr(cut + kSeparator.size());
    }
  }

  // find_checkpoint and load_checkpoint as the trainer calls them.
  Status load() {
    HR_ASSIGN_OR_RETURN(LoadedCheckpoint c, find_checkpoint(root_.string()));
    const model::ParamTable table = model::gpt2_param_table(c.config);
    if (table.total_floats > (int64_t(1) << 20)) return Status::ok();
    std::vector<float> p(size_t(table.total_floats)), m(p.size()), v(p.size());
    return load_checkpoint(c, table, p.data(), m.data(), v.data());
  }

  fs::path root_, dir_;
};

TEST_F(CheckpointState, ValidStateIsRead) {
  write_file(dir_ / "config.json", kConfig);
  write_file(dir_ / "trainer_state.json", state_with("", ""));
  Result<LoadedCheckpoint> c = find_checkpoint(root_.string());
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->dir, dir_.string());
  EXPECT_EQ(c->state.step, 7);
  EXPECT_EQ(c->state.data_position, 96);
  EXPECT_EQ(c->state.seed, 1337u);
  EXPECT_FLOAT_EQ(c->state.lr, 0.0006f);
  EXPECT_EQ(c->state.data, "d.tok");
}

TEST_F(CheckpointState, FuzzSeedCorpusLoads) {
  int seen = 0;
  for (const auto& e : fs::directory_iterator(HEADROOM_SOURCE_DIR "/fuzz/corpus/checkpoint")) {
    write_fuzz_input(read_file(e.path()));
    Status s = load();
    EXPECT_TRUE(s.is_ok()) << e.path() << ": " << s.to_string();
    seen++;
  }
  EXPECT_GT(seen, 0);
}

// Every input the fuzzer found a crash with stays refused with an error naming the checkpoint.
TEST_F(CheckpointState, FuzzRegressionInputsAreRefusedCleanly) {
  const fs::path dir = HEADROOM_SOURCE_DIR "/tests/fuzz_regressions/checkpoint";
  if (!fs::exists(dir)) GTEST_SKIP() << "no committed inputs";
  for (const auto& e : fs::directory_iterator(dir)) {
    write_fuzz_input(read_file(e.path()));
    Status s = load();
    if (!s.is_ok()) {
      EXPECT_NE(s.message().find(root_.string()), std::string::npos)
          << e.path() << ": " << s.to_string();
    }
  }
}

TEST_F(CheckpointState, NotAnObjectOrMissingField) {
  expect_refused("[1]", {"expected a JSON object", "an array of 1 elements"});
  expect_refused("{", {"not valid JSON"});
  expect_refused(state_with("seq", ""), {"missing field 'seq'"});
  expect_refused(state_with("version", ""), {"missing field 'version'"});
}

// Regression (found by fuzz_checkpoint, tests/fuzz_regressions/checkpoint/): fields were converted
// with get<int>() before any check, so a float beyond int's range ("warmup_steps":
// 310737418250.0006, "version": 10737418250.0) was undefined behaviour (UBSan:
// float-cast-overflow), and an integer beyond it wrapped silently.
TEST_F(CheckpointState, OutOfRangeNumbersAreRefusedBeforeConversion) {
  expect_refused(state_with("version", "10737418250.0"), {"version 10737418250.0 is not"});
  expect_refused(state_with("warmup_steps", "310737418250.0006"),
                 {"field 'warmup_steps' = 310737418250.0006"});
  expect_refused(state_with("version", "1e300"), {"version 1e+300 is not supported"});
  expect_refused(state_with("version", "4294967297"), {"version 4294967297"});
  expect_refused(state_with("step", "1e300"), {"field 'step' = 1e+300", "an integer in [0, "});
  expect_refused(state_with("step", "-1"), {"field 'step' = -1"});
  expect_refused(state_with("total_steps", "4294967296"), {"field 'total_steps' = 4294967296"});
  expect_refused(state_with("micro_batch", "2147483648"), {"field 'micro_batch' = 2147483648"});
  expect_refused(state_with("micro_batch", "0"), {"field 'micro_batch' = 0"});
  expect_refused(state_with("data_position", "9223372036854775808"),
                 {"field 'data_position' = 9223372036854775808"});
  expect_refused(state_with("seed", "-5"), {"field 'seed' = -5"});
  expect_refused(state_with("seq", "2.5"), {"field 'seq' = 2.5"});
  expect_refused(state_with("lr", "1e300"), {"field 'lr' = 1e+300"});
  expect_refused(state_with("lr", "-0.1"), {"field 'lr' = -0.1"});
  expect_refused(state_with("min_lr_ratio", "2"), {"field 'min_lr_ratio' = 2", "[0, 1]"});
  expect_refused(state_with("data", "7"), {"field 'data' = 7", "a string"});
}

// Regression (found in review, see docs/notes/fuzzing.md): micro_batch x accumulation, the global
// batch the CLI computes in int on resume, could overflow.
TEST_F(CheckpointState, GlobalBatchBeyondIntIsRefused) {
  expect_refused(state_with("accumulation", "1073741824"),
                 {"'accumulation' = 1073741824", "'micro_batch' = 2", "global batch"});
}

TEST_F(CheckpointState, SeqBeyondTheModelsPositionsIsRefused) {
  expect_refused(state_with("seq", "5"), {"field 'seq' = 5", "n_positions = 4"});
}

// json::dump recurses once per nesting level (a deeply nested value in config.json or a
// safetensors header overflowed the stack that way); no message here dumps a whole value.
TEST_F(CheckpointState, DeeplyNestedValueIsAnErrorNotAStackOverflow) {
  const int depth = 200000;
  const std::string nested = std::string(depth, '[') + std::string(depth, ']');
  expect_refused(state_with("version", nested), {"version an array of 1 elements"});
  expect_refused(state_with("step", nested), {"field 'step' = an array of 1 elements"});
}

}  // namespace
}  // namespace headroom::train
