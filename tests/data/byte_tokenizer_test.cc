// The byte tokenizer (data/byte_tokenizer.h): one id a byte, 256 the end of a document, and what
// load_tokenizer("bytes") returns.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "data/byte_tokenizer.h"
#include "data/tokenizer.h"

namespace headroom::data {
namespace {

TEST(ByteTokenizer, EveryByteStringRoundTripsAndIdsAreTheBytes) {
  ByteTokenizer t;
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  all += "\xC3(invalid \xF0\x9F utf-8";
  const std::vector<int32_t> ids = t.encode(all);
  ASSERT_EQ(ids.size(), all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(ids[i], static_cast<unsigned char>(all[i])) << i;
  }
  EXPECT_EQ(t.decode(ids), all);
  EXPECT_EQ(t.vocab_size(), 257);
  EXPECT_EQ(t.eos_token(), 256);
  EXPECT_EQ(t.bos_token(), -1);
}

TEST(ByteTokenizer, EndOfDocumentDecodesAsALineAndOutOfRangeAsReplacement) {
  ByteTokenizer t;
  const std::vector<int32_t> ids = {'a', ByteTokenizer::kEos, 'b', 257, -1};
  EXPECT_EQ(t.decode(ids), "a\nb\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(ByteTokenizer, LoadTokenizerBytesGivesIt) {
  auto t = load_tokenizer("bytes");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ((*t)->name(), "bytes");
  EXPECT_EQ((*t)->vocab_size(), 257);
  EXPECT_EQ((*t)->encode("Hi"), (std::vector<int32_t>{'H', 'i'}));
  // Any other missing directory is still an error naming it and the choices.
  auto missing = load_tokenizer("no-such-tokenizer-dir");
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().to_string().find("no-such-tokenizer-dir"), std::string::npos);
  EXPECT_NE(missing.status().to_string().find("bytes"), std::string::npos);
}

}  // namespace
}  // namespace headroom::data
