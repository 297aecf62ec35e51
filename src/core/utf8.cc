// UTF-8 validation and U+FFFD replacement for text that goes into JSON (core/utf8.h).
#include "core/utf8.h"

#include <cstdint>

namespace headroom {

namespace {

// The length of the well-formed sequence at s[i], or 0 when it is ill-formed; *subpart is then
// the length of its maximal subpart (at least 1): the bytes that one U+FFFD replaces.
size_t sequence_at(std::string_view s, size_t i, size_t* subpart) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t b = byte(i);
  *subpart = 1;
  if (b < 0x80) return 1;
  size_t need = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // the range of the second byte (Unicode table 3-7)
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b == 0xE0) {
    need = 2, lo = 0xA0;  // no overlong three-byte forms
  } else if (b == 0xED) {
    need = 2, hi = 0x9F;  // no surrogates
  } else if (b >= 0xE1 && b <= 0xEF) {
    need = 2;
  } else if (b == 0xF0) {
    need = 3, lo = 0x90;  // no overlong four-byte forms
  } else if (b >= 0xF1 && b <= 0xF3) {
    need = 3;
  } else if (b == 0xF4) {
    need = 3, hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return 0;  // a continuation byte, C0/C1 (overlong) or F5..FF
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return 0;  // truncated: the bytes so far are the subpart
    const uint8_t c = byte(i + k);
    const uint8_t min = k == 1 ? lo : 0x80, max = k == 1 ? hi : 0xBF;
    if (c < min || c > max) return 0;
    *subpart = k + 1;
  }
  return need + 1;
}

}  // namespace

bool is_valid_utf8(std::string_view s) {
  size_t subpart = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t n = sequence_at(s, i, &subpart);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

void append_valid_utf8(std::string& out, std::string_view s) {
  size_t i = 0, subpart = 0;
  while (i < s.size()) {
    // Runs of ASCII and well-formed sequences are copied as they are.
    const size_t start = i;
    size_t n = 0;
    while (i < s.size() && (n = sequence_at(s, i, &subpart)) != 0) i += n;
    out.append(s.data() + start, i - start);
    if (i < s.size()) {
      out += "\xEF\xBF\xBD";
      i += subpart;
    }
  }
}

std::string valid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  append_valid_utf8(out, s);
  return out;
}

}  // namespace headroom
