// Parity of the tokenizer.json and tokenizer.model readers with independent encoders (committed
// fixtures from tools/tokenizer/make_hf_fixtures.js: tokenizers.js and SentencePiece compiled to
// WebAssembly) on real vocabularies, load_tokenizer()'s choice of reader, special tokens, decode
// round trips, and clear errors for bad files.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "data/hf_tokenizer.h"
#include "data/spm_tokenizer.h"
#include "data/tokenizer.h"
#include "test_util.h"

namespace headroom::data {
namespace {

using nlohmann::json;
using testing_util::read_file;
using testing_util::TempDir;
using testing_util::write_file;

const std::string kFixtures = HEADROOM_SOURCE_DIR "/tests/data/fixtures/";
const std::string kTokenizers = HEADROOM_SOURCE_DIR "/third_party/tokenizers/";

// Loads third_party/tokenizers/<name> once per program; null with the reason when it is absent.
const Tokenizer* real_tokenizer(const std::string& name, std::string* why,
                                bool parse_special = false) {
  static std::map<std::pair<std::string, bool>, Result<std::unique_ptr<Tokenizer>>> cache;
  const std::string dir = kTokenizers + name;
  if (!std::filesystem::exists(dir)) {
    *why = dir + " is missing; run scripts/get-tokenizers (needs npm)";
    return nullptr;
  }
  auto key = std::pair{name, parse_special};
  auto it = cache.find(key);
  if (it == cache.end()) {
    TokenizerOptions o;
    o.parse_special_tokens = parse_special;
    it = cache.emplace(key, load_tokenizer(dir, o)).first;
  }
  if (!it->second.is_ok()) {
    *why = "loading " + dir + " failed: " + it->second.status().to_string();
    return nullptr;
  }
  return it->second->get();
}

// Declares `tok` (const Tokenizer&) from third_party/tokenizers/<name>, or skips the test with
// the reason (CI runs scripts/setup, which fetches them). A directory that is present but does
// not load fails the test.
#define HR_REAL_TOKENIZER(tok, name, ...)                                   \
  std::string tok##_why_;                                                   \
  const ::headroom::data::Tokenizer* tok##_ptr_ =                           \
      real_tokenizer(name, &tok##_why_ __VA_OPT__(, ) __VA_ARGS__);         \
  if (tok##_ptr_ == nullptr) {                                              \
    ASSERT_EQ(tok##_why_.find("loading"), std::string::npos) << tok##_why_; \
    GTEST_SKIP() << tok##_why_;                                             \
  }                                                                         \
  const ::headroom::data::Tokenizer& tok = *tok##_ptr_

void expect_same_ids(const Tokenizer& tok, const std::vector<int32_t>& got,
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

// Compares with hf_<name>_expected.json: the whole input and every short case.
void check_fixture(const Tokenizer& tok, const std::string& name) {
  const json fx = json::parse(read_file(kFixtures + "hf_" + name + "_expected.json"));
  const std::string input = read_file(kFixtures + "hf_tokenizer_input.txt");
  ASSERT_FALSE(input.empty());
  expect_same_ids(tok, tok.encode(input), fx["ids"].get<std::vector<int32_t>>(),
                  name + ": hf_tokenizer_input.txt");
  int cases = 0;
  for (const auto& c : fx["cases"]) {
    const std::string text = c["text"].get<std::string>();
    expect_same_ids(tok, tok.encode(text), c["ids"].get<std::vector<int32_t>>(),
                    name + ": case " + c["text"].dump());
    ++cases;
  }
  EXPECT_GT(cases, 30);
}

// decode(encode(x)) == x on the fixture text, the cases and random bytes.
void check_round_trip(const Tokenizer& tok, bool arbitrary_bytes) {
  std::vector<std::string> inputs = {read_file(kFixtures + "hf_tokenizer_input.txt")};
  const json fx = json::parse(read_file(kFixtures + "hf_llama3_expected.json"));
  for (const auto& c : fx["cases"]) inputs.push_back(c["text"].get<std::string>());
  if (arbitrary_bytes) {
    std::mt19937 rng(11);
    for (int k = 0; k < 20; ++k) {
      std::string s(1 + rng() % 200, '\0');
      for (char& ch : s) ch = static_cast<char>(rng());
      inputs.push_back(s);
    }
    inputs.push_back("caf\xE9 \xFF\xFE ok \xE2\x82 cut");
  }
  for (const std::string& s : inputs) {
    std::vector<int32_t> ids = tok.encode(s);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok.vocab_size()) << id;
    EXPECT_EQ(tok.decode(ids), s) << json(s).dump();
  }
}

TEST(HfTokenizer, Llama3MatchesTokenizersJs) {
  HR_REAL_TOKENIZER(tok, "llama3");
  check_fixture(tok, "llama3");
}

TEST(HfTokenizer, Llama3RoundTripsAnyBytes) {
  HR_REAL_TOKENIZER(tok, "llama3");
  check_round_trip(tok, /*arbitrary_bytes=*/true);
}

TEST(HfTokenizer, Llama3VocabularyAndSpecialTokens) {
  HR_REAL_TOKENIZER(tok, "llama3");
  EXPECT_EQ(tok.vocab_size(), 128256);
  EXPECT_EQ(tok.bos_token(), 128000);  // <|begin_of_text|>, from tokenizer_config.json
  EXPECT_EQ(tok.eos_token(), 128001);  // <|end_of_text|>
  EXPECT_EQ(tok.name(), "llama3");
  const auto& hf = dynamic_cast<const HfTokenizer&>(tok);
  EXPECT_TRUE(hf.byte_level());
  EXPECT_EQ(hf.token_id("<|eot_id|>"), 128009);
  // Without parse_special_tokens the text of a special token is plain text.
  std::vector<int32_t> plain = tok.encode("<|begin_of_text|>Hello");
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 128000), 0);
  EXPECT_EQ(tok.decode(plain), "<|begin_of_text|>Hello");
  const std::vector<int32_t> special{128000, 128009};
  EXPECT_EQ(tok.decode(special), "<|begin_of_text|><|eot_id|>");
}

TEST(HfTokenizer, Llama3RecognisesSpecialTokensWhenAsked) {
  HR_REAL_TOKENIZER(tok, "llama3", /*parse_special=*/true);
  HR_REAL_TOKENIZER(plain, "llama3");
  const std::string text = "<|begin_of_text|>Hello world<|eot_id|> and more";
  std::vector<int32_t> want{128000};
  for (int32_t id : plain.encode("Hello world")) want.push_back(id);
  want.push_back(128009);
  for (int32_t id : plain.encode(" and more")) want.push_back(id);
  EXPECT_EQ(tok.encode(text), want);
  EXPECT_EQ(tok.decode(tok.encode(text)), text);
}

TEST(HfTokenizer, MistralMatchesTokenizersJs) {
  HR_REAL_TOKENIZER(tok, "mistral");
  check_fixture(tok, "mistral");
}

TEST(HfTokenizer, MistralRoundTripsAnyBytes) {
  // Byte fallback covers every byte; the decoder's Strip removes the space that the Prepend
  // normalizer added.
  HR_REAL_TOKENIZER(tok, "mistral");
  check_round_trip(tok, /*arbitrary_bytes=*/true);
}

TEST(HfTokenizer, MistralVocabularyAndSpecialTokens) {
  HR_REAL_TOKENIZER(tok, "mistral");
  EXPECT_EQ(tok.vocab_size(), 32000);
  EXPECT_EQ(tok.bos_token(), 1);
  EXPECT_EQ(tok.eos_token(), 2);
  const auto& hf = dynamic_cast<const HfTokenizer&>(tok);
  EXPECT_FALSE(hf.byte_level());
  EXPECT_EQ(hf.token_id("<0x0A>"), 13);
  // "\n" has no piece of its own: byte fallback.
  EXPECT_EQ(tok.encode("\n"), (std::vector<int32_t>{28705, 13}));
  std::vector<int32_t> specials{1, 2};
  EXPECT_EQ(tok.decode(specials), "<s></s>");
}

TEST(HfTokenizer, MistralRecognisesSpecialTokensWhenAsked) {
  HR_REAL_TOKENIZER(tok, "mistral", /*parse_special=*/true);
  HR_REAL_TOKENIZER(plain, "mistral");
  std::vector<int32_t> ids = tok.encode("<s>Hi</s>");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 1);
  EXPECT_EQ(ids.back(), 2);
  std::vector<int32_t> inner(ids.begin() + 1, ids.end() - 1);
  EXPECT_EQ(inner, plain.encode("Hi"));
  const std::vector<int32_t> text_s = plain.encode("<s>");
  EXPECT_EQ(std::count(text_s.begin(), text_s.end(), 1), 0);
}

TEST(HfTokenizer, Qwen3MatchesTokenizersJs) {
  // NFC normalizer, merges written as ["a", "b"] pairs, single-digit pre-tokens.
  HR_REAL_TOKENIZER(tok, "qwen3");
  check_fixture(tok, "qwen3");
}

TEST(HfTokenizer, Qwen3RoundTripsNormalizedText) {
  // NFC changes text that is not already NFC (the fixture's "e" + U+0301 becomes U+00E9), so
  // the round trip gives back the NFC form; everything else comes back byte for byte.
  HR_REAL_TOKENIZER(tok, "qwen3");
  const std::string input = read_file(kFixtures + "hf_tokenizer_input.txt");
  std::string nfc = input;
  for (auto [from, to] :
       {std::pair<std::string, std::string>{"e\xCC\x81", "\xC3\xA9"}, {"n\xCC\x83", "\xC3\xB1"}}) {
    for (size_t p; (p = nfc.find(from)) != std::string::npos;) nfc.replace(p, from.size(), to);
  }
  ASSERT_NE(nfc, input);
  EXPECT_EQ(tok.decode(tok.encode(input)), nfc);
  const std::string bytes = "caf\xE9 \xFF\xFE ok \xE2\x82 cut \xF0\x9F\x98\x80";
  EXPECT_EQ(tok.decode(tok.encode(bytes)), bytes);
}

TEST(HfTokenizer, Qwen3VocabularyAndSpecialTokens) {
  HR_REAL_TOKENIZER(tok, "qwen3");
  EXPECT_EQ(tok.vocab_size(), 151669);
  EXPECT_EQ(tok.eos_token(), 151645);  // <|im_end|>, from tokenizer_config.json
  EXPECT_EQ(tok.bos_token(), -1);      // tokenizer_config.json says bos_token: null
  EXPECT_EQ(dynamic_cast<const HfTokenizer&>(tok).token_id("<|endoftext|>"), 151643);
}

TEST(SpmTokenizer, Llama2ModelMatchesSentencePiece) {
  HR_REAL_TOKENIZER(tok, "llama2-spm");
  check_fixture(tok, "llama2-spm");
}

TEST(SpmTokenizer, Llama2ModelRoundTripsAnyBytes) {
  HR_REAL_TOKENIZER(tok, "llama2-spm");
  check_round_trip(tok, /*arbitrary_bytes=*/true);
}

TEST(SpmTokenizer, Llama2ModelVocabulary) {
  HR_REAL_TOKENIZER(tok, "llama2-spm");
  EXPECT_EQ(tok.vocab_size(), 32000);
  EXPECT_EQ(tok.bos_token(), 1);
  EXPECT_EQ(tok.eos_token(), 2);
  const auto& spm = dynamic_cast<const SpmTokenizer&>(tok);
  EXPECT_EQ(spm.unk_token(), 0);
  EXPECT_EQ(spm.pieces()[15043].piece, "\xE2\x96\x81Hello");
  EXPECT_EQ(tok.encode("Hello"), (std::vector<int32_t>{15043}));
  // Control pieces decode to nothing, as in SentencePiece.
  std::vector<int32_t> ids{1, 15043, 2};
  EXPECT_EQ(tok.decode(ids), "Hello");
}

TEST(SpmTokenizer, TruncatedRealModelNamesTheFieldAndOffset) {
  std::string why;
  if (!std::filesystem::exists(kTokenizers + "llama2-spm/tokenizer.model")) {
    GTEST_SKIP() << kTokenizers << "llama2-spm is missing; run scripts/get-tokenizers";
  }
  const std::string bytes = read_file(kTokenizers + "llama2-spm/tokenizer.model");
  for (size_t cut : {bytes.size() / 2, bytes.size() - 1, size_t{1}, size_t{3}}) {
    Result<SpmTokenizer> t =
        SpmTokenizer::parse(std::string_view(bytes).substr(0, cut), "cut.model", "cut");
    ASSERT_FALSE(t.is_ok()) << cut;
    EXPECT_EQ(t.status().code(), StatusCode::kCorrupt) << t.status().to_string();
    EXPECT_NE(t.status().message().find("cut.model"), std::string::npos);
    EXPECT_NE(t.status().message().find(" at byte "), std::string::npos) << t.status().message();
  }
}

// ---------------------------------------------------------------------------------------------
// GPT-2 as a tokenizer.json (pre_tokenizer ByteLevel with its regex): must agree with the GPT-2
// reader id for id, with merges written as strings and as pairs.

json gpt2_tokenizer_json(bool merges_as_pairs) {
  json vocab = json::parse(read_file(testing_util::vocab_dir() + "/encoder.json"));
  json merges = json::array();
  const std::string bpe = read_file(testing_util::vocab_dir() + "/vocab.bpe");
  size_t start = 0;
  while (start < bpe.size()) {
    size_t end = bpe.find('\n', start);
    if (end == std::string::npos) end = bpe.size();
    std::string line = bpe.substr(start, end - start);
    start = end + 1;
    if (line.empty() || line.starts_with("#version")) continue;
    size_t sp = line.find(' ');
    if (merges_as_pairs) {
      merges.push_back(json::array({line.substr(0, sp), line.substr(sp + 1)}));
    } else {
      merges.push_back(line);
    }
  }
  return json{{"version", "1.0"},
              {"added_tokens",
               json::array({{{"id", 50256}, {"content", "<|endoftext|>"}, {"special", true}}})},
              {"normalizer", nullptr},
              {"pre_tokenizer",
               {{"type", "ByteLevel"},
                {"add_prefix_space", false},
                {"trim_offsets", true},
                {"use_regex", true}}},
              {"post_processor", nullptr},
              {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}}},
              {"model",
               {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"vocab", vocab},
                {"merges", merges}}}};
}

