// The JSON text policy (core/utf8.h, docs/notes/json-text.md): ill-formed UTF-8 becomes U+FFFD,
// one per maximal subpart, exactly as nlohmann::json's replace handler does, so that every writer
// (nlohmann's dump_json and the report's own) produces the same text. Regression for issue #26:
// `headroom generate --json` aborted on a completion ending inside a character.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "../json_text_cases.h"
#include "core/utf8.h"

namespace headroom {
namespace {

using nlohmann::json;

const std::string kFffd = "\xEF\xBF\xBD";

// nlohmann's strict serializer as an independent judge of well-formed UTF-8.
bool nlohmann_accepts(const std::string& s) {
  try {
    (void)json(s).dump();
    return true;
  } catch (const json::type_error&) {
    return false;
  }
}

TEST(Utf8, ValidityAgreesWithNlohmannOnArbitraryBytes) {
  for (const std::string& s : test::json_text_cases()) {
    EXPECT_EQ(is_valid_utf8(s), nlohmann_accepts(s)) << testing::PrintToString(s);
  }
}

TEST(Utf8, ReplacementIsValidIdempotentAndKeepsValidText) {
  for (const std::string& s : test::json_text_cases()) {
    const std::string v = valid_utf8(s);
    EXPECT_TRUE(is_valid_utf8(v)) << testing::PrintToString(s);
    EXPECT_TRUE(nlohmann_accepts(v)) << testing::PrintToString(s);
    EXPECT_EQ(valid_utf8(v), v) << testing::PrintToString(s);
    if (is_valid_utf8(s)) EXPECT_EQ(v, s);
  }
}

TEST(Utf8, OneReplacementPerMaximalSubpart) {
  EXPECT_EQ(valid_utf8("\xE2\x82"), kFffd);  // a truncated 3-byte character
  EXPECT_EQ(valid_utf8("a\xF0\x9F\x98"
                       "b"),
            "a" + kFffd + "b");                                   // a truncated 4-byte one
  EXPECT_EQ(valid_utf8("\xE2\x82\xC3\xA9"), kFffd + "\xC3\xA9");  // the next character survives
  EXPECT_EQ(valid_utf8("\xC0\x80"), kFffd + kFffd);               // overlong: each byte
  EXPECT_EQ(valid_utf8("\xE0\x80\x80"), kFffd + kFffd + kFffd);
  EXPECT_EQ(valid_utf8("\xED\xA0\x80"), kFffd + kFffd + kFffd);              // a surrogate
  EXPECT_EQ(valid_utf8("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);  // above U+10FFFF
  EXPECT_EQ(valid_utf8("\x80\xBF"), kFffd + kFffd);
  EXPECT_EQ(valid_utf8("\xFF"), kFffd);
}

// dump_json (nlohmann with error_handler_t::replace) and valid_utf8 are one policy: the string
// read back from dump_json's text is valid_utf8 of the input, for every input.
TEST(Utf8, DumpJsonNeverThrowsAndMatchesValidUtf8) {
  for (const std::string& s : test::json_text_cases()) {
    json j = {{"text", s}, {"list", {s, 1, s}}, {s, "as a key"}};
    std::string text;
    ASSERT_NO_THROW(text = dump_json(j, 2)) << testing::PrintToString(s);
    json back;
    ASSERT_NO_THROW(back = json::parse(text)) << text;
    EXPECT_EQ(back["text"].get<std::string>(), valid_utf8(s)) << testing::PrintToString(s);
    EXPECT_EQ(back["list"][2].get<std::string>(), valid_utf8(s));
    EXPECT_TRUE(back.contains(valid_utf8(s)));
    EXPECT_NO_THROW(json::parse(dump_json(j)));  // one line, too
  }
  nlohmann::ordered_json o = {{"k", "\xFF"}};
  EXPECT_EQ(dump_json(o), "{\"k\":\"" + kFffd + "\"}");
}

}  // namespace
}  // namespace headroom
