// Tokenizer parity with the reference GPT-2 encoder (gpt-3-encoder, via a committed fixture),
// round trips on arbitrary bytes, both vocabulary layouts, and load errors.
#include "data/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "test_util.h"

namespace headroom::data {
namespace {

using testing_util::read_file;
using testing_util::TempDir;
using testing_util::write_file;

const std::string kFixtures = HEADROOM_SOURCE_DIR "/tests/data/fixtures/";

nlohmann::json expected_fixture() {
  return nlohmann::json::parse(read_file(kFixtures + "tokenizer_expected.json"));
}

// Reports the first difference with the decoded neighbourhood, which says which rule broke.
void expect_same_ids(const Gpt2Tokenizer& tok, const std::vector<int32_t>& got,
                     const std::vector<int32_t>& want, const std::string& what) {
  if (got == want) return;
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  auto around = [&](const std::vector<int32_t>& v) {
    size_t b = i >= 3 ? i - 3 : 0, e = std::min(v.size(), i + 4);
    std::string s;
    for (size_t k = b; k < e; ++k) {
      std::vector<int32_t> one{v[k]};
      s += std::to_string(v[k]) + "'" + tok.decode(one) + "' ";
    }
    return s;
  };
  ADD_FAILURE() << what << ": ids differ first at index " << i << " (got " << got.size()
                << " ids, want " << want.size() << ")\n  got:  " << around(got)
                << "\n  want: " << around(want);
}

TEST(Tokenizer, VocabularyIsInstalled) {
  // Fails (never skips) without the vocabulary, and says how to get it.
  HR_TEST_TOKENIZER(tok);
  EXPECT_EQ(tok.vocab_size(), 50257);
  EXPECT_EQ(tok.eot_token(), 50256);
}

TEST(Tokenizer, MatchesGpt3EncoderOnFixture) {
  HR_TEST_TOKENIZER(tok);
  const std::string input = read_file(kFixtures + "tokenizer_input.txt");
  ASSERT_FALSE(input.empty());
  nlohmann::json fx = expected_fixture();
  expect_same_ids(tok, tok.encode(input), fx["ids"].get<std::vector<int32_t>>(),
                  "tokenizer_input.txt");
  for (const auto& c : fx["cases"]) {
    const std::string text = c["text"].get<std::string>();
    expect_same_ids(tok, tok.encode(text), c["ids"].get<std::vector<int32_t>>(),
                    "case " + c["text"].dump());
  }
}

TEST(Tokenizer, DecodeInvertsEncode) {
  HR_TEST_TOKENIZER(tok);
  const std::string input = read_file(kFixtures + "tokenizer_input.txt");
  EXPECT_EQ(tok.decode(tok.encode(input)), input);
  EXPECT_TRUE(tok.encode("").empty());
  EXPECT_EQ(tok.decode({}), "");
}

TEST(Tokenizer, EndOfTextIsPlainText) {
  HR_TEST_TOKENIZER(tok);
  std::vector<int32_t> ids = tok.encode("<|endoftext|>");
  EXPECT_GT(ids.size(), 1u);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), tok.eot_token()), 0);
  std::vector<int32_t> eot{tok.eot_token()};
  EXPECT_EQ(tok.decode(eot), "<|endoftext|>");
}

TEST(Tokenizer, InvalidUtf8RoundTripsByteForByte) {
  HR_TEST_TOKENIZER(tok);
  std::vector<std::string> inputs = {
      "caf\xE9 cr\xE8me",        // Latin-1 accents
      "\xFF\xFE\xFD",            // bytes never valid in UTF-8
      "ok \xE2\x82 truncated",   // a 3-byte sequence cut short
      "\xED\xA0\x80 surrogate",  // an encoded surrogate
      "\xC0\xAF overlong",       // an overlong '/'
      std::string("nul\0inside", 10),
      "trailing lead byte \xF0",
  };
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  inputs.push_back(all);
  std::mt19937 rng(7);
  for (int k = 0; k < 20; ++k) {
    std::string s(1 + rng() % 300, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    inputs.push_back(s);
  }
  for (const std::string& s : inputs) {
    std::vector<int32_t> ids = tok.encode(s);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok.vocab_size());
    EXPECT_EQ(tok.decode(ids), s);
  }
  // Valid text around an invalid byte tokenises as it would alone.
  std::vector<int32_t> a = tok.encode("hello"), mixed = tok.encode("hello\xFF");
  ASSERT_GE(mixed.size(), a.size());
  EXPECT_TRUE(std::equal(a.begin(), a.end(), mixed.begin()));
}