TEST(HfTokenizer, Gpt2TokenizerJsonMatchesGpt2ReaderWithBothMergeSpellings) {
  HR_TEST_TOKENIZER(gpt2);
  const std::string input = read_file(kFixtures + "tokenizer_input.txt") +
                            read_file(kFixtures + "hf_tokenizer_input.txt");
  for (bool pairs : {false, true}) {
    TempDir dir;
    write_file(dir.file("tokenizer.json"), gpt2_tokenizer_json(pairs).dump());
    Result<std::unique_ptr<Tokenizer>> t = load_tokenizer(dir.path());
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    const Tokenizer& tok = **t;
    expect_same_ids(gpt2, tok.encode(input), gpt2.encode(input),
                    pairs ? "merges as pairs" : "merges as strings");
    EXPECT_EQ(tok.decode(tok.encode(input)), input);
    EXPECT_EQ(tok.vocab_size(), 50257);
    EXPECT_EQ(tok.eos_token(), 50256);  // <|endoftext|> by its well-known name
    EXPECT_EQ(tok.bos_token(), 50256);
  }
}

// ---------------------------------------------------------------------------------------------
// Small hand-made files: SentencePiece-style features and errors.

const char* kSp = "\xE2\x96\x81";  // ▁

json tiny_sentencepiece_json() {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    vocab[buf] = 3 + b;
  }
  int id = 259;
  for (std::string t : {std::string(kSp), std::string("a"), std::string("b"), std::string("ab"),
                        std::string(kSp) + "ab", std::string("c")}) {
    vocab[t] = id++;
  }
  return json{
      {"added_tokens", json::array({{{"id", 1}, {"content", "<s>"}, {"special", true}},
                                    {{"id", 2}, {"content", "</s>"}, {"special", true}}})},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         json::array({{{"type", "Prepend"}, {"prepend", kSp}},
                      {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kSp}}})}}},
      {"pre_tokenizer", nullptr},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         json::array({{{"type", "Replace"}, {"pattern", {{"String", kSp}}}, {"content", " "}},
                      {{"type", "ByteFallback"}},
                      {{"type", "Fuse"}},
                      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
      {"model",
       {{"type", "BPE"},
        {"unk_token", "<unk>"},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"vocab", vocab},
        {"merges", json::array({"a b", json::array({kSp, "ab"})})}}}};
}

