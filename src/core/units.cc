// Parsing and printing byte sizes.
#include "core/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>

namespace headroom {

Result<uint64_t> parse_bytes(std::string_view text) {
  std::string s(text);
  auto bad = [&](const char* why) {
    return Status::invalid_argument("size '" + s + "' " + why +
                                    " (write e.g. 4GiB, 512MiB, 24GB or a number of bytes)");
  };
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) i++;
  size_t start = i;
  bool dot = false;
  while (i < s.size() &&
         (std::isdigit(static_cast<unsigned char>(s[i])) || (s[i] == '.' && !dot))) {
    if (s[i] == '.') dot = true;
    i++;
  }
  if (i == start) return bad("does not start with a number");
  double value = std::strtod(s.substr(start, i - start).c_str(), nullptr);
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) i++;
  std::string unit;
  for (; i < s.size(); i++) {
    if (std::isspace(static_cast<unsigned char>(s[i]))) break;
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(s[i])));
  }
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) i++;
  if (i != s.size()) return bad("has trailing text");
  double mult;
  if (unit.empty() || unit == "b")
    mult = 1;
  else if (unit == "k" || unit == "kib")
    mult = double(kKiB);
  else if (unit == "m" || unit == "mib")
    mult = double(kMiB);
  else if (unit == "g" || unit == "gib")
    mult = double(kGiB);
  else if (unit == "t" || unit == "tib")
    mult = double(kGiB) * 1024.0;
  else if (unit == "kb")
    mult = 1e3;
  else if (unit == "mb")
    mult = 1e6;
  else if (unit == "gb")
    mult = 1e9;
  else if (unit == "tb")
    mult = 1e12;
  else
    return bad("has an unknown unit");
  double bytes = value * mult;
  // Below 2^64 after rounding: llround would overflow above 2^63, the cast above 2^64.
  if (!std::isfinite(bytes) || std::round(bytes) >= 0x1p64) return bad("is too large");
  return static_cast<uint64_t>(std::round(bytes));
}

std::string format_bytes(uint64_t bytes) {
  char buf[64];
  if (bytes < kKiB) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
    return buf;
  }
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = double(bytes) / 1024.0;
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    u++;
  }
  const char* fmt = v >= 100 ? "%.0f %s" : (v >= 10 ? "%.1f %s" : "%.2f %s");
  std::snprintf(buf, sizeof buf, fmt, v, units[u]);
  return buf;
}

}  // namespace headroom
