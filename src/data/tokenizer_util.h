// Pieces shared by the tokenizer readers (tokenizer.cc, hf_tokenizer.cc, spm_tokenizer.cc): UTF-8
// stepping, GPT-2's byte alphabet, whole-file reads and merge-by-rank BPE. Internal to data/.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/status.h"

namespace headroom::data::tok_util {

inline void append_utf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Length in bytes of the well-formed UTF-8 character at s[i] (RFC 3629: no overlongs, surrogates
// or code points above U+10FFFF), or 0 if the bytes there are not one. REQUIRES: i < s.size().
inline int utf8_char_len(std::string_view s, size_t i) {
  auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return 1;
  int len = 0;
  unsigned lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  for (int k = 1; k < len; ++k) {
    auto cc = static_cast<unsigned char>(s[i + k]);
    if (k == 1 ? (cc < lo || cc > hi) : (cc < 0x80 || cc > 0xBF)) return 0;
  }
  return len;
}

// Splits `s` into characters: each well-formed UTF-8 character, and each byte that is not part
// of one, is one entry.
inline void split_chars(std::string_view s, std::vector<std::string_view>* out) {
  size_t i = 0;
  while (i < s.size()) {
    int len = utf8_char_len(s, i);
    if (len == 0) len = 1;
    out->push_back(s.substr(i, static_cast<size_t>(len)));
    i += static_cast<size_t>(len);
  }
}

// Decodes the code point of a well-formed character (as split_chars gives); -1 if it is not one.
inline int64_t code_point(std::string_view ch) {
  if (ch.empty() || utf8_char_len(ch, 0) != static_cast<int>(ch.size())) return -1;
  auto c = static_cast<unsigned char>(ch[0]);
  if (ch.size() == 1) return c;
  uint32_t v = c & (0x7F >> ch.size());
  for (size_t k = 1; k < ch.size(); ++k) v = (v << 6) | (static_cast<unsigned char>(ch[k]) & 0x3F);
  return v;
}

// GPT-2's bytes_to_unicode(): the printable Latin-1 bytes map to themselves, the other 68 bytes
// to code points 256, 257, ... in byte order, so that every token is a printable string.
inline std::array<uint32_t, 256> bytes_to_unicode() {
  std::array<uint32_t, 256> table{};
  std::array<bool, 256> printable{};
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  uint32_t n = 0;
  for (int b = 0; b < 256; ++b) table[b] = printable[b] ? b : 256 + n++;
  return table;
}

inline Result<std::string> read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::not_found(path + ": cannot open for reading");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::io_error(path + ": read failed");
  return ss.str();
}

inline bool file_exists(const std::string& path) { return std::ifstream(path).good(); }

// For messages: `s` with control characters escaped, cut to `max` bytes.
inline std::string printable(std::string_view s, size_t max = 80) {
  std::string out;
  for (size_t i = 0; i < s.size() && out.size() < max; ++i) {
    auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7F) {
      static const char* kHex = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (out.size() >= max) out += "...";
  return out;
}

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// Reads bos_token and eos_token (a string or {"content": ...}) from a tokenizer_config.json.
// Each is left unset when `path` is empty, the file is missing or the field absent, and set to ""
// when the field is null (the model has no such token, as Qwen's bos).
Status read_config_special_tokens(const std::string& path, std::optional<std::string>* bos,
                                  std::optional<std::string>* eos);

struct Merge {
  int32_t rank;
  int32_t merged;  // id of the concatenation
};
using MergeTable = std::unordered_map<uint64_t, Merge>;

// Merges `ids` in place by rank, lowest first, leftmost first among equal ranks (the order of
// GPT-2 and of Hugging Face's BPE), with a heap of candidates over a linked list: O(n log n).
void bpe_merge_by_rank(const MergeTable& merges, std::vector<int32_t>* ids);

}  // namespace headroom::data::tok_util