Result<HfTokenizer> load_json(const TempDir& dir, const json& j, const TokenizerOptions& o = {}) {
  write_file(dir.file("tokenizer.json"), j.dump());
  return HfTokenizer::load(dir.file("tokenizer.json"), "", "tiny", o);
}

TEST(HfTokenizer, SentencePieceStyleMergesByteFallbackAndDecode) {
  TempDir dir;
  Result<HfTokenizer> t = load_json(dir, tiny_sentencepiece_json());
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  // "ab ab" -> "▁ab▁ab": "a b" merges first, then "▁ ab".
  EXPECT_EQ(t->encode("ab ab"), (std::vector<int32_t>{263, 263}));
  // "x" has no piece: its byte <0x78> (id 3 + 0x78).
  EXPECT_EQ(t->encode("abx"), (std::vector<int32_t>{263, 3 + 0x78}));
  EXPECT_EQ(t->decode(t->encode("abx c")), "abx c");
  EXPECT_EQ(t->decode(t->encode(" lead")), " lead");
  EXPECT_EQ(t->bos_token(), 1);
  EXPECT_EQ(t->eos_token(), 2);
  EXPECT_TRUE(t->encode("").empty());
}

TEST(HfTokenizer, UnicodeNormalizers) {
  TempDir dir;
  json j = tiny_sentencepiece_json();
  auto with = [&](const char* form) {
    json n = j;
    n["normalizer"]["normalizers"].insert(n["normalizer"]["normalizers"].begin(),
                                          json{{"type", form}});
    Result<HfTokenizer> t = load_json(dir, n);
    EXPECT_TRUE(t.is_ok()) << t.status().to_string();
    return t;
  };
  Result<HfTokenizer> plain = load_json(dir, j);
  ASSERT_TRUE(plain.is_ok());
  Result<HfTokenizer> nfc = with("NFC"), nfd = with("NFD"), nfkc = with("NFKC");
  ASSERT_TRUE(nfc.is_ok() && nfd.is_ok() && nfkc.is_ok());
  // e + COMBINING ACUTE composes to U+00E9 under NFC, and U+00E9 decomposes under NFD.
  EXPECT_EQ(nfc->encode("caf"
                        "e\xCC\x81"),
            plain->encode("caf\xC3\xA9"));
  EXPECT_EQ(nfd->encode("caf\xC3\xA9"), plain->encode("caf"
                                                      "e\xCC\x81"));
  // The ligature U+FB01 is "fi" under NFKC only.
  EXPECT_EQ(nfkc->encode("\xEF\xAC\x81"), plain->encode("fi"));
  EXPECT_EQ(nfc->encode("\xEF\xAC\x81"), plain->encode("\xEF\xAC\x81"));
  // Bytes that are not UTF-8 pass through, and what is around them is still normalized.
  EXPECT_EQ(nfc->encode("e\xCC\x81\xFF"
                        "e\xCC\x81"),
            plain->encode("\xC3\xA9\xFF\xC3\xA9"));
}

