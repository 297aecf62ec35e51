// Helpers shared by the data tests: the vocabulary location, one shared tokenizer, temporary
// directories and small file utilities.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "data/tokenizer.h"

namespace headroom::data::testing_util {

// The library falls back to "./third_party/gpt2" when it was built without HEADROOM_SOURCE_DIR;
// the tests know the source tree, so they point HEADROOM_VOCAB_DIR there unless the caller set
// it. default_vocab_dir() then finds the vocabulary from any working directory.
inline std::string vocab_dir() {
  static const std::string dir = [] {
    setenv("HEADROOM_VOCAB_DIR", HEADROOM_SOURCE_DIR "/third_party/gpt2", /*overwrite=*/0);
    return default_vocab_dir();
  }();
  return dir;
}

inline std::string missing_vocab_hint(const Status& s) {
  return "GPT-2 vocabulary could not be loaded from '" + vocab_dir() +
         "'. Run scripts/get-gpt2-vocab from the repository root (needs npm). Error: " +
         s.to_string();
}

// Loaded once per test program; null (with the load error in *error) if the files are missing.
inline const Gpt2Tokenizer* shared_tokenizer(Status* error) {
  static Result<Gpt2Tokenizer> tok = Gpt2Tokenizer::load(vocab_dir());
  if (!tok.is_ok()) {
    *error = tok.status();
    return nullptr;
  }
  return &*tok;
}

// Declares `tok` (const Gpt2Tokenizer&) or fails the test with the instructions to get the vocab.
#define HR_TEST_TOKENIZER(tok)                                                          \
  ::headroom::Status tok##_status_;                                                     \
  const ::headroom::data::Gpt2Tokenizer* tok##_ptr_ =                                   \
      ::headroom::data::testing_util::shared_tokenizer(&tok##_status_);                 \
  ASSERT_NE(tok##_ptr_, nullptr) << ::headroom::data::testing_util::missing_vocab_hint( \
      tok##_status_);                                                                   \
  [[maybe_unused]] const ::headroom::data::Gpt2Tokenizer& tok = *tok##_ptr_

// A fresh directory under testing::TempDir(), removed with its contents on destruction.
class TempDir {
 public:
  TempDir() {
    std::string pattern = ::testing::TempDir() + "/hr_data_XXXXXX";
    char* made = mkdtemp(pattern.data());
    if (made == nullptr) {
      ADD_FAILURE() << "mkdtemp failed for " << pattern;
      return;
    }
    path_ = made;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) {
      std::filesystem::permissions(path_, std::filesystem::perms::owner_all,
                                   std::filesystem::perm_options::add, ec);
      std::filesystem::remove_all(path_, ec);
    }
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void write_file(const std::string& path, const std::string& contents) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream out(path, std::ios::binary);
  out << contents;
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Names of the entries of `dir`, to check that nothing (e.g. a temp file) was left behind.
inline std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace headroom::data::testing_util
