// The tokenizer.json and tokenizer.model readers on fuzzer-shaped input (docs/notes/fuzzing.md):
// the seed corpora load and encode, and committed crashing inputs are refused cleanly.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "data/hf_tokenizer.h"
#include "data/spm_tokenizer.h"
#include "test_util.h"

namespace headroom::data {
namespace {

namespace fs = std::filesystem;

void encodes_and_round_trips(const Tokenizer& t, const std::string& what) {
  const std::string text = "the hello world 12345 the\n";
  std::vector<int32_t> ids = t.encode(text);
  EXPECT_FALSE(ids.empty()) << what;
  for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < t.vocab_size()) << what << ": " << id;
  (void)t.decode(ids);
}

TEST(TokenizerFuzz, HfSeedCorpusLoadsAndEncodes) {
  int seen = 0;
  for (const auto& e : fs::directory_iterator(HEADROOM_SOURCE_DIR "/fuzz/corpus/hf_tokenizer")) {
    Result<HfTokenizer> t = HfTokenizer::load(e.path().string(), "", "seed");
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    encodes_and_round_trips(*t, e.path().string());
    ++seen;
  }
  EXPECT_GT(seen, 0);
}

TEST(TokenizerFuzz, HfByteLevelSeedRoundTrips) {
  Result<HfTokenizer> t =
      HfTokenizer::load(HEADROOM_SOURCE_DIR "/fuzz/corpus/hf_tokenizer/bytelevel.json", "", "seed");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(t->encode("hello"), (std::vector<int32_t>{t->token_id("hello")}));
  EXPECT_EQ(t->eos_token(), t->token_id("<|end_of_text|>"));
  const std::string s = "hello world, \xF0\x9F\x98\x80 \xFF";
  EXPECT_EQ(t->decode(t->encode(s)), s);
}

TEST(TokenizerFuzz, SpmSeedCorpusParsesAndEncodes) {
  int seen = 0;
  for (const auto& e : fs::directory_iterator(HEADROOM_SOURCE_DIR "/fuzz/corpus/spm_model")) {
    Result<SpmTokenizer> t =
        SpmTokenizer::parse(testing_util::read_file(e.path().string()), e.path().string(), "seed");
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    encodes_and_round_trips(*t, e.path().string());
    ++seen;
  }
  EXPECT_GT(seen, 0);
}

TEST(TokenizerFuzz, RegressionInputsAreRefusedCleanly) {
  for (const char* target : {"hf_tokenizer", "spm_model"}) {
    const fs::path dir = fs::path(HEADROOM_SOURCE_DIR "/tests/fuzz_regressions") / target;
    if (!fs::exists(dir)) continue;  // the fuzzer has found nothing here
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string p = e.path().string();
      Status s = std::string(target) == "hf_tokenizer"
                     ? HfTokenizer::load(p, "", "r").status()
                     : SpmTokenizer::parse(testing_util::read_file(p), p, "r").status();
      if (!s.is_ok()) EXPECT_NE(s.message().find(p), std::string::npos) << s.to_string();
    }
  }
}

}  // namespace
}  // namespace headroom::data