TEST(HfTokenizer, UnknownCharactersFuseIntoOneUnkWithoutByteFallback) {
  TempDir dir;
  json j = tiny_sentencepiece_json();
  j["model"]["byte_fallback"] = false;
  Result<HfTokenizer> t = load_json(dir, j);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(t->encode("xyz"), (std::vector<int32_t>{259, 0}));  // ▁, then one <unk>
  j["model"]["fuse_unk"] = false;
  t = load_json(dir, j);
  ASSERT_TRUE(t.is_ok());
  EXPECT_EQ(t->encode("xyz"), (std::vector<int32_t>{259, 0, 0, 0}));
}

TEST(HfTokenizer, MetaspacePreTokenizer) {
  // The newer spelling of the same tokenizer: no normalizer, pre_tokenizer Metaspace, and a
  // Metaspace decoder.
  TempDir dir;
  json j = tiny_sentencepiece_json();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {
      {"type", "Metaspace"}, {"replacement", kSp}, {"prepend_scheme", "first"}, {"split", false}};
  j["decoder"] = {
      {"type", "Sequence"},
      {"decoders",
       json::array({{{"type", "ByteFallback"}},
                    {{"type", "Metaspace"}, {"replacement", kSp}, {"prepend_scheme", "first"}}})}};
  TokenizerOptions o;
  o.parse_special_tokens = true;
  Result<HfTokenizer> t = load_json(dir, j, o);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(t->encode("ab ab"), (std::vector<int32_t>{263, 263}));
  // prepend_scheme "first": the text after <s> is not at the start, so it gets no ▁.
  EXPECT_EQ(t->encode("ab<s>ab"), (std::vector<int32_t>{263, 1, 262}));
  EXPECT_EQ(t->decode(t->encode("ab ab")), "ab ab");
}

