// The fenced-device tests' shared helpers (docs/notes/fenced-device.md): a run on a fresh fenced
// device, the bit-for-bit comparison of two runs, and the files of two output directories. Used
// by tests/train/device_*_test.cc and tests/dist/device_ranks_test.cc.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <utility>

#include "backend/fenced/fenced_ops.h"
#include "train_test_util.h"

namespace headroom::train::test {

// Every regular file under `dir` (relative path -> contents); none when `dir` does not exist
// (under mpirun only rank 0 writes).
inline std::map<std::string, std::string> read_tree(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::map<std::string, std::string> files;
  if (!fs::exists(dir)) return files;
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    files[fs::relative(e.path(), dir).string()] =
        std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return files;
}

// The same files (relative path -> contents, read_tree's) byte for byte: as many, each of
// `expected`'s in `actual` with the same bytes.
inline void expect_same_files(const std::map<std::string, std::string>& expected,
                              const std::map<std::string, std::string>& actual) {
  EXPECT_EQ(actual.size(), expected.size());
  for (const auto& [path, bytes] : expected) {
    auto it = actual.find(path);
    if (it == actual.end()) {
      ADD_FAILURE() << path << " missing";
      continue;
    }
    EXPECT_TRUE(it->second == bytes) << path << " differs";
  }
}

// The two runs' every step alike, bit for bit (the loss, the gradient norm's bits: an overflowed
// step's is NaN on both, the validation loss, the tokens, a skipped step), and the final weights.
inline void expect_same_bits(const RunOutput& a, const RunOutput& b) {
  ASSERT_EQ(a.steps.size(), b.steps.size());
  for (size_t i = 0; i < a.steps.size(); i++) {
    SCOPED_TRACE(::testing::Message() << "step " << a.steps[i].step);
    EXPECT_EQ(a.steps[i].loss, b.steps[i].loss);
    EXPECT_EQ(0, std::memcmp(&a.steps[i].grad_norm, &b.steps[i].grad_norm, sizeof(double)));
    EXPECT_EQ(a.steps[i].val_loss, b.steps[i].val_loss);
    EXPECT_EQ(a.steps[i].tokens, b.steps[i].tokens);
    EXPECT_EQ(a.steps[i].skipped, b.steps[i].skipped);
  }
  ASSERT_EQ(a.params.size(), b.params.size());
  EXPECT_EQ(0, std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)));
}

// `o` on a fresh fenced device, fenced from before the first allocation: every block is
// returned by the end, and the run computed through the fence.
inline RunOutput run_fenced(TrainOptions o, std::function<void(const StepStats&)> on_step = nullptr,
                            std::function<bool(const StepStats&)> stop = nullptr) {
  backend::FencedResource device;
  device.fence();
  backend::FencedOps ops(&device);
  o.ops = &ops;
  o.device_leaf = &device;
  RunOutput r = run_collecting(o, std::move(on_step), std::move(stop));
  EXPECT_EQ(device.live_blocks(), 0u);
  EXPECT_GT(device.protect_calls(), 0u);
  return r;
}

}  // namespace headroom::train::test
