// `headroom prepare --tokenizer DIR`: a tokenizer.json or tokenizer.model instead of GPT-2, the
// header's vocabulary and eot, and a clear error for a directory without a tokenizer.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "e2e_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

using e2e::Outcome;
using e2e::run;

class PrepareTokenizerCli : public e2e::TempDirTest {};

TEST_F(PrepareTokenizerCli, TokenizerJsonFromTheSeedCorpus) {
  // The fuzz seed is a small byte-level tokenizer.json; it needs nothing from third_party.
  fs::create_directories(path("tok"));
  fs::copy_file(HEADROOM_SOURCE_DIR "/fuzz/corpus/hf_tokenizer/bytelevel.json",
                path("tok/tokenizer.json"));
  write("a.txt", "hello world\n%\nhello again\n");
  Outcome r = run("prepare " + path("a.txt") + " --doc-separator % --tokenizer " + path("tok") +
                  " --out " + path("a.tokens") + " --json");
  ASSERT_EQ(r.code, 0) << r.out;
  nlohmann::json j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  EXPECT_EQ(j["tokenizer"], "tok");
  EXPECT_EQ(j["documents"], 2);
  EXPECT_EQ(j["vocab_size"], 264);  // 256 bytes, 7 merges, <|end_of_text|>
  EXPECT_EQ(j["eot"], 263);
  EXPECT_TRUE(fs::exists(path("a.tokens")));
}

TEST_F(PrepareTokenizerCli, Llama3TokenizerJson) {
  const std::string dir = HEADROOM_SOURCE_DIR "/third_party/tokenizers/llama3";
  if (!fs::exists(dir)) GTEST_SKIP() << dir << " is missing; run scripts/get-tokenizers";
  write("a.txt", "The quick brown fox.\n");
  Outcome r =
      run("prepare " + path("a.txt") + " --tokenizer " + dir + " --out " + path("a.tokens"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("tokenizer llama3, vocab 128256"), std::string::npos) << r.out;
}

TEST_F(PrepareTokenizerCli, DirectoryWithoutTokenizerIsAClearError) {
  fs::create_directories(path("empty"));
  write("a.txt", "text\n");
  Outcome r = run("prepare " + path("a.txt") + " --tokenizer " + path("empty") + " --out " +
                  path("a.tokens"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find(path("empty")), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tokenizer.json"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(path("a.tokens")));
}

}  // namespace
}  // namespace headroom