// GPT-2's byte alphabet: the character (UTF-8) that stands for each byte.
std::vector<std::string> byte_alphabet() {
  std::vector<std::string> v(256);
  std::array<bool, 256> printable{};
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  uint32_t n = 0;
  for (int b = 0; b < 256; ++b) {
    uint32_t cp = printable[b] ? b : 256 + n++;
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    v[b] = s;
  }
  return v;
}

TEST(HfTokenizer, SplitBehaviours) {
  // A tiny byte-level vocabulary: every byte, no merges; the pieces show in the ids only through
  // a Split with Removed (the '-' disappears).
  TempDir dir;
  json vocab = json::object();
  const std::vector<std::string> b2u = byte_alphabet();
  for (int b = 0; b < 256; ++b) vocab[b2u[b]] = b;
  vocab["ab"] = 256;
  vocab["-a"] = 257;
  auto make = [&](const std::string& behavior) {
    return json{{"pre_tokenizer",
                 {{"type", "Sequence"},
                  {"pretokenizers", json::array({{{"type", "Split"},
                                                  {"pattern", {{"String", "-"}}},
                                                  {"behavior", behavior},
                                                  {"invert", false}},
                                                 {{"type", "ByteLevel"}, {"use_regex", false}}})}}},
                {"decoder", {{"type", "ByteLevel"}}},
                {"model",
                 {{"type", "BPE"},
                  {"vocab", vocab},
                  {"merges", json::array({"a b", json::array({"-", "a"})})}}}};
  };
  auto ids = [&](const std::string& behavior, const std::string& text) {
    Result<HfTokenizer> t = load_json(dir, make(behavior));
    EXPECT_TRUE(t.is_ok()) << t.status().to_string();
    return t.is_ok() ? t->encode(text) : std::vector<int32_t>{};
  };
  // "ab-ab": Isolated keeps "-" alone, so "ab" merges twice; MergedWithNext makes "-ab" (where
  // "- a" outranks nothing: "a b" is rank 0), Removed drops the '-'.
  EXPECT_EQ(ids("Isolated", "ab-ab"), (std::vector<int32_t>{256, '-', 256}));
  EXPECT_EQ(ids("Removed", "ab-ab"), (std::vector<int32_t>{256, 256}));
  EXPECT_EQ(ids("MergedWithNext", "ab-ab"), (std::vector<int32_t>{256, '-', 256}));
  EXPECT_EQ(ids("MergedWithNext", "ab-a"), (std::vector<int32_t>{256, 257}));
  EXPECT_EQ(ids("MergedWithPrevious", "ab-a"), (std::vector<int32_t>{256, '-', 'a'}));
  EXPECT_EQ(ids("Contiguous", "a--a"), (std::vector<int32_t>{'a', '-', '-', 'a'}));
}

