// The token file reader on fuzzer-shaped input (docs/notes/fuzzing.md): the seed corpus opens and
// reads, and every committed crashing input is refused with an error naming the file.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "data/token_file.h"

namespace headroom::data {
namespace {

namespace fs = std::filesystem;

TEST(TokenFileFuzz, SeedCorpusOpensAndEveryTokenReads) {
  int seen = 0;
  for (const auto& e : fs::directory_iterator(HEADROOM_SOURCE_DIR "/fuzz/corpus/token_file")) {
    Result<TokenFile> f = TokenFile::open(e.path().string());
    ASSERT_TRUE(f.is_ok()) << f.status().to_string();
    std::vector<int32_t> tokens(size_t(f->size()));
    f->copy(0, f->size(), tokens.data());
    for (int32_t t : tokens) EXPECT_LT(t, f->vocab_size());
    seen++;
  }
  EXPECT_GT(seen, 0);
}

TEST(TokenFileFuzz, RegressionInputsAreRefusedCleanly) {
  const fs::path dir = HEADROOM_SOURCE_DIR "/tests/fuzz_regressions/token_file";
  if (!fs::exists(dir)) GTEST_SKIP() << "no committed inputs: the fuzzer has found no crash here";
  for (const auto& e : fs::directory_iterator(dir)) {
    Result<TokenFile> f = TokenFile::open(e.path().string());
    if (!f.is_ok()) {
      EXPECT_NE(f.status().message().find(e.path().string()), std::string::npos)
          << f.status().to_string();
    }
  }
}

}  // namespace
}  // namespace headroom::data
