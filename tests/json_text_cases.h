// Byte strings that are not all UTF-8, for the tests that every JSON writer keeps its output valid
// JSON (docs/notes/json-text.md): every byte alone and all 256 together, truncated multi-byte
// sequences, overlong forms, surrogates, code points above U+10FFFF, stray continuation bytes,
// and random strings (fixed seed).
#pragma once

#include <random>
#include <string>
#include <vector>

namespace headroom::test {

// `random` random strings of 0-48 bytes are added to the fixed cases (half of them drawn from
// the bytes 0x80-0xFF, where the ill-formed sequences are).
inline std::vector<std::string> json_text_cases(int random = 500) {
  std::vector<std::string> c = {"", "plain", "h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80",
                                std::string("ctl \0\x01\x1F\x7F \"q\" \\ </script> <!-- &", 25)};
  for (int b = 0; b < 256; ++b) c.push_back(std::string(1, char(b)));
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(char(b));
  c.push_back(all);
  // Every proper prefix of a 2-, 3- and 4-byte character, alone, before ASCII and before another
  // character.
  for (std::string ch : {"\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80", "\xF4\x8F\xBF\xBF"}) {
    for (size_t n = 1; n < ch.size(); ++n) {
      const std::string cut = ch.substr(0, n);
      c.push_back(cut);
      c.push_back("ab" + cut);
      c.push_back(cut + "z");
      c.push_back(cut + ch);
    }
  }
  for (const char* s : {
           "\xC0\x80", "\xC1\xBF", "\xE0\x80\x80", "\xE0\x9F\xBF", "\xF0\x80\x80\x80",
           "\xF0\x8F\xBF\xBF",                                          // overlong forms
           "\xED\xA0\x80", "\xED\xBF\xBF", "\xED\xA0\xBD\xED\xB8\x80",  // surrogates, a CESU-8 pair
           "\xF4\x90\x80\x80", "\xF5\x80\x80\x80", "\xF8\x88\x80\x80\x80", "\xFF\xFE", "\xFE\xFF",
           "\x80", "\xBF", "\x80\x80\x80",
           "a\x80"
           "b",  // stray continuation bytes
       }) {
    c.push_back(s);
  }
  std::mt19937 rng(20261203);
  for (int i = 0; i < random; ++i) {
    const int n = int(rng() % 49);
    const bool high = i % 2 == 0;
    std::string s;
    for (int k = 0; k < n; ++k) s.push_back(char(high ? 0x80 + rng() % 0x80 : rng() % 256));
    c.push_back(s);
  }
  return c;
}

}  // namespace headroom::test