TEST(HfTokenizer, DigitsAndByteLevelPrefixSpace) {
  // SmolLM's shape: Digits, then ByteLevel with GPT-2's regex.
  TempDir dir;
  const std::vector<std::string> b2u = byte_alphabet();
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[b2u[b]] = b;
  vocab["12"] = 256;
  vocab["ab"] = 257;
  vocab[b2u[' '] + "ab"] = 258;
  auto make = [&](bool individual, bool prefix) {
    return json{
        {"pre_tokenizer",
         {{"type", "Sequence"},
          {"pretokenizers",
           json::array(
               {{{"type", "Digits"}, {"individual_digits", individual}},
                {{"type", "ByteLevel"}, {"add_prefix_space", prefix}, {"use_regex", true}}})}}},
        {"decoder", {{"type", "ByteLevel"}}},
        {"model",
         {{"type", "BPE"},
          {"vocab", vocab},
          {"merges", json::array({"1 2", "a b", json::array({b2u[' '], "ab"})})}}}};
  };
  Result<HfTokenizer> joined = load_json(dir, make(false, false));
  ASSERT_TRUE(joined.is_ok()) << joined.status().to_string();
  EXPECT_EQ(joined->encode("12ab"), (std::vector<int32_t>{256, 257}));
  Result<HfTokenizer> single = load_json(dir, make(true, false));
  ASSERT_TRUE(single.is_ok());
  EXPECT_EQ(single->encode("12ab"), (std::vector<int32_t>{'1', '2', 257}));
  // add_prefix_space: each piece that does not start with a space gets one.
  Result<HfTokenizer> prefixed = load_json(dir, make(false, true));
  ASSERT_TRUE(prefixed.is_ok());
  EXPECT_EQ(prefixed->encode("ab"), (std::vector<int32_t>{258}));
  EXPECT_EQ(prefixed->decode(prefixed->encode("ab")), " ab");
}

void expect_error(const Result<HfTokenizer>& t, StatusCode code,
                  std::initializer_list<const char*> mentions) {
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), code) << t.status().to_string();
  for (const char* m : mentions) {
    EXPECT_NE(t.status().message().find(m), std::string::npos)
        << "'" << m << "' not in: " << t.status().message();
  }
}