TEST(Tokenizer, DecodeOutOfRangeIdsGivesReplacementCharacter) {
  HR_TEST_TOKENIZER(tok);
  std::vector<int32_t> ids{-1, 50257, 50303};
  EXPECT_EQ(tok.decode(ids), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(Tokenizer, LongPreTokensStayFastAndExact) {
  // 256 KiB without a space is one pre-token; BPE must not be quadratic in its length.
  HR_TEST_TOKENIZER(tok);
  for (char c : {'a', '7', '!', ' '}) {
    std::string s(1 << 18, c);
    std::vector<int32_t> ids = tok.encode(s);
    // GPT-2 has merges for runs of letters, digits and punctuation, but none for runs of spaces.
    if (c == ' ') {
      EXPECT_EQ(ids.size(), s.size());
    } else {
      EXPECT_LE(ids.size(), s.size() / 2) << c;
    }
    EXPECT_EQ(tok.decode(ids), s);
  }
}

TEST(Tokenizer, ThreadsShareTheCache) {
  HR_TEST_TOKENIZER(tok);
  const std::string input = read_file(kFixtures + "tokenizer_input.txt");
  const std::vector<int32_t> want = tok.encode(input);
  std::vector<std::vector<int32_t>> got(4);
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (int r = 0; r < 20; ++r) got[t] = tok.encode(input);
      });
    }
  }
  for (const auto& g : got) EXPECT_EQ(g, want);
}

TEST(Tokenizer, LoadsHuggingFaceLayout) {
  HR_TEST_TOKENIZER(tok);
  TempDir dir;
  write_file(dir.file("vocab.json"), read_file(testing_util::vocab_dir() + "/encoder.json"));
  std::string merges = read_file(testing_util::vocab_dir() + "/vocab.bpe");
  write_file(dir.file("merges.txt"), merges);
  Result<Gpt2Tokenizer> hf = Gpt2Tokenizer::load(dir.path());
  ASSERT_TRUE(hf.is_ok()) << hf.status().to_string();
  const std::string input = read_file(kFixtures + "tokenizer_input.txt");
  EXPECT_EQ(hf->encode(input), tok.encode(input));
  EXPECT_EQ(hf->eot_token(), tok.eot_token());
}

TEST(Tokenizer, MissingVocabularySaysHowToGetIt) {
  TempDir dir;
  Result<Gpt2Tokenizer> t = Gpt2Tokenizer::load(dir.path());
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_NE(t.status().message().find("scripts/get-gpt2-vocab"), std::string::npos);
  EXPECT_NE(t.status().message().find(dir.path()), std::string::npos);
}

TEST(Tokenizer, CorruptVocabularyFilesNameTheProblem) {
  TempDir dir;
  write_file(dir.file("encoder.json"), "{\"a\": 0, \"b\": ");
  write_file(dir.file("vocab.bpe"), "#version: 0.2\n");
  Result<Gpt2Tokenizer> t = Gpt2Tokenizer::load(dir.path());
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(t.status().message().find("encoder.json"), std::string::npos);

  // A valid vocabulary with a malformed merge line: the message names file and line.
  HR_TEST_TOKENIZER(tok);
  write_file(dir.file("encoder.json"), read_file(testing_util::vocab_dir() + "/encoder.json"));
  write_file(dir.file("vocab.bpe"), "#version: 0.2\n\xC4\xA0 t\nthree parts here\n");
  t = Gpt2Tokenizer::load(dir.path());
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("vocab.bpe:3"), std::string::npos) << t.status().message();
}

TEST(Tokenizer, DefaultVocabDirHonoursEnvironment) {
  const std::string saved = testing_util::vocab_dir();
  setenv("HEADROOM_VOCAB_DIR", "/some/where", 1);
  EXPECT_EQ(default_vocab_dir(), "/some/where");
  setenv("HEADROOM_VOCAB_DIR", saved.c_str(), 1);
  EXPECT_EQ(default_vocab_dir(), saved);
}

}  // namespace
}  // namespace headroom::data