TEST(HfTokenizer, BadFilesGiveClearErrors) {
  TempDir dir;
  const std::string good = tiny_sentencepiece_json().dump();

  // Truncated JSON, at many lengths: Corrupt, naming the file.
  for (size_t cut : {size_t{0}, size_t{1}, good.size() / 3, good.size() / 2, good.size() - 1}) {
    write_file(dir.file("tokenizer.json"), good.substr(0, cut));
    expect_error(HfTokenizer::load(dir.file("tokenizer.json"), "", "x"), StatusCode::kCorrupt,
                 {"tokenizer.json", "not valid JSON"});
  }
  json j = tiny_sentencepiece_json();
  j["model"]["type"] = "WordPiece";
  expect_error(load_json(dir, j), StatusCode::kUnsupported, {"model.type", "WordPiece"});

  j = tiny_sentencepiece_json();
  j["model"]["merges"].push_back("a zz");
  expect_error(load_json(dir, j), StatusCode::kCorrupt, {"model.merges[2]", "'zz'", "model.vocab"});

  j = tiny_sentencepiece_json();
  j["model"]["merges"].push_back("b c");  // "bc" is not in the vocabulary
  expect_error(load_json(dir, j), StatusCode::kCorrupt, {"model.merges[2]", "makes", "'bc'"});

  j = tiny_sentencepiece_json();
  j["model"]["merges"].push_back("abc");
  expect_error(load_json(dir, j), StatusCode::kCorrupt, {"model.merges[2]", "one space"});

  j = tiny_sentencepiece_json();
  j["model"]["merges"].push_back(json::array({"a"}));
  expect_error(load_json(dir, j), StatusCode::kCorrupt, {"model.merges[2]"});

  j = tiny_sentencepiece_json();
  j["model"]["vocab"]["a"] = -4;
  expect_error(load_json(dir, j), StatusCode::kCorrupt, {"model.vocab", "'a'", "-4"});

  j = tiny_sentencepiece_json();
  j["model"]["vocab"]["a"] = 200000000;  // would make a table of 2e8 entries
  expect_error(load_json(dir, j), StatusCode::kCorrupt, {"200000000", "nearly dense"});

  j = tiny_sentencepiece_json();
  j["model"]["vocab"]["a"] = "one";
  expect_error(load_json(dir, j), StatusCode::kCorrupt, {"model.vocab", "'a'"});

  j = tiny_sentencepiece_json();
  j["model"]["unk_token"] = "<nope>";
  expect_error(load_json(dir, j), StatusCode::kCorrupt, {"model.unk_token", "<nope>"});

  j = tiny_sentencepiece_json();
  j["normalizer"] = {{"type", "Lowercase"}};
  expect_error(load_json(dir, j), StatusCode::kUnsupported, {"normalizer.type", "Lowercase"});

  j = tiny_sentencepiece_json();
  j["pre_tokenizer"] = {
      {"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  expect_error(load_json(dir, j), StatusCode::kUnsupported, {"pre_tokenizer.pattern.Regex"});

  j = tiny_sentencepiece_json();
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers", json::array({{{"type", "ByteLevel"}}, {{"type", "Digits"}}})}};
  expect_error(load_json(dir, j), StatusCode::kUnsupported, {"ByteLevel", "last"});

  j = tiny_sentencepiece_json();
  j["added_tokens"][0]["id"] = "one";
  expect_error(load_json(dir, j), StatusCode::kCorrupt, {"added_tokens[0].id"});

  j = tiny_sentencepiece_json();
  j.erase("model");
  expect_error(load_json(dir, j), StatusCode::kCorrupt, {"model"});

  j = tiny_sentencepiece_json();
  j["model"]["dropout"] = 0.1;
  expect_error(load_json(dir, j), StatusCode::kUnsupported, {"model.dropout"});

  // tokenizer_config.json naming a token that does not exist.
  write_file(dir.file("tokenizer.json"), good);
  write_file(dir.file("tokenizer_config.json"), R"({"bos_token": "<nope>"})");
  expect_error(
      HfTokenizer::load(dir.file("tokenizer.json"), dir.file("tokenizer_config.json"), "x"),
      StatusCode::kCorrupt, {"tokenizer_config.json", "bos_token", "<nope>"});
  write_file(dir.file("tokenizer_config.json"), R"({"eos_token": {"content": "</s>"}})");
  Result<HfTokenizer> ok =
      HfTokenizer::load(dir.file("tokenizer.json"), dir.file("tokenizer_config.json"), "x");
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(ok->eos_token(), 2);
}

// ---------------------------------------------------------------------------------------------
// tokenizer.model written here (a small protobuf writer), for SentencePiece's rules and errors.

void put_varint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}
void put_tag(int field, int wire, std::string* out) {
  put_varint(uint64_t(field) << 3 | wire, out);
}
void put_bytes(int field, const std::string& s, std::string* out) {
  put_tag(field, 2, out);
  put_varint(s.size(), out);
  *out += s;
}
void put_float(int field, float f, std::string* out) {
  put_tag(field, 5, out);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  for (int k = 0; k < 4; ++k) out->push_back(static_cast<char>(bits >> (8 * k)));
}
void put_int(int field, int64_t v, std::string* out) {
  put_tag(field, 0, out);
  put_varint(static_cast<uint64_t>(v), out);
}

struct TestPiece {
  std::string piece;
  float score;
  int type;
};

std::string model_proto(const std::vector<TestPiece>& pieces, int model_type = 2,
                        bool byte_fallback = true, bool dummy_prefix = true) {
  std::string out;
  for (const TestPiece& p : pieces) {
    std::string m;
    put_bytes(1, p.piece, &m);
    put_float(2, p.score, &m);
    if (p.type != 1) put_int(3, p.type, &m);
    put_bytes(1, m, &out);
  }
  std::string trainer;
  put_int(3, model_type, &trainer);
  put_int(35, byte_fallback, &trainer);
  put_int(40, 0, &trainer);
  put_int(41, 1, &trainer);
  put_int(42, 2, &trainer);
  put_int(43, -1, &trainer);  // pad_id -1: a ten-byte varint
  put_bytes(2, trainer, &out);
  std::string norm;
  put_bytes(1, "identity", &norm);
  put_int(3, dummy_prefix, &norm);
  put_int(4, 0, &norm);
  put_bytes(3, norm, &out);
  return out;
}

std::vector<TestPiece> tiny_pieces() {
  std::vector<TestPiece> p = {{"<unk>", 0, 2}, {"<s>", 0, 3}, {"</s>", 0, 3}};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    p.push_back({buf, 0, 6});
  }
  // 259..: the merge order comes from the scores, highest first.
  const std::string sp = kSp;
  p.push_back({sp + sp, -100, 1});  // 259, merged last
  p.push_back({"ab", -1, 1});       // 260
  p.push_back({sp + "ab", -2, 1});  // 261
  p.push_back({"bc", -0.5, 1});     // 262: outranks "ab", so "abc" -> a, bc
  p.push_back({sp, -3, 1});         // 263
  for (const char* c : {"a", "b", "c"}) p.push_back({c, -5, 1});  // 264, 265, 266
  p.push_back({"<user>", 0, 4});                                  // 267
  return p;
}

TEST(SpmTokenizer, MergesByScoreWithByteFallback) {
  Result<SpmTokenizer> t = SpmTokenizer::parse(model_proto(tiny_pieces()), "tiny.model", "tiny");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(t->vocab_size(), 268);
  EXPECT_EQ(t->encode("ab"), (std::vector<int32_t>{261}));
  EXPECT_EQ(t->encode("abc"), (std::vector<int32_t>{263, 264, 262}));  // "bc" scores higher
  EXPECT_EQ(t->encode("ab  ab"), (std::vector<int32_t>{261, 263, 261}));
  EXPECT_EQ(t->encode("x"), (std::vector<int32_t>{263, 3 + 'x'}));
  // User-defined pieces are matched whole and never merged.
  EXPECT_EQ(t->encode("a<user>b"), (std::vector<int32_t>{263, 264, 267, 265}));
  for (const std::string s : {"ab  ab", "x y\nz", " lead", "", "caf\xE9", "a<user>b"}) {
    EXPECT_EQ(t->decode(t->encode(s)), s);
  }
  EXPECT_TRUE(t->encode("").empty());
}

TEST(SpmTokenizer, UnknownWithoutByteFallbackIsOneUnkPerRun) {
  Result<SpmTokenizer> t =
      SpmTokenizer::parse(model_proto(tiny_pieces(), 2, /*byte_fallback=*/false), "t.model", "t");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(t->encode("xyz"), (std::vector<int32_t>{263, 0}));
  EXPECT_EQ(t->decode(t->encode("xyz")), " \xE2\x81\x87 ");  // SentencePiece's unk surface
}

TEST(SpmTokenizer, ControlPiecesAreTextUnlessAsked) {
  TokenizerOptions o;
  o.parse_special_tokens = true;
  Result<SpmTokenizer> plain = SpmTokenizer::parse(model_proto(tiny_pieces()), "t.model", "t");
  Result<SpmTokenizer> special = SpmTokenizer::parse(model_proto(tiny_pieces()), "t.model", "t", o);
  ASSERT_TRUE(plain.is_ok() && special.is_ok());
  std::vector<int32_t> a = plain->encode("<s>ab");
  EXPECT_EQ(std::count(a.begin(), a.end(), 1), 0);
  EXPECT_EQ(special->encode("<s>ab"), (std::vector<int32_t>{1, 261}));
}

TEST(SpmTokenizer, BadModelsGiveClearErrors) {
  const std::string good = model_proto(tiny_pieces());
  // Every truncation is refused or parses as a shorter valid model; never a crash.
  int refused = 0;
  for (size_t cut = 0; cut < good.size(); ++cut) {
    Result<SpmTokenizer> t =
        SpmTokenizer::parse(std::string_view(good).substr(0, cut), "t.model", "t");
    if (!t.is_ok()) {
      ++refused;
      EXPECT_NE(t.status().message().find("t.model"), std::string::npos) << t.status().message();
    }
  }
  // Only cuts inside the normalizer_spec (last, about 20 bytes) can leave a valid model.
  EXPECT_GT(refused, static_cast<int>(good.size()) - 24);

  auto expect = [](const std::string& bytes, StatusCode code, const char* mention) {
    Result<SpmTokenizer> t = SpmTokenizer::parse(bytes, "t.model", "t");
    ASSERT_FALSE(t.is_ok()) << mention;
    EXPECT_EQ(t.status().code(), code) << t.status().to_string();
    EXPECT_NE(t.status().message().find(mention), std::string::npos) << t.status().message();
  };
  expect(model_proto(tiny_pieces(), /*model_type=*/1), StatusCode::kUnsupported, "UNIGRAM");
  std::vector<TestPiece> dup = tiny_pieces();
  dup.push_back({"ab", 0, 1});
  expect(model_proto(dup), StatusCode::kCorrupt, "unique");
  std::vector<TestPiece> bad_type = tiny_pieces();
  bad_type[260].type = 9;
  expect(model_proto(bad_type), StatusCode::kCorrupt, "pieces[260].type");
  std::vector<TestPiece> no_unk = tiny_pieces();
  no_unk[0].type = 3;
  expect(model_proto(no_unk), StatusCode::kCorrupt, "unk_id");
  expect("\x0a\xff\xff\xff\xff\x0f", StatusCode::kCorrupt, "runs past the end");
  expect("\x0b", StatusCode::kCorrupt, "wire type 3");
  expect(std::string("\x0a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", 12), StatusCode::kCorrupt,
         "varint");
  expect("", StatusCode::kCorrupt, "no pieces");
}

// ---------------------------------------------------------------------------------------------

TEST(LoadTokenizer, PicksTheReaderByTheFilesPresent) {
  HR_TEST_TOKENIZER(gpt2);
  TempDir dir;
  write_file(dir.file("encoder.json"), read_file(testing_util::vocab_dir() + "/encoder.json"));
  write_file(dir.file("vocab.bpe"), read_file(testing_util::vocab_dir() + "/vocab.bpe"));
  Result<std::unique_ptr<Tokenizer>> t = load_tokenizer(dir.path());
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ((*t)->name(), "gpt2");
  EXPECT_EQ((*t)->vocab_size(), 50257);

  write_file(dir.file("tokenizer.model"), model_proto(tiny_pieces()));
  t = load_tokenizer(dir.path());
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_NE(dynamic_cast<const SpmTokenizer*>(t->get()), nullptr);
  EXPECT_EQ((*t)->vocab_size(), 268);

  write_file(dir.file("tokenizer.json"), tiny_sentencepiece_json().dump());
  t = load_tokenizer(dir.path());
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_NE(dynamic_cast<const HfTokenizer*>(t->get()), nullptr);
  EXPECT_EQ((*t)->name(), std::filesystem::path(dir.path()).filename().string());
}

TEST(LoadTokenizer, MissingFilesNameTheDirectoryAndWhatWasLookedFor) {
  TempDir dir;
  Result<std::unique_ptr<Tokenizer>> t = load_tokenizer(dir.path());
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  for (const char* m : {"tokenizer.json", "tokenizer.model", "encoder.json"}) {
    EXPECT_NE(t.status().message().find(m), std::string::npos) << t.status().message();
  }
  EXPECT_NE(t.status().message().find(dir.path()), std::string::npos);
  t = load_tokenizer(dir.file("nowhere"));
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("nowhere"), std::string::npos);
}

}  // namespace
}  // namespace headroom::data
